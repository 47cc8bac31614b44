"""Clipped gossip: the radius rules, the spec parser, and clipping inside every algorithm.

Every algorithm is checked for the three properties that make clipping what it claims: with a
radius no difference reaches it is the unclipped algorithm bit for bit; with a small radius a
round moves a peer's mixed quantity by at most gamma * sum_j w_ij * tau (and close to it); with a
fixed radius, the same at both ends of every edge, the algorithms that preserve the network
average still do.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from conftest import build_network, gossip_round, stacked
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.experiment import TrainConfig, build_algorithm
from gossipcomp.gossip import DEFATC, DPSGD, Choco, GossipAlgorithm, PowerGossip, parse_clip
from gossipcomp.gossip.clipping import (
    AdaptiveRadius,
    ClipRadius,
    FixedRadius,
    clipped_weights,
    difference_norm,
    total_norm,
)
from gossipcomp.peer import Peer
from gossipcomp.topology import load_topology

RING8 = load_topology("topologies/ring8.yaml")


# --- the rules ---------------------------------------------------------------------------------


def test_fixed_radius_is_the_given_tau_whatever_the_distances():
    rule = FixedRadius(0.5)
    assert rule.radius([3.0, 0.1]) == 0.5 and rule.radius([]) == 0.5
    assert rule.spec == "fixed:0.5" and parse_clip(rule.spec) == rule


def test_adaptive_radius_is_the_b_plus_first_largest_distance():
    distances = [3.0, 1.0, 2.0, 7.0]
    assert AdaptiveRadius().radius(distances) == 3.0  # b = 1: the second largest
    assert AdaptiveRadius(2).radius(distances) == 2.0
    assert AdaptiveRadius(0).radius(distances) == 7.0  # no liar assumed: nothing clipped
    # with b or fewer distances heard no radius can be vouched for: no mixing at all
    assert AdaptiveRadius(1).radius([5.0]) == 0.0
    assert AdaptiveRadius(2).radius([5.0, 1.0]) == 0.0
    assert AdaptiveRadius(1).radius([]) == 0.0
    # a non-finite distance is a certain liar: it uses up one of the b and sets no radius
    inf = float("inf")
    assert AdaptiveRadius(1).radius([inf, 2.0, 1.0]) == 2.0
    assert AdaptiveRadius(1).radius([inf, inf, 1.0]) == 1.0
    assert AdaptiveRadius(2).radius([float("nan"), 3.0, 2.0, 1.0]) == 2.0


def test_clipped_weights_scale_each_weight_by_min_1_tau_over_d():
    weights = {1: 0.25, 2: 0.25, 3: 0.5}
    distances = {1: 0.1, 2: 1.0, 3: 4.0}
    assert clipped_weights(weights, distances, FixedRadius(0.5)) == pytest.approx(
        {1: 0.25, 2: 0.125, 3: 0.0625}
    )
    # adaptive, b = 1: tau = 1.0 (second largest), so only neighbour 3 is clipped
    assert clipped_weights(weights, distances, AdaptiveRadius(1)) == pytest.approx(
        {1: 0.25, 2: 0.25, 3: 0.125}
    )
    assert clipped_weights({1: 0.3}, {1: 0.0}, FixedRadius(1e-9)) == {1: 0.3}  # nothing to clip
    assert clipped_weights({1: 0.3}, {1: 2.0}, AdaptiveRadius(1)) == {}  # b >= heard: left out
    inf = float("inf")  # a non-finite difference is left out, never weighted by 0
    assert clipped_weights({1: 0.3, 2: 0.3}, {1: inf, 2: 1.0}, FixedRadius(2.0)) == {2: 0.3}
    with pytest.raises(ValueError, match=r"no distance for neighbours \[2\]"):
        clipped_weights({1: 0.5, 2: 0.5}, {1: 1.0}, FixedRadius(1.0))


def test_difference_norm_is_over_the_whole_model():
    a = [torch.tensor([[3.0, 0.0]]), torch.tensor([1.0])]
    b = [torch.zeros(1, 2), torch.tensor([-3.0])]
    assert difference_norm(a, b) == pytest.approx(5.0)  # sqrt(3^2 + 4^2), not per tensor


def test_total_norm_of_huge_finite_tensors_is_finite_and_non_finite_ones_are_not():
    # float32's own norm overflows past 1.8e19 per element; the float64 one is taken then
    huge = [torch.full((4,), 1e30), torch.tensor([3e30])]
    assert total_norm(huge) == pytest.approx(math.sqrt(4 * 1e60 + 9e60), rel=1e-6)
    assert total_norm([torch.tensor([1.0, float("inf")])]) == math.inf
    assert math.isnan(total_norm([torch.tensor([float("nan"), 1.0])]))
    values = torch.randn(65_536, generator=torch.Generator().manual_seed(0))
    exact = float(torch.linalg.vector_norm(values, dtype=torch.float64))
    assert total_norm([values]) == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("adaptive", AdaptiveRadius(1)),
        ("adaptive:2", AdaptiveRadius(2)),
        ("adaptive:0", AdaptiveRadius(0)),
        ("0.5", FixedRadius(0.5)),
        ("fixed:0.25", FixedRadius(0.25)),
        (" 1e-3 ", FixedRadius(1e-3)),
    ],
)
def test_parse_clip_reads_every_documented_spec(spec, expected):
    assert parse_clip(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty clip spec; expected 'adaptive'"),
        ("median", r"unknown clip rule 'median' in 'median'; known: \['adaptive', 'fixed'\]"),
        ("adaptive:x", r"'adaptive:x': expected an integer b >= 0, e.g. adaptive:2, got 'x'"),
        ("adaptive:1.5", "expected an integer b >= 0"),
        ("adaptive:-1", "adaptive clipping b: expected an integer >= 0, got -1"),
        ("adaptive:", "nothing after 'adaptive'"),
        ("fixed", "nothing after 'fixed'"),
        ("fixed:big", "expected a radius > 0, e.g. fixed:0.5, got 'big'"),
        ("0", r"'0': clip radius tau: expected a finite number in \(0, inf\), got 0.0"),
        ("-0.5", r"expected a finite number in \(0, inf\), got -0.5"),
        ("nan", r"expected a finite number in \(0, inf\), got nan"),
        ("inf", r"expected a finite number in \(0, inf\), got inf"),
    ],
)
def test_parse_clip_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_clip(spec)


def test_train_config_checks_the_clip_spec_early_and_build_algorithm_clips():
    with pytest.raises(ValueError, match="unknown clip rule 'bogus'"):
        TrainConfig(clip="bogus")
    for name, extra in (
        ("dpsgd", {}),
        ("powergossip", {}),
        ("choco", {"compressor": "sign"}),
        ("def", {"compressor": "sign"}),
    ):
        config = TrainConfig(algorithm=name, clip="adaptive:2", **extra)
        assert build_algorithm(config, RING8, 0).clipping == AdaptiveRadius(2)
        assert build_algorithm(TrainConfig(algorithm=name, **extra), RING8, 0).clipping is None


# --- clipping inside each algorithm ------------------------------------------------------------

GAMMA = {"dpsgd": 1.2, "choco": 0.5, "def": 0.7, "powergossip": 1.2}


def _factory(name: str, clipping: ClipRadius | None) -> Callable[[], GossipAlgorithm]:
    if name == "dpsgd":
        return lambda: DPSGD(consensus_step=GAMMA[name], clipping=clipping)
    if name == "choco":
        return lambda: Choco(parse_spec("sign"), consensus_step=GAMMA[name], clipping=clipping)
    if name == "def":
        return lambda: DEFATC(parse_spec("sign"), zeta=1.0, gamma=GAMMA[name], clipping=clipping)
    return lambda: PowerGossip(rank=1, consensus_step=GAMMA[name], clipping=clipping)


def _models(n: int) -> list[nn.Module]:
    """Identical models (DEF-ATC needs identical initial references); rounds make them differ."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3))
    return [copy.deepcopy(first) for _ in range(n)]


