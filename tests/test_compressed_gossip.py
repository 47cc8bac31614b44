"""Choco-SGD and DEF-ATC: average preservation, DEF-ATC = D-PSGD exactly, consensus."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_network, consensus_distance, gossip_round, stacked
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.gossip import DEFATC, DPSGD, Choco
from gossipcomp.gossip.def_atc import default_def_steps
from gossipcomp.topology import load_topology


def _models(n: int, seed: int = 0) -> list[nn.Module]:
    out = []
    for r in range(n):
        torch.manual_seed(seed * 1000 + r)
        out.append(nn.Sequential(nn.Linear(9, 6), nn.Linear(6, 3)))
    return out


@pytest.mark.parametrize("topology_file", ["ring8", "torus16"])
@pytest.mark.parametrize("spec", ["sign", "topk:ratio=0.2", "qsgd:levels=4", "randomk:ratio=0.3"])
def test_choco_preserves_the_network_sum(topology_file, spec):
    topology = load_topology(f"topologies/{topology_file}.yaml")
    peers = build_network(topology, _models(topology.n), lambda: Choco(parse_spec(spec), seed=3))
    before = [x.sum(0) for x in stacked(peers)]
    d0 = consensus_distance(peers)
    for _ in range(15):
        gossip_round(peers)
    for b, x in zip(before, stacked(peers), strict=True):
        assert torch.allclose(x.sum(0), b, atol=1e-4), (x.sum(0) - b).abs().max()
    assert consensus_distance(peers) < d0


def test_choco_with_several_steps_per_round_keeps_the_sum_and_converges_faster():
    topology = load_topology("topologies/ring8.yaml")
    distances = {}
    for steps in (1, 3):
        peers = build_network(
            topology, _models(8), lambda s=steps: Choco(parse_spec("sign"), steps=s)
        )
        before = [x.sum(0) for x in stacked(peers)]
        d0 = consensus_distance(peers)
        for _ in range(5):
            gossip_round(peers)
        for b, x in zip(before, stacked(peers), strict=True):
            assert torch.allclose(x.sum(0), b, atol=1e-4)
        distances[steps] = consensus_distance(peers) / d0
        assert set(peers[0].stats.bytes_sent) == {1, 7}
    assert distances[3] < 0.5 * distances[1]


def test_choco_public_copies_agree_across_peers():
    """Every neighbour tracks xh_j exactly: its copy equals j's own public copy bit for bit."""
    topology = load_topology("topologies/ring8.yaml")
    peers = build_network(topology, _models(8), lambda: Choco(parse_spec("sign")))
    for _ in range(5):
        gossip_round(peers)
    for peer in peers:
        algo = peer.algorithm
        assert set(algo.neighbour_public) == set(topology.neighbors(peer.rank))
        for j, tracked in algo.neighbour_public.items():
            for mine, theirs in zip(tracked, peers[j].algorithm.public, strict=True):
                assert torch.equal(mine, theirs)
            assert any(t.abs().sum() > 0 for t in tracked)  # it did move from zero


def _identical(n: int) -> list[nn.Module]:
    """DEF-ATC's references start at the initial model, which must be the same on every peer."""
    first = _models(1)[0]
    return [copy.deepcopy(first) for _ in range(n)]


def _adapt(peers, seed: int, scale: float = 1.0) -> None:
    """A stand-in for the local step: a different perturbation on every peer."""
    with torch.no_grad():
        for peer in peers:
            g = torch.Generator().manual_seed(seed * 100 + peer.rank)
            for p in peer.model.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=scale)


def test_def_atc_with_identity_and_unit_steps_equals_dpsgd_exactly():
    topology = load_topology("topologies/ring8.yaml")
    models = _identical(8)
    twins = [copy.deepcopy(m) for m in models]
    def_peers = build_network(
        topology, models, lambda: DEFATC(parse_spec("identity"), zeta=1.0, gamma=1.0)
    )
    dpsgd_peers = build_network(topology, twins, lambda: DPSGD(consensus_step=1.0))
    for round_ in range(4):
        _adapt(def_peers, round_)  # the same adapt step on both networks
        _adapt(dpsgd_peers, round_)
        gossip_round(def_peers)
        gossip_round(dpsgd_peers)
        for x, y in zip(stacked(def_peers), stacked(dpsgd_peers), strict=True):
            assert torch.allclose(x, y, atol=1e-6, rtol=0), (x - y).abs().max()


