"""Peer: one training participant, the Python API for custom training loops.

Build it from a model, a topology, a rank, a gossip algorithm and a transport; call `start()`
once (handshake with neighbours), then `gossip()` after each optimizer step. It counts the bytes
serialised per link, the rounds, and the time spent computing (between gossip calls) versus
communicating (inside exchanges).

    model = build_mlp(seed=0)
    with Peer.over_grpc(model, topology, rank, DPSGD()) as peer:
        peer.start()
        for batch in batches:
            local_step(model, optimizer, batch)
            peer.gossip()
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from gossipcomp.gossip.base import GossipAlgorithm, LinkStats, NamedParams, Neighbourhood
from gossipcomp.gossip.dpsgd import DPSGD
from gossipcomp.models import model_signature
from gossipcomp.topology import Topology
from gossipcomp.transport.base import Identity, Transport
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport

AVERAGE_PHASE = "average"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerStats:
    """What a peer has done so far: rounds, serialised bytes per link, and where time went."""

    rank: int
    rounds: int
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    failed_exchanges: dict[int, int]
    compute_seconds: float
    comm_seconds: float

    @property
    def bytes_sent_total(self) -> int:
        return sum(self.bytes_sent.values())


class Peer:
    """One peer of a gossip network, wrapping a model that the caller trains."""

    def __init__(
        self,
        model: torch.nn.Module,
        topology: Topology,
        rank: int,
        algorithm: GossipAlgorithm,
        transport: Transport,
        *,
        round_timeout: float = 30.0,
    ) -> None:
        if not 0 <= rank < topology.n:
            raise ValueError(
                f"rank {rank} out of range for topology {topology.name} (n={topology.n})"
            )
        if transport.rank != rank:
            raise ValueError(f"transport is for rank {transport.rank}, peer is rank {rank}")
        if round_timeout <= 0:
            raise ValueError(f"round_timeout must be > 0 seconds, got {round_timeout}")
        self.model = model
        self.topology = topology
        self.rank = rank
        self.algorithm = algorithm
        self.transport = transport
        self.round_timeout = round_timeout
        self.round = 0
        self._params: NamedParams = [(n, p) for n, p in model.named_parameters()]
        self._weights = topology.neighbor_weights(rank)
        self._self_weight = topology.self_weight(rank)
        self._links = LinkStats()
        self._compute_seconds = 0.0
        self._comm_seconds = 0.0
        self._last_mark: float | None = None
        self.alone = False  # the last round reached no neighbour
        neighbours = topology.neighbors(rank)
        for phase, spec in algorithm.setup(self._params, rank, neighbours).items():
            transport.expect(phase, spec)
        self._averager = DPSGD(phase=AVERAGE_PHASE)
        for phase, spec in self._averager.setup(self._params, rank, neighbours).items():
            transport.expect(phase, spec)

    @classmethod
    def over_grpc(
        cls,
        model: torch.nn.Module,
        topology: Topology,
        rank: int,
        algorithm: GossipAlgorithm,
        *,
        bind: str | None = None,
        options: GrpcOptions | None = None,
        round_timeout: float = 30.0,
    ) -> Peer:
        """A peer with its own gRPC server at `bind` (default: its address in the topology)."""
        identity = Identity(rank, topology.hash, model_signature(model))
        transport = GrpcTransport(
            identity,
            topology.neighbors(rank),
            bind=bind or topology.addresses[rank],
            options=options,
        )
        try:
            return cls(model, topology, rank, algorithm, transport, round_timeout=round_timeout)
        except Exception:
            transport.close()
            raise

    @property
    def address(self) -> str | None:
        """Where this peer's server listens (gRPC transports only)."""
        return getattr(self.transport, "address", None)

    def start(self, timeout: float = 60.0, addresses: dict[int, str] | None = None) -> None:
        """Handshake with every neighbour, waiting up to `timeout` seconds for them to appear."""
        book = addresses or dict(enumerate(self.topology.addresses))
        self.transport.connect({j: book[j] for j in self.topology.neighbors(self.rank)}, timeout)
        self._last_mark = time.perf_counter()

    def _report_isolation(self, hood: Neighbourhood, failed: int) -> None:
        """Say so when a round reached no neighbour at all (the peer trains alone), and when
        neighbours are back. `failed`: failed (neighbour, exchange) pairs this round."""
        alone = hood.exchanges > 0 and failed == hood.exchanges * len(hood.weights)
        if alone and not self.alone:
            log.warning(
                "peer %d: no neighbour reachable in round %d (%s); training alone",
                self.rank,
                self.round,
                ", ".join(str(j) for j in hood.neighbours),
            )
        elif self.alone and not alone and hood.exchanges > 0:
            log.warning("peer %d: neighbours reachable again in round %d", self.rank, self.round)
        if hood.exchanges > 0:
            self.alone = alone

    def _neighbourhood(self, links: LinkStats) -> Neighbourhood:
        """This peer's view of the network for the current round."""
        return Neighbourhood(
            rank=self.rank,
            round=self.round,
            weights=self._weights,
            self_weight=self._self_weight,
            transport=self.transport,
            timeout=self.round_timeout,
            links=links,
        )

    def gossip(self) -> None:
        """Run one gossip round of the algorithm on the model's parameters (in place)."""
        now = time.perf_counter()
        if self._last_mark is not None:
            self._compute_seconds += now - self._last_mark
        failures_before = sum(self._links.failures.values())
        hood = self._neighbourhood(self._links)
        self.algorithm.step(self._params, hood)
        self._report_isolation(hood, sum(self._links.failures.values()) - failures_before)
        self.round += 1
        self._comm_seconds += hood.comm_seconds
        self._last_mark = time.perf_counter()

    def averaging_rounds(self, tolerance: float = 1e-6) -> int:
        """Exact-gossip rounds that shrink disagreement by `tolerance` on this topology."""
        slem = self.topology.second_largest_eigenvalue_modulus
        if slem <= 0.0:
            return 1
        return min(1000, max(1, math.ceil(math.log(tolerance) / math.log(slem))))

    def network_average(self, rounds: int | None = None) -> list[torch.Tensor]:
        """Estimate the network-average model by exact gossip on copies of the parameters.

        A measurement, not training: the model is untouched and the bytes are not counted in
        `stats`. Every peer must call it at the same point with the same `rounds`.
        """
        rounds = self.averaging_rounds() if rounds is None else rounds
        copies = [(name, p.detach().clone()) for name, p in self._params]
        for _ in range(rounds):
            self._averager.step(copies, self._neighbourhood(LinkStats()))
            self.round += 1
        return [p for _, p in copies]

    @property
    def stats(self) -> PeerStats:
        return PeerStats(
            rank=self.rank,
            rounds=self.round,
            bytes_sent=dict(self._links.bytes_sent),
            bytes_received=dict(self._links.bytes_received),
            failed_exchanges=dict(self._links.failures),
            compute_seconds=self._compute_seconds,
            comm_seconds=self._comm_seconds,
        )

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