def _local_steps(peers: list[Peer], round: int) -> None:
    """Stand-in for each peer's local SGD step: independent noise per peer and round."""
    with torch.no_grad():
        for peer in peers:
            g = torch.Generator().manual_seed(1000 * round + peer.rank)
            for p in peer.model.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=0.3)


def _params(peer: Peer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in peer.model.parameters()]


def _mixed_change(name: str, peer: Peer, before: list[torch.Tensor]) -> float:
    """How far this round's mixing moved the peer: the parameters' change, except for DEF-ATC,
    whose combine sets w_k = phi_k + gamma sum_l a_lk (phi_l - phi_k): its distance to phi_k."""
    if name == "def":
        return difference_norm(_params(peer), peer.algorithm.state_dict()["reference"])
    return difference_norm(_params(peer), before)


ALGORITHMS = ["dpsgd", "choco", "def", "powergossip"]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_radius_never_reached_changes_nothing_bit_for_bit(name):
    plain = build_network(RING8, _models(8), _factory(name, None))
    huge = build_network(RING8, _models(8), _factory(name, FixedRadius(1e12)))
    small = build_network(RING8, _models(8), _factory(name, FixedRadius(1e-2)))
    for t in range(6):
        for peers in (plain, huge, small):
            _local_steps(peers, t)
            gossip_round(peers)
    for a, b in zip(stacked(plain), stacked(huge), strict=True):
        assert torch.equal(a, b)
    # and the comparison can fail: a radius that is reached does change the result
    assert any(
        not torch.allclose(a, c) for a, c in zip(stacked(plain), stacked(small), strict=True)
    )


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_small_radius_bounds_each_rounds_move_by_gamma_sum_w_tau(name):
    tau = 0.01
    peers = build_network(RING8, _models(8), _factory(name, FixedRadius(tau)))
    ratios = []
    for t in range(5):
        _local_steps(peers, t)
        before = [_params(peer) for peer in peers]
        gossip_round(peers)
        for peer, mine in zip(peers, before, strict=True):
            bound = GAMMA[name] * sum(RING8.neighbor_weights(peer.rank).values()) * tau
            moved = _mixed_change(name, peer, mine)
            assert moved <= bound * (1 + 1e-5), (t, peer.rank, moved, bound)
            ratios.append(moved / bound)
    # tight-ish: differences to the two neighbours are clipped to tau each and only partly
    # cancel, so a round moves a peer by a good part of the bound
    assert min(ratios) > 0.5, min(ratios)


