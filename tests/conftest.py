"""Shared fixtures: small gRPC networks on loopback (ports from 0), closed after each test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from gossipcomp.experiment import PeerTrainer, TrainConfig, build_algorithm
from gossipcomp.gossip import GossipAlgorithm
from gossipcomp.peer import Peer
from gossipcomp.topology import Topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload.checkpoint import CheckpointStore
from gossipcomp.workload.data import load_digits_split
from gossipcomp.workload.models import build_model, model_signature


def run_in_threads(functions: Sequence[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run callables concurrently (one per peer); return results in order, re-raise failures."""
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            results[i] = functions[i]()
        except BaseException as error:  # re-raised in the test thread
            errors.append(error)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(functions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a peer thread did not finish in time"
    if errors:
        raise errors[0]
    return results


def reporting_rounds(peers: Sequence[Any], clients: Sequence[Any], count: int) -> None:
    """`count` gossip rounds of every peer in its own thread, each followed by its coordinator
    client's `after_round` (a report when due, the reply of an earlier one staged)."""

    def one(peer: Any, client: Any) -> None:
        for _ in range(count):
            peer.gossip()
            client.after_round()

    run_in_threads([lambda p=p, c=c: one(p, c) for p, c in zip(peers, clients, strict=True)])


@pytest.fixture
def grpc_pair() -> Iterator[Callable[..., tuple[GrpcTransport, GrpcTransport]]]:
    """Factory for two connected gRPC transports (ranks 0 and 1) sharing an identity."""
    made: list[GrpcTransport] = []

    def make(
        topology_hash: str = "topo", signature: str = "model", options: GrpcOptions | None = None
    ) -> tuple[GrpcTransport, GrpcTransport]:
        a = GrpcTransport(Identity(0, topology_hash, signature), [1], options=options)
        b = GrpcTransport(Identity(1, topology_hash, signature), [0], options=options)
        made.extend([a, b])
        a.connect({1: b.address}, timeout=10)
        b.connect({0: a.address}, timeout=10)
        return a, b

    yield make
    for transport in made:
        transport.close()


def build_network(
    topology: Topology,
    models: Sequence[torch.nn.Module],
    algorithm: Callable[[], GossipAlgorithm],
    transport: str = "memory",
    round_timeout: float = 30.0,
) -> list[Peer]:
    """One connected Peer per rank, over in-memory or real gRPC transports."""
    if transport == "grpc":
        return grpc_network(topology, models, algorithm, round_timeout=round_timeout)
    hub = InMemoryHub()
    peers = []
    for r, m in enumerate(models):
        identity = Identity(r, topology.hash, model_signature(m))
        t = InMemoryTransport(identity, topology.neighbors(r), hub)
        peers.append(Peer(m, topology, r, algorithm(), t, round_timeout=round_timeout))
    for p in peers:
        p.start(5, {})
    return peers


def grpc_network(
    topology: Topology,
    models: Sequence[torch.nn.Module],
    algorithm: Callable[[], GossipAlgorithm],
    grpc_options: Sequence[GrpcOptions | None] | None = None,
    **options: Any,
) -> list[Peer]:
    """One Peer per rank over real gRPC on loopback (ports from 0), all started and connected;
    `grpc_options` per rank, `options` (round_timeout, backoff, ...) for every peer."""
    per_rank = grpc_options if grpc_options is not None else [None] * len(models)
    peers = [
        Peer.over_grpc(
            m, topology, r, algorithm(), bind="127.0.0.1:0", options=per_rank[r], **options
        )
        for r, m in enumerate(models)
    ]
    addresses = {p.rank: p.address for p in peers}
    run_in_threads([lambda p=p: p.start(10, addresses) for p in peers])
    return peers


def gossip_round(peers: Sequence[Peer]) -> None:
    run_in_threads([p.gossip for p in peers])


def stacked(peers: Sequence[Peer]) -> list[torch.Tensor]:
    """Per parameter: the peers' values stacked on a new first axis (float64)."""
    per_peer = [[p.detach().double().clone() for p in peer.model.parameters()] for peer in peers]
    return [torch.stack(group) for group in zip(*per_peer, strict=True)]


def consensus_distance(peers: Sequence[Peer]) -> float:
    return sum(float((x - x.mean(0)).pow(2).sum()) for x in stacked(peers)) / len(peers)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Many small peers share two cores: one intra-op thread each avoids contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_memory_trainers(
    topology: Topology,
    config: TrainConfig,
    hub: InMemoryHub,
    directory: Any = None,
    every: int = 50,
    make_model: Callable[[str, int], torch.nn.Module] = build_model,
) -> list[PeerTrainer]:
    """A PeerTrainer per rank over the in-memory hub (the training loop `simulate` runs, without
    gRPC); with `directory`, each checkpoints there every `every` rounds; `make_model(name,
    seed)` builds each peer's model (a registered one by default)."""
    data = load_digits_split(seed=config.seed)
    trainers = []
    for rank in range(topology.n):
        model = make_model(config.model, config.seed)
        transport = InMemoryTransport(
            Identity(rank, topology.hash, model_signature(model)), topology.neighbors(rank), hub
        )
        peer = Peer(model, topology, rank, build_algorithm(config, topology, rank), transport)
        store = CheckpointStore(directory, rank) if directory is not None else None
        trainers.append(PeerTrainer(peer, data, config, store, every if store else 0))
    return trainers
