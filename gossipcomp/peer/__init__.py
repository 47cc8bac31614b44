"""The peer and its links: one training participant (`Peer`, the Python API for custom training
loops) and the bookkeeping of which neighbours it gossips with (`links`).

    from gossipcomp.peer import Peer

The modules: `node` (the Peer: construction, start, the gossip round), `links` (which edges are
up, probing lost neighbours, resuming at an agreed round), `rejoin` (the peer's side of that:
handshakes, catching up, resynchronising resumed edges), `schedules` (fetching, adopting and
switching schedules), `guard` (refusing a round that would break the model), `failures`
(counting rounds that heard no one), `checkpoint` (what a saved peer holds, and its checks),
`deadlines`, `factory` (a peer over gRPC) and `stats`.

Each public name is imported from its module on first use (PEP 562), so importing
`gossipcomp.peer.links` (as the levels glue does) does not load the node and its imports.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.peer.node": "Peer AVERAGE_PHASE",
    "gossipcomp.peer.stats": "PeerStats",
    "gossipcomp.peer.failures": "GossipStalled DEFAULT_MAX_FAILED_ROUNDS FAILED_ROUNDS_WARNING",
    "gossipcomp.peer.guard": "MAX_GOSSIP_MOVE",
    "gossipcomp.peer.deadlines": "MAX_ROUND_TIMEOUT MIN_ROUND_SECONDS",
    "gossipcomp.levels.peer": "LEVELS_LOGGER LEVELS_PHASE",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
