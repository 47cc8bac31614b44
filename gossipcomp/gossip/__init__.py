"""Gossip algorithms over a neighbourhood, and a registry to build them from spec strings.

Each public name is imported from its module on first use (PEP 562): the command line's flag
tables read catalog.py (the algorithms' and attacks' names) without loading torch.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.gossip.base": "GossipAlgorithm LinkStats NamedParams Neighbourhood",
    "gossipcomp.gossip.byzantine": "ATTACKS Attack Byzantine make_attack",
    "gossipcomp.gossip.catalog": "ALGORITHM_NAMES ATTACK_NAMES",
    "gossipcomp.gossip.choco": "Choco",
    "gossipcomp.gossip.choco_edge": "EdgeChoco",
    "gossipcomp.gossip.clipping": "CLIP_RULES ClipRadius parse_clip",
    "gossipcomp.gossip.def_atc": "DEFATC",
    "gossipcomp.gossip.dpsgd": "DPSGD",
    "gossipcomp.gossip.powergossip": "PowerGossip",
    "gossipcomp.gossip.registry": "ALGORITHMS make_algorithm",
    "gossipcomp.gossip.specs": "BuildContext SpecBuilt parse_options",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
