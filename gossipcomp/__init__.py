"""gossipcomp: communication-efficient decentralized training over gRPC.

The public API, importable from the package itself (``from gossipcomp import Peer,
load_topology``). Each name is imported from its module on first use, so ``import gossipcomp``
(and with it ``gossipcomp --help`` and the light modules such as ``gossipcomp.topology``) loads
neither torch nor gRPC until a name that needs them is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
    "build_mlp": "gossipcomp.workload.models",
    "build_model": "gossipcomp.workload.models",
    "gossiped_tensors": "gossipcomp.workload.models",
    "load_digits_split": "gossipcomp.workload.data",
    "load_split": "gossipcomp.workload.data",
    "parse_partition": "gossipcomp.workload.data",
    "partition_indices": "gossipcomp.workload.data",
    "BatchStream": "gossipcomp.workload.training",
    "evaluate_accuracy": "gossipcomp.workload.training",
    "local_step": "gossipcomp.workload.training",
    "make_optimizer": "gossipcomp.workload.training",
    # all-reduce mode (torch.distributed)
    "register": "gossipcomp.allreduce",
    "MergedSync": "gossipcomp.allreduce",
    "MarsitSync": "gossipcomp.allreduce",
    "SSDSGD": "gossipcomp.allreduce",
}


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's PEP 562 ``__getattr__`` and ``__dir__`` for ``exports`` (public name -> the
    module that defines it): each name is imported on first use and then kept in the package's
    ``namespace``, so importing the package, or one light module of it, loads nothing heavier.
    gossipcomp and its packages that re-export names (peer, coordinator, experiment) use it."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later look-ups do not come here again
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_


__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
