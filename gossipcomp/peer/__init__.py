"""The peer and its links: one training participant (`Peer`, the Python API for custom training
loops) and the bookkeeping of which neighbours it gossips with (`links`).

    from gossipcomp.peer import Peer

The modules: `node` (the Peer: construction, start, the gossip round), `links` (which edges are
up, probing lost neighbours, resuming at an agreed round), `schedules` (fetching, adopting and
switching schedules), `guard` (refusing a round that would break the model), `failures`
(counting rounds that heard no one), `checkpoint` (checking a saved peer), `deadlines`,
`factory` (a peer over gRPC) and `stats`.

Each public name is imported from its module on first use (PEP 562), so importing
`gossipcomp.peer.links` (as the levels glue does) does not load the node and its imports.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module under gossipcomp.peer that defines it
_EXPORTS: dict[str, str] = {
    "Peer": "node",
    "AVERAGE_PHASE": "node",
    "LEVELS_LOGGER": "node",
    "LEVELS_PHASE": "node",
    "PeerStats": "node",
    "GossipStalled": "node",
    "DEFAULT_MAX_FAILED_ROUNDS": "node",
    "FAILED_ROUNDS_WARNING": "node",
    "MAX_GOSSIP_MOVE": "node",
    "MAX_ROUND_TIMEOUT": "node",
    "MIN_ROUND_SECONDS": "node",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is asked for (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gossipcomp.peer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gossipcomp.peer.{module}"), name)
    globals()[name] = value  # later look-ups do not come here again
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
