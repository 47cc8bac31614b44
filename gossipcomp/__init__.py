"""gossipcomp: communication-efficient decentralized training over gRPC.

The public API, importable from the package itself (``from gossipcomp import Peer,
load_topology``). Each name is imported from its module on first use, so ``import gossipcomp``
(and with it ``gossipcomp --help`` and the light modules such as ``gossipcomp.topology``) loads
neither torch nor gRPC until a name that needs them is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # topologies
    "Topology": "gossipcomp.topology",
    "TopologyError": "gossipcomp.topology",
    "build_topology": "gossipcomp.topology",
    "load_topology": "gossipcomp.topology",
    "shipped_topologies": "gossipcomp.topology",
    # peers and gossip algorithms
    "Peer": "gossipcomp.peer",
    "PeerStats": "gossipcomp.peer",
    "GossipStalled": "gossipcomp.peer",
    "ComputeTurns": "gossipcomp.gossip.turns",
    "BuildContext": "gossipcomp.gossip",
    "Choco": "gossipcomp.gossip",
    "DEFATC": "gossipcomp.gossip",
    "DPSGD": "gossipcomp.gossip",
    "PowerGossip": "gossipcomp.gossip",
    "make_algorithm": "gossipcomp.gossip",
    # compressors
    "parse_spec": "gossipcomp.compress",
    # models, data and the training helpers the examples use
    "build_mlp": "gossipcomp.models",
    "build_model": "gossipcomp.models",
    "gossiped_tensors": "gossipcomp.models",
    "load_digits_split": "gossipcomp.data",
    "load_split": "gossipcomp.data",
    "parse_partition": "gossipcomp.data",
    "partition_indices": "gossipcomp.data",
    "BatchStream": "gossipcomp.training",
    "evaluate_accuracy": "gossipcomp.training",
    "local_step": "gossipcomp.training",
    "make_optimizer": "gossipcomp.training",
    # all-reduce mode (torch.distributed)
    "register": "gossipcomp.allreduce",
    "MergedSync": "gossipcomp.allreduce",
    "MarsitSync": "gossipcomp.allreduce",
    "SSDSGD": "gossipcomp.allreduce",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is asked for (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gossipcomp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups do not come here again
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
