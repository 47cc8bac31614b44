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

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.topology": "Topology TopologyError build_topology load_topology shipped_topologies",
    "gossipcomp.peer": "Peer PeerStats GossipStalled",
    "gossipcomp.gossip.turns": "ComputeTurns",
    "gossipcomp.gossip": "BuildContext Choco DEFATC DPSGD PowerGossip make_algorithm",
    "gossipcomp.compress": "parse_spec",
    "gossipcomp.workload.models": "build_mlp build_model gossiped_tensors",
    "gossipcomp.workload.data": "load_digits_split load_split parse_partition partition_indices",
    "gossipcomp.workload.training": "BatchStream evaluate_accuracy local_step make_optimizer",
    "gossipcomp.allreduce": "register MergedSync MarsitSync SSDSGD",
}


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: dict[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__all__`` and its PEP 562 ``__getattr__`` and ``__dir__`` for ``exports``
    (module -> the public names it defines, separated by spaces): each name is imported on
    first use and then kept in the package's ``namespace``, so importing the package, or one
    light module of it, loads nothing heavier. gossipcomp and its packages that re-export
    names (peer, coordinator, experiment) use it."""
    by_name = {name: module for module, names in exports.items() for name in names.split()}

    def getattr_(name: str) -> Any:
        module = by_name.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later look-ups do not come here again
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *by_name})

    return sorted(by_name), getattr_, dir_


__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
