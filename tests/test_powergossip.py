"""PowerGossip: sum preservation, exact two-peer averaging at full rank, monotone consensus,
Gram-Schmidt bases at any rank in compiled time."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import build_network, consensus_distance, gossip_round, stacked
from torch import nn

from gossipcomp.gossip import PowerGossip
from gossipcomp.gossip.linalg import orthonormal_basis
from gossipcomp.gossip.powergossip import largest_useful_rank
from gossipcomp.topology import build_topology, load_topology
from gossipcomp.workload.models import build_mlp


def _models(n: int, shapes=((12, 5), (3, 12)), seed: int = 0) -> list[nn.Module]:
    out = []
    for r in range(n):
        torch.manual_seed(seed * 1000 + r)
        out.append(nn.Sequential(*(nn.Linear(a, b) for a, b in shapes)))
    return out


@pytest.mark.parametrize("topology_file", ["ring8", "torus16"])
@pytest.mark.parametrize("rank, steps", [(1, 1), (2, 3)])
def test_network_sum_of_every_parameter_is_preserved(topology_file, rank, steps):
    topology = load_topology(f"topologies/{topology_file}.yaml")
    peers = build_network(
        topology,
        _models(topology.n),
        lambda: PowerGossip(
            rank=rank, power_steps=steps, consensus_step=topology.optimal_consensus_step
        ),
    )
    before = [x.sum(0) for x in stacked(peers)]
    d0 = consensus_distance(peers)
    for _ in range(6):
        gossip_round(peers)
    for b, x in zip(before, stacked(peers), strict=True):
        assert torch.allclose(x.sum(0), b, atol=1e-4), (b - x.sum(0)).abs().max()
    assert consensus_distance(peers) < d0


@pytest.mark.parametrize("shapes", [((7, 4),), ((4, 7),), ((5, 5), (2, 5))])
def test_two_peers_with_full_rank_average_exactly_in_one_round(shapes):
    topology = build_topology("ring", n=2)
    models = _models(2, shapes)
    peers = build_network(topology, models, lambda: PowerGossip(rank=8))
    target = [x.mean(0) for x in stacked(peers)]
    gossip_round(peers)
    for t, x in zip(target, stacked(peers), strict=True):
        assert torch.allclose(x[0], t, atol=1e-5) and torch.allclose(x[1], t, atol=1e-5)


def test_rank_one_consensus_distance_decreases_monotonically_on_ring8():
    topology = load_topology("topologies/ring8.yaml")
    peers = build_network(topology, _models(8, ((64, 32), (10, 64))), lambda: PowerGossip(rank=1))
    distances = [consensus_distance(peers)]
    for _ in range(40):
        gossip_round(peers)
        distances.append(consensus_distance(peers))
    assert all(b <= a * (1 + 1e-6) for a, b in zip(distances, distances[1:], strict=False))
    assert distances[-1] < 0.5 * distances[0]


def test_bytes_per_edge_are_low_rank_and_serialised():
    topology = load_topology("topologies/ring8.yaml")
    peers = build_network(topology, _models(8, ((256, 64),)), lambda: PowerGossip(rank=2))
    # weight [64, 256] is oriented as [256, 64]: a right step sends 256 x 2 floats, a left step
    # 64 x 2; the 64-float bias travels exactly with the first step of every round
    gossip_round(peers)
    gossip_round(peers)
    sent = peers[0].stats.bytes_sent[1]
    data = (256 * 2 + 64 + 64 * 2 + 64) * 4
    assert data < sent < data + 400  # headers and chunk framing only on top
    assert sent < 0.05 * 2 * (256 * 64 + 256) * 4


def test_both_ends_share_vectors_and_reject_bad_options():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        PowerGossip(rank=0)
    with pytest.raises(ValueError, match="consensus_step"):
        PowerGossip(consensus_step=0.0)
    topology = build_topology("ring", n=4)
    params = [("w", torch.zeros(6, 3))]
    a, b = PowerGossip(rank=2, seed=5), PowerGossip(rank=2, seed=5)
    a.setup(params, 0, topology.neighbors(0))
    b.setup(params, 1, topology.neighbors(1))
    assert torch.equal(a._state[(1, 0, "right")], b._state[(0, 0, "right")])
    assert not torch.equal(a._state[(1, 0, "right")], a._state[(3, 0, "right")])


@pytest.mark.parametrize("shape", [(9, 1), (50, 7), (64, 64)])
def test_basis_is_the_gram_schmidt_one(shape):
    # the unique factorisation V = Q R with Q^T Q = I and R upper triangular with a positive
    # diagonal: what Gram-Schmidt gives, column signs included
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q = orthonormal_basis(v)
    r = q.t() @ v
    assert torch.allclose(q.t() @ q, torch.eye(shape[1], dtype=v.dtype), atol=1e-10)
    assert torch.allclose(r, r.triu(), atol=1e-10) and bool((r.diagonal() > 0).all())
    assert torch.allclose(q @ r, v, atol=1e-10)


def test_basis_keeps_a_zero_column_at_zero():
    v = torch.randn(10, 3, generator=torch.Generator().manual_seed(4))
    v[:, 1] = 0.0
    q = orthonormal_basis(v)
    assert torch.equal(q[:, 1].abs(), torch.zeros(10))
    assert torch.allclose(q[:, [0, 2]].t() @ q[:, [0, 2]], torch.eye(2), atol=1e-6)
    assert torch.equal(orthonormal_basis(torch.zeros(5, 2)).abs(), torch.zeros(5, 2))
    assert torch.equal(orthonormal_basis(torch.zeros(5, 1)).abs(), torch.zeros(5, 1))


def test_a_single_column_basis_is_the_qr_one():
    # one column is normalised without a QR; it must be the column QR's rule gives
    v = torch.randn(300, 1, generator=torch.Generator().manual_seed(5))
    q, r = torch.linalg.qr(v)
    by_qr = q * (r.diagonal() / (r.diagonal().abs() + 1e-8))
    assert torch.allclose(orthonormal_basis(v), by_qr, rtol=1e-5, atol=1e-7)


def test_largest_useful_rank_is_the_longest_short_side():
    # the demo MLP: 256x64, 256x256 and 256x10 weights (biases do not count)
    assert largest_useful_rank(build_mlp(0).parameters()) == 256
    assert largest_useful_rank([torch.zeros(3, 40), torch.zeros(7, 5), torch.zeros(99)]) == 5
    assert largest_useful_rank([torch.zeros(4)]) == 0


def test_a_rank_beyond_every_matrix_averages_exactly_and_quickly():
    # --rank 100000 is capped to each matrix's short side (here 768): one right step averages
    # the two peers exactly. Orthonormalising 768 columns by a Gram-Schmidt loop in Python took
    # seconds per step (20 demo rounds at --rank 100000 did not finish in 90 s); QR takes
    # milliseconds, so the bound below has a wide margin for busy cores.
    topology = build_topology("ring", n=2)
    peers = build_network(
        topology, _models(2, ((768, 768),)), lambda: PowerGossip(rank=100_000, consensus_step=1.0)
    )
    target = [x.mean(0) for x in stacked(peers)]
    start = time.perf_counter()
    gossip_round(peers)
    assert time.perf_counter() - start < 2.0
    for t, x in zip(target, stacked(peers), strict=True):
        assert torch.allclose(x[0], t, atol=1e-4) and torch.allclose(x[1], t, atol=1e-4)
