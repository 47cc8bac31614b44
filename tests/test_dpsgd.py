"""Exact gossip (D-PSGD) through Peer over real gRPC: average kept, contraction at the spectral rate."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import run_in_threads
from torch import nn

from gossipcomp.gossip import DPSGD, BuildContext, make_algorithm
from gossipcomp.peer import Peer
from gossipcomp.peer.links import Backoff, LinkState
from gossipcomp.topology import build_topology, load_topology
from gossipcomp.transport.base import Envelope, Identity
from gossipcomp.transport.codec import encode_raw
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.wire import envelope_wire_bytes
from gossipcomp.workload.models import model_signature


def _random_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))


def _stack(peers: list[Peer]) -> torch.Tensor:
    return torch.stack(
        [torch.cat([p.detach().reshape(-1) for p in peer.model.parameters()]) for peer in peers]
    ).to(torch.float64)


def _grpc_network(topology, algorithm_factory, seeds) -> list[Peer]:
    peers = [
        Peer.over_grpc(_random_model(s), topology, r, algorithm_factory(), bind="127.0.0.1:0")
        for r, s in enumerate(seeds)
    ]
    addresses = {p.rank: p.address for p in peers}
    run_in_threads([lambda p=p: p.start(10, addresses) for p in peers])
    return peers


def _disagreement(x: torch.Tensor) -> float:
    return float((x - x.mean(dim=0)).norm())


def test_exact_gossip_on_ring8_keeps_average_and_contracts_at_spectral_rate():
    topology = load_topology("topologies/ring8.yaml")
    peers = _grpc_network(topology, DPSGD, seeds=range(8))
    try:
        x0 = _stack(peers)
        mean0, d0 = x0.mean(dim=0), _disagreement(x0)
        rate = 1.0 - topology.spectral_gap
        for t in range(1, 21):
            run_in_threads([peer.gossip for peer in peers])
            x = _stack(peers)
            assert torch.allclose(x.mean(dim=0), mean0, atol=1e-6), f"average moved at round {t}"
            assert _disagreement(x) <= d0 * rate**t * (1 + 1e-4) + 1e-6, f"round {t}"
        # and the bound is nearly tight on a ring: the slowest mode decays at exactly that rate
        assert _disagreement(x) >= d0 * rate**20 * 0.01
        envelope = Envelope(
            0, 0, "model", tuple(encode_raw(n, p) for n, p in peers[0].model.named_parameters())
        )
        for peer in peers:
            stats = peer.stats
            assert stats.rounds == 20 and sorted(stats.bytes_sent) == topology.neighbors(peer.rank)
            # serialised bytes, counted per link: within the varint slack of sender/round fields
            for sent in stats.bytes_sent.values():
                assert abs(sent - 20 * envelope_wire_bytes(envelope)) <= 20 * 4
    finally:
        for peer in peers:
            peer.close()


def test_over_relaxed_step_contracts_faster_and_keeps_average():
    topology = load_topology("topologies/ring8.yaml")
    results = {}
    for gamma in (1.0, topology.optimal_consensus_step):
        peers = _grpc_network(topology, lambda g=gamma: DPSGD(consensus_step=g), seeds=range(8))
        try:
            x0 = _stack(peers)
            for _ in range(15):
                run_in_threads([peer.gossip for peer in peers])
            x = _stack(peers)
            assert torch.allclose(x.mean(dim=0), x0.mean(dim=0), atol=1e-6)
            results[gamma] = _disagreement(x) / _disagreement(x0)
        finally:
            for peer in peers:
                peer.close()
    plain, relaxed = results.values()
    assert relaxed < 0.5 * plain


def test_missing_neighbour_is_left_out_within_the_deadline():
    """Peer 0 of a 4-ring gossips while peer 1 is absent: it mixes with peer 3 only, in time."""
    topology = build_topology("ring", n=4)
    hub = InMemoryHub()
    models = [_random_model(s) for s in range(4)]
    peers = []
    for r in (0, 2, 3):
        identity = Identity(r, topology.hash, model_signature(models[r]))
        transport = InMemoryTransport(identity, topology.neighbors(r), hub)
        peers.append(Peer(models[r], topology, r, DPSGD(), transport, round_timeout=0.5))
    before = {r: [p.detach().clone() for p in models[r].parameters()] for r in (0, 3)}
    start = time.monotonic()
    run_in_threads([peer.gossip for peer in peers])
    assert time.monotonic() - start < 3
    w = topology.neighbor_weights(0)[3]
    for p0, b0, b3 in zip(models[0].parameters(), before[0], before[3], strict=True):
        assert torch.allclose(p0.detach(), b0 + w * (b3 - b0), atol=1e-6)
    assert peers[0].stats.failed_exchanges == {1: 1}


def test_peer_rejects_mismatched_rank_and_unknown_algorithm():
    topology = build_topology("ring", n=4)
    hub = InMemoryHub()
    model = _random_model(0)
    transport = InMemoryTransport(Identity(2, topology.hash, model_signature(model)), [1, 3], hub)
    with pytest.raises(ValueError, match="transport is for rank 2"):
        Peer(model, topology, 0, DPSGD(), transport)
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; known: .*powergossip"):
        make_algorithm("nope", BuildContext(seed=0, spectral_step=1.0))
    with pytest.raises(ValueError, match="consensus_step"):
        DPSGD(consensus_step=2.5)


def test_a_peer_with_no_neighbour_left_keeps_training_and_says_so(caplog):
    """Peer 0 of a 4-ring whose neighbours 1 and 3 are both absent: the round ends, the model
    is unchanged by gossip, the peer says it trains alone (once), stops waiting for the lost
    neighbours, and says so again when one is back (found by its backoff probes)."""
    topology = build_topology("ring", n=4)
    hub = InMemoryHub()
    models = [_random_model(s) for s in range(4)]

    def peer(rank: int) -> Peer:
        identity = Identity(rank, topology.hash, model_signature(models[rank]))
        transport = InMemoryTransport(identity, topology.neighbors(rank), hub)
        return Peer(
            models[rank],
            topology,
            rank,
            DPSGD(),
            transport,
            round_timeout=0.3,
            backoff=Backoff(first=0.01, longest=0.05),
        )

    alone = peer(0)
    before = [p.detach().clone() for p in models[0].parameters()]
    with caplog.at_level("WARNING", logger="gossipcomp.peer"):
        alone.gossip()
        start = time.monotonic()
        alone.gossip()  # said once, not every round; lost neighbours are not waited for again
        assert time.monotonic() - start < 0.2
    assert alone.alone
    assert [r.getMessage() for r in caplog.records if r.name == "gossipcomp.peer"] == [
        "peer 0: no neighbour reachable in round 0 (1, 3); training alone"
    ]
    for p, b in zip(models[0].parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    caplog.clear()
    back = peer(1)
    back.round = alone.round  # the returning peer joins at the current round
    with caplog.at_level("WARNING", logger="gossipcomp.peer"):
        for _ in range(12):
            time.sleep(0.02)  # let the backoff expire
            run_in_threads([alone.gossip, back.gossip])
            if not alone.alone:
                break
    assert not alone.alone
    assert alone.links.state(1) is LinkState.UP and back.links.state(0) is LinkState.UP
    messages = [r.getMessage() for r in caplog.records]
    assert f"peer 0: neighbours reachable again in round {alone.round - 1}" in messages
