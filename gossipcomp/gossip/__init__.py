"""Gossip algorithms over a neighbourhood, and a registry to build them by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gossipcomp.gossip.base import GossipAlgorithm, LinkStats, NamedParams, Neighbourhood
from gossipcomp.gossip.byzantine import ATTACKS, Attack, Byzantine, make_attack
from gossipcomp.gossip.choco import Choco
from gossipcomp.gossip.clipping import CLIP_RULES, ClipRadius, parse_clip
from gossipcomp.gossip.def_atc import DEFATC
from gossipcomp.gossip.dpsgd import DPSGD
from gossipcomp.gossip.powergossip import PowerGossip

ALGORITHMS: dict[str, Callable[..., GossipAlgorithm]] = {
    DPSGD.name: DPSGD,
    PowerGossip.name: PowerGossip,
    Choco.name: Choco,
    DEFATC.name: DEFATC,
}


def make_algorithm(name: str, **options: Any) -> GossipAlgorithm:
    """Build a registered algorithm; an unknown name lists the ones that exist."""
    try:
        factory = ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}") from None
    return factory(**options)


__all__ = [
    "ALGORITHMS",
    "ATTACKS",
    "CLIP_RULES",
    "DEFATC",
    "Attack",
    "Byzantine",
    "Choco",
    "ClipRadius",
    "DPSGD",
    "GossipAlgorithm",
    "LinkStats",
    "NamedParams",
    "Neighbourhood",
    "PowerGossip",
    "make_algorithm",
    "make_attack",
    "parse_clip",
]
