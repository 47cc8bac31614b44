"""A peer's side of time-varying topologies: which algorithms can follow a graph per round.

Every peer derives round t's graph from the topology itself (Topology.round_weights). An
algorithm whose state lives per edge (D-PSGD has none; PowerGossip's warm-start vectors,
choco-edge's pair of public copies) keeps an inactive edge's state for its next activation, so
it runs on any graph sequence, and on a live topology an edge first used starts from the
state both ends set up alike (tests/test_membership.py). A
broadcasting algorithm (Choco-SGD, DEF-ATC) keeps one public copy per peer that every neighbour
tracks from every round's message: a neighbour not in the round would miss an update and its
copy would no longer match, so those are refused on a time-varying topology, before the start,
and on a live one (topology/members.py), whose graph changes with its members.
"""

from __future__ import annotations

from gossipcomp.gossip.base import GossipAlgorithm
from gossipcomp.gossip.broadcast import BroadcastGossip
from gossipcomp.topology import Topology


def check_round_graphs(topology: Topology, algorithm: GossipAlgorithm) -> None:
    """Raise ValueError when `algorithm` cannot follow `topology`'s per-round graphs."""
    inner = getattr(algorithm, "inner", algorithm)  # an attack wrapping an algorithm
    if topology.live is not None and isinstance(inner, BroadcastGossip):
        raise ValueError(
            f"{inner.label} cannot run on the live topology {topology.name}: its graph changes "
            "with its members, and a neighbour that joins has not tracked a peer's public copy "
            "from every round's message; expected a fixed membership, or D-PSGD / PowerGossip"
        )
    if topology.time_varying and isinstance(inner, BroadcastGossip):
        raise ValueError(
            f"{inner.label} cannot run on the time-varying topology {topology.name} "
            f"(kind {topology.kind}): every neighbour tracks a peer's public copy from every "
            "round's message, and a neighbour outside a round's graph would miss one; expected "
            "a static topology, or D-PSGD / PowerGossip on this one"
        )