def test_def_atc_with_sign_reaches_consensus_and_keeps_the_average():
    topology = load_topology("topologies/ring8.yaml")
    peers = build_network(topology, _identical(8), lambda: DEFATC(parse_spec("sign")))
    _adapt(peers, seed=7)  # peers now disagree; their references still hold the initial model
    mean0 = [x.mean(0) for x in stacked(peers)]
    d0 = consensus_distance(peers)
    for _ in range(150):
        gossip_round(peers)
    assert consensus_distance(peers) < 0.05 * d0
    for m0, x in zip(mean0, stacked(peers), strict=True):
        assert torch.allclose(x.mean(0), m0, atol=0.05 * float(m0.abs().max()) + 1e-3)


def test_default_steps_and_bad_options():
    assert parse_spec("sign").consensus_step == 0.45
    assert parse_spec("topk:ratio=0.01").consensus_step == pytest.approx(0.1)
    assert parse_spec("topk:ratio=0.5").consensus_step == 0.45
    assert default_def_steps(parse_spec("topk:ratio=0.01")) == (0.5, 0.2)
    assert default_def_steps(parse_spec("sign")) == (1.0, 1.0)
    assert parse_spec("ef+sign").consensus_step == 0.45
    with pytest.raises(ValueError, match="consensus_step must lie in"):
        Choco(parse_spec("sign"), consensus_step=1.5)
    with pytest.raises(ValueError, match="zeta must lie in"):
        DEFATC(parse_spec("sign"), zeta=0.0)


