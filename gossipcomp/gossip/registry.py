"""The registered gossip algorithms, each under its name in catalog.ALGORITHM_NAMES, and
building one from its spec string."""

from __future__ import annotations

from gossipcomp.gossip.base import GossipAlgorithm
from gossipcomp.gossip.catalog import ALGORITHM_NAMES
from gossipcomp.gossip.choco import Choco
from gossipcomp.gossip.choco_edge import EdgeChoco
from gossipcomp.gossip.def_atc import DEFATC
from gossipcomp.gossip.dpsgd import DPSGD
from gossipcomp.gossip.powergossip import PowerGossip
from gossipcomp.gossip.specs import BuildContext, SpecBuilt, parse_options

ALGORITHMS: dict[str, SpecBuilt] = dict(
    zip(ALGORITHM_NAMES, (DPSGD, PowerGossip, Choco, EdgeChoco, DEFATC), strict=True)
)


def make_algorithm(spec: str, context: BuildContext) -> GossipAlgorithm:
    """Build a registered algorithm from its spec (gossip/specs.py), e.g.
    "choco:compressor=sign,steps=4,gamma=0.7"; ValueError naming what is wrong."""
    name, options = parse_options(spec, ALGORITHMS)
    return ALGORITHMS[name].from_options(options, context)
