"""The GossipAlgorithm protocol and the Neighbourhood an algorithm sees at one peer.

An algorithm is a per-peer state object. It never reads globals: its peer's rank, neighbours and
mixing weights come in through the Neighbourhood, so any number of peers can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gossipcomp.transport.base import ExchangeResult, Payload, PayloadSpec, Transport

NamedParams = Sequence[tuple[str, torch.Tensor]]


@dataclass
class LinkStats:
    """Serialised bytes and exchanges per neighbour, accumulated over a peer's life."""

    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    failures: dict[int, int] = field(default_factory=dict)

    def add(self, result: ExchangeResult) -> None:
        for j, n in result.bytes_sent.items():
            self.bytes_sent[j] = self.bytes_sent.get(j, 0) + n
        for j, n in result.bytes_received.items():
            self.bytes_received[j] = self.bytes_received.get(j, 0) + n
        for j in result.failed:
            self.failures[j] = self.failures.get(j, 0) + 1


@dataclass
class Neighbourhood:
    """One peer's view of the network for one gossip round.

    `weights` holds w_ij for each neighbour j and `self_weight` w_ii (rows of the mixing matrix
    W). `exchange` sends one payload per neighbour for this round and returns what they sent; the
    bytes and the time it takes are accounted in `links` and `comm_seconds`.
    """

    rank: int
    round: int
    weights: Mapping[int, float]
    self_weight: float
    transport: Transport
    timeout: float
    links: LinkStats
    schedule_epoch: int = 0
    comm_seconds: float = 0.0
    exchanges: int = 0  # exchanges made this round

    @property
    def neighbours(self) -> list[int]:
        return sorted(self.weights)

    def exchange(self, phase: str, outgoing: Mapping[int, Payload] | Payload) -> ExchangeResult:
        """Send `outgoing` (one payload for all, or one per neighbour) and collect replies."""
        per_peer = (
            {j: outgoing for j in self.neighbours} if isinstance(outgoing, tuple) else outgoing
        )
        start = time.perf_counter()
        result = self.transport.exchange(
            self.round, phase, per_peer, self.timeout, self.schedule_epoch
        )
        self.comm_seconds += time.perf_counter() - start
        self.exchanges += 1
        self.links.add(result)
        return result


class GossipAlgorithm(Protocol):
    """Per-peer gossip state: what it expects to receive, and one gossip step."""

    name: str

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        """Prepare per-peer state; return, per phase, what a neighbour's envelope must hold."""
        ...

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        """Gossip once with the neighbourhood; mutates `params` in place (and own state)."""
        ...