def test_malformed_compressed_payload_is_refused_before_any_state_changes():
    """Duplicate top-k indices from a neighbour: INVALID_ARGUMENT naming the tensor, at the door.
    The peer then ends the round exactly (bitwise) like a twin whose neighbour sent nothing."""
    import time

    import grpc

    from gossipcomp.compress.base import CompressionContext
    from gossipcomp.gossip.grouping import to_wire
    from gossipcomp.gossip.merged import MergedCodec
    from gossipcomp.peer import Peer
    from gossipcomp.topology import build_topology
    from gossipcomp.transport.base import Envelope, Identity
    from gossipcomp.transport.grpc_transport import GrpcTransport
    from gossipcomp.workload.models import model_signature

    topology = build_topology("ring", n=2)
    spec = "topk:ratio=0.5"
    model = _models(1)[0]
    twin_model = copy.deepcopy(model)
    params = list(model.named_parameters())
    made = []
    try:
        peers = []
        for m in (model, twin_model):
            peer = Peer.over_grpc(
                m, topology, 1, Choco(parse_spec(spec)), bind="127.0.0.1:0", round_timeout=0.5
            )
            sender = GrpcTransport(Identity(0, topology.hash, model_signature(m)), [1])
            made += [peer, sender]
            sender.inbox.expect("choco0", MergedCodec(params, parse_spec(spec), 0, 0).spec(int))
            sender.connect({1: peer.address}, timeout=10)
            peer.start(timeout=10, addresses={0: sender.address})
            peers.append((peer, sender))
        compressor = parse_spec(spec)
        payload = []
        for i, (name, p) in enumerate(params):
            flat = p.detach().reshape(-1)  # each parameter is its own group: one flat buffer
            compressed = compressor.compress(flat, CompressionContext(0, 0, -1, 0, i))
            data = bytearray(compressed.data)
            k = len(data) // 8
            if i == 0:  # indices follow the k values: repeat the first index
                data[4 * k + 4 : 4 * k + 8] = data[4 * k : 4 * k + 4]
            bad = type(compressed)(compressed.codec, compressed.shape, bytes(data))
            payload.append(to_wire(name, bad))
        (peer, sender), (twin, _) = peers
        with pytest.raises(grpc.RpcError) as caught:
            sender.send(1, Envelope(0, 0, "choco0", tuple(payload)), time.monotonic() + 5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"tensor {params[0][0]!r} payload" in caught.value.details()
        peer.gossip()
        twin.gossip()
        assert peer.stats.failed_exchanges == twin.stats.failed_exchanges == {0: 1}
        for p, t in zip(model.parameters(), twin_model.parameters(), strict=True):
            assert torch.equal(p.detach(), t.detach())
        for a, b in zip(
            peer.algorithm.neighbour_public[0], twin.algorithm.neighbour_public[0], strict=True
        ):
            assert torch.equal(a, b)
    finally:
        for thing in made:
            thing.close()


@pytest.mark.parametrize(
    "spec,kind,check",
    [
        ("dpsgd", "DPSGD", lambda a: a.consensus_step == pytest.approx(1.308, abs=1e-3)),
        ("dpsgd:gamma=0.5", "DPSGD", lambda a: a.consensus_step == 0.5),
        ("powergossip:rank=2,steps=4", "PowerGossip", lambda a: (a.rank, a.power_steps) == (2, 4)),
        (
            "choco:compressor=sign,steps=4,gamma=0.7",
            "Choco",
            lambda a: (a.steps, a.consensus_step, a.compressor.spec) == (4, 0.7, "sign"),
        ),
        ("choco:compressor=topk:ratio=0.1", "Choco", lambda a: a.consensus_step == 0.45),
        (
            "choco:compressor=(randomk:ratio=0.1,unbiased=false)",
            "Choco",
            lambda a: a.compressor.spec.startswith("randomk:ratio=0.1"),
        ),
        ("def:compressor=topk:ratio=0.01", "DEFATC", lambda a: (a.zeta, a.gamma) == (0.5, 0.2)),
    ],
)
def test_algorithms_are_built_from_spec_strings(spec, kind, check):
    from gossipcomp.gossip import BuildContext, make_algorithm
    from gossipcomp.topology import build_topology

    step = build_topology("ring", n=8).optimal_consensus_step
    algorithm = make_algorithm(spec, BuildContext(seed=0, spectral_step=step))
    assert type(algorithm).__name__ == kind
    assert check(algorithm)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("gossip", "unknown algorithm 'gossip'; known: choco, choco-edge, def, dpsgd, powergossip"),
        ("choco", "needs option 'compressor'"),
        ("choco:compressor=sign,steps=x", "steps: expected int"),
        ("choco:compressor=sign,steps=1000", r"steps must be in \[1, 100\]"),
        ("powergossip:rank=2,colour=red", "no option 'colour'; its options: rank, steps, gamma"),
        ("choco:compressor=(sign", r"a '\(' is never closed"),
        ("choco:compressor=zip", "unknown compressor"),
        ("dpsgd:gamma=3", "consensus_step must lie in"),
        ("x" * 5000, "at most 1000"),
    ],
)
def test_bad_algorithm_specs_are_refused_naming_the_problem(spec, message):
    from gossipcomp.gossip import BuildContext, make_algorithm

    with pytest.raises(ValueError, match=message):
        make_algorithm(spec, BuildContext(seed=0, spectral_step=1.0))


def test_flags_and_a_whole_spec_build_the_same_algorithm_and_are_not_mixed():
    from gossipcomp.experiment import TrainConfig

    flags = TrainConfig(algorithm="choco", compressor="sign", gossip_steps=4, consensus_step=0.7)
    spec = TrainConfig(algorithm="choco:compressor=sign,steps=4,gamma=0.7")
    assert flags.algorithm_spec() == spec.algorithm_spec()
    assert flags.algorithm_options() == spec.algorithm_options()
    with pytest.raises(ValueError, match="given both"):
        TrainConfig(algorithm="choco:compressor=sign", gossip_steps=2)
