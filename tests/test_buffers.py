"""BatchNorm running statistics are gossiped with the parameters (and can be left out)."""

from __future__ import annotations

import pytest
import torch
from conftest import gossip_round
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.experiment import TrainConfig
from gossipcomp.gossip import DPSGD, Choco, PowerGossip
from gossipcomp.peer import Peer
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import HandshakeError, Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload.data import load_digits_split, parse_partition, partition_indices
from gossipcomp.workload.models import gossiped_tensors, model_signature
from gossipcomp.workload.training import BatchStream, local_step, make_optimizer

ROUNDS = 60


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every peer
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def _ring4(algorithm, gossip_buffers: bool) -> list[Peer]:
    topology = build_topology("ring", n=4)
    hub = InMemoryHub()
    peers = []
    for rank in range(4):
        model = _batchnorm_model()
        identity = Identity(rank, topology.hash, model_signature(model, gossip_buffers))
        transport = InMemoryTransport(identity, topology.neighbors(rank), hub)
        peers.append(
            Peer(model, topology, rank, algorithm(), transport, gossip_buffers=gossip_buffers)
        )
    for peer in peers:
        peer.start(5, {})
    return peers


def _relative_spread(tensors: list[list[torch.Tensor]]) -> float:
    """max over peers of ||x_i - mean|| / ||mean||, all the tensors of one kind together."""
    flat = torch.stack([torch.cat([t.detach().double().reshape(-1) for t in ts]) for ts in tensors])
    mean = flat.mean(0)
    return float((flat - mean).norm(dim=1).max() / mean.norm())


def _trained_ring4(algorithm, gossip_buffers: bool) -> tuple[list[Peer], float, float]:
    """_ring4 trained by _train, then closed: the peers, and _train's two distances."""
    peers = _ring4(algorithm, gossip_buffers)
    try:
        weights, statistics = _train(peers)
    finally:
        for peer in peers:
            peer.close()
    return peers, weights, statistics


def _train(peers: list[Peer]) -> tuple[float, float]:
    """Train on a by-label split (each peer sees other digits, so its batch statistics differ)
    and return the relative spread of the weights and of the running statistics."""
    data = load_digits_split(seed=0)
    parts = partition_indices(data.y_train.numpy(), 4, parse_partition("by-label"), 0)
    streams = [
        BatchStream(data.x_train[torch.as_tensor(p)], data.y_train[torch.as_tensor(p)], 32, 0, r)
        for r, p in enumerate(parts)
    ]
    optimizers = [make_optimizer(p.model, 0.05, 0.9) for p in peers]
    for _ in range(ROUNDS):
        for peer, optimizer, stream in zip(peers, optimizers, streams, strict=True):
            local_step(peer.model, optimizer, stream.next_batch())
        gossip_round(peers)
    weights = _relative_spread([[p for p in peer.model.parameters()] for peer in peers])
    statistics = _relative_spread(
        [[peer.model[1].running_mean, peer.model[1].running_var] for peer in peers]
    )
    return weights, statistics


@pytest.mark.parametrize(
    "algorithm",
    [DPSGD, lambda: PowerGossip(rank=1), lambda: Choco(parse_spec("sign"), consensus_step=0.45)],
    ids=["dpsgd", "powergossip", "choco-sign"],
)
def test_running_statistics_agree_like_the_weights_when_gossiped(one_thread, algorithm):
    peers, weights, statistics = _trained_ring4(algorithm, gossip_buffers=True)
    # measured: dpsgd weights 0.016, statistics 0.021; powergossip rank 1 0.18 and 0.035 (it
    # sends vectors exactly); choco with sign compression, buffers compressed too, 0.051, 0.064
    assert weights < 0.25, weights  # the peers agree on their weights ...
    assert statistics <= 2 * weights, (weights, statistics)  # ... and as well on statistics
    # the step counter is local: it stays each peer's own count of training steps
    assert all(int(p.model[1].num_batches_tracked) == ROUNDS for p in peers)


def test_running_statistics_drift_apart_when_left_out(one_thread):
    _, weights, statistics = _trained_ring4(DPSGD, gossip_buffers=False)
    # measured: weights 0.016 as when gossiped, statistics 0.40 (20 times as far apart)
    assert weights < 0.05, weights
    assert statistics > 5 * weights, (weights, statistics)


def test_gossiped_tensors_are_parameters_then_floating_buffers():
    model = _batchnorm_model()
    names = [name for name, _ in gossiped_tensors(model)]
    params = [name for name, _ in model.named_parameters()]
    assert names == [*params, "1.running_mean", "1.running_var"]  # not num_batches_tracked
    assert [name for name, _ in gossiped_tensors(model, gossip_buffers=False)] == params


def test_signature_says_whether_buffers_travel():
    model = _batchnorm_model()
    assert model_signature(model) != model_signature(model, gossip_buffers=False)
    plain = nn.Linear(3, 2)  # no buffers: the signature of its parameters, either way
    assert model_signature(plain) == model_signature(plain, gossip_buffers=False)


def test_checkpoint_restores_running_statistics(one_thread):
    peers = _ring4(DPSGD, gossip_buffers=True)
    try:
        _train(peers)
        state = peers[0].state_dict()
    finally:
        for peer in peers:
            peer.close()
    fresh = _ring4(DPSGD, gossip_buffers=True)
    try:
        fresh[0].load_state_dict(state)
        bn = fresh[0].model[1]
        assert torch.equal(bn.running_mean, state["model"]["1.running_mean"])
        assert torch.equal(bn.running_var, state["model"]["1.running_var"])
        assert int(bn.num_batches_tracked) == ROUNDS
    finally:
        for peer in fresh:
            peer.close()


def test_a_peer_that_keeps_its_buffers_is_refused_by_one_that_gossips_them():
    topology = build_topology("ring", n=4)
    model = _batchnorm_model()
    ours = model_signature(model, gossip_buffers=True)
    theirs = model_signature(model, gossip_buffers=False)
    hub = InMemoryHub()
    a = InMemoryTransport(Identity(0, topology.hash, ours), [1], hub)
    b = InMemoryTransport(Identity(1, topology.hash, theirs), [0], hub)
    with pytest.raises(HandshakeError, match="model_signature"):
        a.connect({1: ""}, 2.0)
    a.close()
    b.close()


def test_gossip_buffers_setting_must_be_a_bool():
    with pytest.raises(ValueError, match="gossip_buffers must be True or False"):
        TrainConfig(gossip_buffers="no")  # type: ignore[arg-type]
    assert TrainConfig().gossip_buffers and not TrainConfig(gossip_buffers=False).gossip_buffers
