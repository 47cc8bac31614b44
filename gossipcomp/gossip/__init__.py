"""Gossip algorithms over a neighbourhood, and a registry to build them from spec strings."""

from __future__ import annotations

from gossipcomp.gossip.base import GossipAlgorithm, LinkStats, NamedParams, Neighbourhood
from gossipcomp.gossip.byzantine import ATTACKS, Attack, Byzantine, make_attack
from gossipcomp.gossip.choco import Choco
from gossipcomp.gossip.clipping import CLIP_RULES, ClipRadius, parse_clip
from gossipcomp.gossip.def_atc import DEFATC
from gossipcomp.gossip.dpsgd import DPSGD
from gossipcomp.gossip.powergossip import PowerGossip
from gossipcomp.gossip.specs import BuildContext, SpecBuilt, parse_options

ALGORITHMS: dict[str, SpecBuilt] = {
    DPSGD.name: DPSGD,
    PowerGossip.name: PowerGossip,
    Choco.name: Choco,
    DEFATC.name: DEFATC,
}


def make_algorithm(spec: str, context: BuildContext) -> GossipAlgorithm:
    """Build a registered algorithm from its spec (gossip/specs.py), e.g.
    "choco:compressor=sign,steps=4,gamma=0.7"; ValueError naming what is wrong."""
    name, options = parse_options(spec, ALGORITHMS)
    return ALGORITHMS[name].from_options(options, context)


__all__ = [
    "ALGORITHMS",
    "ATTACKS",
    "BuildContext",
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
