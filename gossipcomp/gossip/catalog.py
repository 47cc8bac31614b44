"""The names, defaults and bounds of gossip/ that flag tables show: the algorithms (registry.py
builds one under each name), the Byzantine attacks (byzantine.py), the attack scale and the
exchanges per round. Nothing here imports torch, so `gossipcomp peer --help` loads none."""

from __future__ import annotations

ALGORITHM_NAMES = ("dpsgd", "powergossip", "choco", "choco-edge", "def")
ATTACK_NAMES = ("sign_flip", "scale")
DEFAULT_SCALE = 4.0  # what a Byzantine rank multiplies its model by (sign_flip: by -scale)
MAX_GOSSIP_STEPS = 100  # exchanges per round, each waiting on every neighbour: more is a typo