def test_clipped_dpsgd_moves_exactly_by_the_clipped_differences():
    """x_i += gamma sum_j w_ij tau (x_j - x_i) / ||x_j - x_i|| when every neighbour is clipped."""
    tau = 0.01
    peers = build_network(RING8, _models(8), _factory("dpsgd", FixedRadius(tau)))
    _local_steps(peers, 0)
    before = [_params(peer) for peer in peers]
    gossip_round(peers)
    for peer in peers:
        i = peer.rank
        expected = [t.clone() for t in before[i]]
        for j, w in RING8.neighbor_weights(i).items():
            d = difference_norm(before[j], before[i])
            assert d > tau
            for e, xi, xj in zip(expected, before[i], before[j], strict=True):
                e.add_(xj - xi, alpha=GAMMA["dpsgd"] * w * tau / d)
        for got, want in zip(_params(peer), expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("name", ["dpsgd", "choco", "powergossip"])
def test_a_fixed_radius_keeps_the_network_average(name):
    """A fixed tau is the same at both ends and so is ||y_j - y_i||: each edge's two updates stay
    equal and opposite, so the algorithms that preserve the network sum still do."""
    peers = build_network(RING8, _models(8), _factory(name, FixedRadius(0.05)))
    _local_steps(peers, 0)
    sums = [x.sum(0) for x in stacked(peers)]
    spread = sum(float((x - x.mean(0)).pow(2).sum()) for x in stacked(peers))
    for _ in range(8):
        gossip_round(peers)
    for before, x in zip(sums, stacked(peers), strict=True):
        assert torch.allclose(x.sum(0), before, atol=1e-4), (x.sum(0) - before).abs().max()
    after = sum(float((x - x.mean(0)).pow(2).sum()) for x in stacked(peers))
    assert after < spread  # and it did mix


def test_adaptive_clipping_mixes_nothing_when_every_neighbour_may_lie():
    """b = 2 on a ring (two neighbours): no neighbour can vouch for a radius, so no mixing."""
    peers = build_network(RING8, _models(8), _factory("dpsgd", AdaptiveRadius(2)))
    _local_steps(peers, 0)
    before = stacked(peers)
    gossip_round(peers)
    for a, b in zip(before, stacked(peers), strict=True):
        assert torch.equal(a, b)
    sent = peers[0].stats.bytes_sent
    assert set(sent) == {1, 7} and min(sent.values()) > 0  # it still gossiped


@pytest.mark.parametrize("rule", [FixedRadius(0.1), AdaptiveRadius(1)], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("name", ["choco", "def"])
def test_a_neighbour_sending_huge_finite_values_cannot_make_a_peer_non_finite(name, rule):
    """Finite payloads of 3e38 (they pass the finite check) overflow the tracked copy of the
    liar to inf; clipping must leave it out instead of multiplying it by 0 (inf * 0 = NaN)."""

    def algorithm() -> GossipAlgorithm:
        if name == "choco":
            return Choco(parse_spec("identity"), consensus_step=0.5, clipping=rule)
        return DEFATC(parse_spec("identity"), clipping=rule)

    torch.manual_seed(0)
    peers = build_network(RING8, [nn.Linear(3, 2) for _ in range(8)], algorithm)
    liar = peers[0].algorithm._codec
    honest_compress = liar.compress
    liar.compress = lambda x, key, i: honest_compress(torch.full_like(x, 3e38), key, i)
    for _ in range(4):
        gossip_round(peers)
    for peer in peers[1:]:
        for parameter in peer.model.parameters():
            assert torch.isfinite(parameter).all() and parameter.abs().max() < 10


def test_adaptive_clipping_warns_a_peer_that_could_never_mix(caplog):
    star = load_topology("topologies/star6.yaml")
    config = TrainConfig(algorithm="dpsgd", clip="adaptive")
    with caplog.at_level("WARNING", logger="gossipcomp.experiment"):
        build_algorithm(config, star, 0)  # the hub: 5 neighbours, mixes
        assert not caplog.records
        build_algorithm(config, star, 1)  # a leaf: its only neighbour may be the liar
    assert "peer 1 has 1 neighbours" in caplog.text and "will never mix" in caplog.text
