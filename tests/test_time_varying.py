"""Time-varying topologies: one-peer exponential and base-k graphs average exactly after their
period (matrix level, and peers over real gRPC with exact D-PSGD), random matchings agreed by
every peer, hostile topology files refused, a neighbour down in its round skipped, PowerGossip's
per-edge state kept across the rounds its edge is inactive, broadcasting algorithms refused."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import build_network, gossip_round, run_in_threads, stacked
from helpers import close_all, mlp_models

from gossipcomp.cli import main
from gossipcomp.compress import parse_spec
from gossipcomp.gossip import DEFATC, DPSGD, Choco, PowerGossip
from gossipcomp.gossip.base import Neighbourhood
from gossipcomp.gossip.powergossip import LEFT, RIGHT
from gossipcomp.peer import Peer
from gossipcomp.topology import MAX_EDGES, TopologyError, build_topology, topology_from_dict
from gossipcomp.topology.rounds import MAX_PERIOD
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload.models import model_signature


def _product_error(topology, rounds: int, seed: int = 0) -> float:
    """max |x_i - mean(x)| after `rounds` rounds of W_t from random x (3 columns)."""
    x = np.random.default_rng(seed).standard_normal((topology.n, 3))
    mean = x.mean(0)
    for t in range(rounds):
        x = topology.rounds.matrix(t) @ x
    return float(np.abs(x - mean).max())


@pytest.mark.parametrize("n", [8, 16, 32])
def test_one_peer_exponential_averages_exactly_in_log2_n_rounds(n):
    topology = topology_from_dict({"kind": "one-peer-exponential", "n": n})
    log_n = n.bit_length() - 1
    assert topology.period == log_n
    for t in range(log_n):
        for i in range(n):  # a perfect matching at distance 2^t, weight 1/2
            row, self_weight = topology.round_weights(i, t)
            assert row == {i ^ (1 << t): 0.5} and self_weight == 0.5
    assert _product_error(topology, log_n) < 1e-6
    assert _product_error(topology, log_n - 1) > 1e-2  # one round fewer does not
    # any log2 n consecutive rounds average exactly, not only those from round 0
    assert _product_error(topology, log_n + 2, seed=1) < 1e-6
    assert topology.rounds.contraction < 1e-9
    assert topology.optimal_consensus_step == 1.0  # D-PSGD's "auto" step then averages exactly


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("n", [6, 12, 24, 7, 13])
def test_base_k_averages_exactly_after_its_period_with_at_most_k_neighbours(n, k):
    topology = topology_from_dict({"kind": "base-k", "n": n, "k": k})
    period = topology.period
    assert max(topology.rounds.degrees()) <= k
    assert _product_error(topology, period) < 1e-6
    assert _product_error(topology, period - 1) > 1e-3  # the whole period is needed
    assert topology.rounds.contraction < 1e-9


def test_base_2_periods_are_logarithmic_for_6_12_24():
    periods = [topology_from_dict({"kind": "base-k", "n": n, "k": 1}).period for n in (6, 12, 24)]
    assert periods == [4, 5, 6]  # 6 = 2 x 3: three rounds for the 3s, one to join the halves


def _grpc_average(topology, rounds: int) -> None:
    peers = build_network(topology, mlp_models(topology.n, hidden=8), DPSGD, transport="grpc")
    try:
        target = [x.mean(0) for x in stacked(peers)]
        for _ in range(rounds):
            gossip_round(peers)
        for t, x in zip(target, stacked(peers), strict=True):
            assert float((x - t).abs().max()) < 1e-6
        for peer in peers:  # one neighbour a round: each link was used only in its rounds
            assert peer.stats.failed_exchanges == {}
            sent = peer.stats.bytes_sent
            assert set(sent) <= set(topology.neighbors(peer.rank))
            partners = {j for t in range(rounds) for j in topology.round_weights(peer.rank, t)[0]}
            assert set(sent) == partners
    finally:
        close_all(peers)


def test_base_2_peers_over_grpc_average_exactly_with_dpsgd(one_thread):
    _grpc_average(topology_from_dict({"kind": "base-k", "n": 6, "k": 1}), 4)


def test_one_peer_exponential_peers_over_grpc_average_exactly_with_dpsgd(one_thread):
    _grpc_average(topology_from_dict({"kind": "one-peer-exponential", "n": 8}), 3)


def test_random_matching_is_agreed_by_every_peer_and_symmetric():
    spec = {"kind": "random-matching", "n": 9, "seed": 5}
    one, other = topology_from_dict(spec), pickle.loads(pickle.dumps(topology_from_dict(spec)))
    assert one.hash == other.hash
    assert one.hash != topology_from_dict({**spec, "seed": 6}).hash
    partners_seen = set()
    for t in range(40):
        rows = {i: one.round_weights(i, t) for i in range(9)}
        for i in range(9):  # another process derives the same round, rank by rank
            assert other.round_weights(i, t) == rows[i]
        unmatched = [i for i, (row, _) in rows.items() if not row]
        assert len(unmatched) == 1  # n odd: one peer a round keeps its model
        assert rows[unmatched[0]][1] == 1.0
        for i, (row, self_weight) in rows.items():
            for j, w in row.items():
                assert rows[j][0] == {i: w} and w == 0.5 and self_weight == 0.5
                partners_seen.add((min(i, j), max(i, j)))
    assert len(partners_seen) > 20  # the pairs change from round to round
    # different seeds draw different matchings
    other_seed = topology_from_dict({**spec, "seed": 6})
    assert any(other_seed.round_weights(0, t) != one.round_weights(0, t) for t in range(10))


def test_explicit_rounds_list_and_hash_covers_the_rounds():
    rounds = [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    topology = topology_from_dict({"kind": "rounds", "n": 4, "rounds": rounds})
    assert topology.period == 2 and topology.rounds.contraction < 1e-12
    assert topology.round_weights(0, 3) == ({2: 0.5}, 0.5)
    swapped = topology_from_dict({"kind": "rounds", "n": 4, "rounds": rounds[::-1]})
    assert swapped.hash != topology.hash  # same union and mean W, other rounds
    assert topology.hash != build_topology("ring", n=4).hash
    static = build_topology("ring", n=8)
    assert static.period == 1 and not static.time_varying
    assert static.round_weights(3, 17) == (static.neighbor_weights(3), static.self_weight(3))


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"kind": "one-peer-exponential", "n": 6}, "not a power of two"),
        ({"kind": "one-peer-exponential", "n": 8, "weights": "uniform"}, "weights given"),
        ({"kind": "base-k", "n": 6}, "missing parameter 'k'"),
        ({"kind": "base-k", "n": 6, "k": 0}, "'k' is 0 (too small)"),
        ({"kind": "base-k", "n": 6, "k": 6}, "k in 1..5"),
        ({"kind": "base-k", "n": 6, "k": "2"}, "an integer in 1.."),
        ({"kind": "base-k", "n": 10**9, "k": 1}, "too large"),
        ({"kind": "random-matching", "n": 2000}, "MAX_EDGES"),
        ({"kind": "random-matching", "n": 8, "seed": -1}, "'seed' is -1"),
        ({"kind": "rounds", "n": 4, "rounds": []}, "a list of rounds"),
        ({"kind": "rounds", "n": 4, "rounds": [[]]}, "round 0 is []"),
        ({"kind": "rounds", "n": 4, "rounds": "x" * 10_000}, "a list of rounds"),
        ({"kind": "rounds", "n": 4, "rounds": [[[0, 1]], [[0, 9]]]}, "(round 1): edge [0, 9]"),
        ({"kind": "rounds", "n": 4, "rounds": [[[0, 0]]]}, "self-loop"),
        ({"kind": "rounds", "n": 4, "rounds": [[[0, 1], [2, 3]]]}, "disconnected"),
        ({"kind": "rounds", "n": 4, "rounds": [[[0, 1]]] * (MAX_PERIOD + 1)}, "MAX_PERIOD"),
        ({"kind": "rounds", "n": 4, "rounds": [[[0, 1]] * (MAX_EDGES + 1)]}, "MAX_EDGES"),
        ({"kind": "rounds", "n": 4, "rounds": [[[0, 1]]], "weights": "explicit"}, "metropolis"),
        ({"kind": "rounds", "n": 3, "rounds": [[[0, 1]], [[1, 2]]], "k": 1}, "do not apply"),
    ],
)
def test_hostile_time_varying_specs_are_refused_with_clear_errors(spec, message):
    with pytest.raises(TopologyError) as error:
        topology_from_dict(spec, source="evil.yaml")
    assert "evil.yaml" in str(error.value) and message in str(error.value)
    assert len(str(error.value)) < 600  # no unbounded input echoed back


def test_topology_show_prints_period_degrees_and_contraction(capsys):
    assert main(["topology", "show", "base2_12"]) == 0
    out = capsys.readouterr().out
    assert "period" in out and " 5 " in out and "1, 1, 1, 1, 1" in out
    assert "contraction over the period" in out


def _memory_network(topology, algorithm, models, round_timeout=30.0):
    hub = InMemoryHub()
    peers = []
    for r, m in enumerate(models):
        identity = Identity(r, topology.hash, model_signature(m))
        t = InMemoryTransport(identity, topology.neighbors(r), hub)
        peers.append(Peer(m, topology, r, algorithm(), t, round_timeout=round_timeout))
    return hub, peers


def test_a_neighbour_down_in_its_round_is_skipped_without_stalling(one_thread):
    topology = topology_from_dict({"kind": "one-peer-exponential", "n": 4})
    models = mlp_models(4, hidden=8)
    peers = build_network(topology, models, DPSGD, transport="grpc", round_timeout=3.0)
    try:
        peers[3].close()  # peer 3 is gone; peer 2's partner in round 0, peer 1's in round 1
        live = peers[:3]
        before = [[p.detach().clone() for p in peer.model.parameters()] for peer in live]
        gossip_round(live)  # round 0: 0-1 average, 2 keeps its model (its weight to self)
        after = [[p.detach().clone() for p in peer.model.parameters()] for peer in live]
        for b, a in zip(before[2], after[2], strict=True):
            assert torch.equal(a, b)
        for b0, b1, a0, a1 in zip(before[0], before[1], after[0], after[1], strict=True):
            assert torch.allclose(a0, (b0 + b1) / 2, atol=1e-6) and torch.allclose(a1, a0)
        assert 3 in peers[2].stats.failed_exchanges
        gossip_round(live)  # round 1: 0-2 average; 1's partner 3 is down, 1 goes on
        assert [peer.round for peer in live] == [2, 2, 2]
        for x, y in zip(peers[0].model.parameters(), peers[2].model.parameters(), strict=True):
            assert torch.allclose(x, y, atol=1e-6)
    finally:
        close_all(peers[:3])


def test_powergossip_keeps_an_edges_warm_start_while_it_is_inactive(one_thread):
    # n = 4: period 2, edge (0, 1) active in rounds 0, 2, 4, ... Sides must alternate between
    # its activations (round parity alone would give it the right side every time, and the
    # left warm-start vector it leaves would never be used)
    topology = topology_from_dict({"kind": "one-peer-exponential", "n": 4})
    peers = build_network(topology, mlp_models(4, hidden=8), lambda: PowerGossip(rank=1))
    try:
        pg = peers[0].algorithm
        matrix = pg._matrices[0]
        initial_right = pg._state[(1, matrix, RIGHT)].clone()
        gossip_round(peers)  # round 0: edge (0, 1), a right step: leaves its left warm start
        warm_left = pg._state[(1, matrix, LEFT)].clone()
        assert torch.equal(pg._state[(1, matrix, RIGHT)], initial_right)
        gossip_round(peers)  # round 1: edge (0, 2) only; edge (0, 1)'s state stays as it was
        assert torch.equal(pg._state[(1, matrix, LEFT)], warm_left)
        assert torch.equal(pg._state[(1, matrix, RIGHT)], initial_right)
        gossip_round(peers)  # round 2: edge (0, 1) again, a left step from the warm start
        assert not torch.equal(pg._state[(1, matrix, RIGHT)], initial_right)
        other = peers[1].algorithm  # both ends hold the same vectors
        for side in (LEFT, RIGHT):
            assert torch.equal(pg._state[(1, matrix, side)], other._state[(0, matrix, side)])
    finally:
        close_all(peers)


def _powergossip_spread(rounds: int) -> float:
    """The largest per-coordinate spread across peers after `rounds` rounds of rank-1
    PowerGossip on a one-peer exponential graph of 4 peers, over the spread before; the network
    sum is checked kept."""
    topology = topology_from_dict({"kind": "one-peer-exponential", "n": 4})
    peers = build_network(topology, mlp_models(4, hidden=8), lambda: PowerGossip(rank=1))
    try:
        before = stacked(peers)
        for _ in range(rounds):
            gossip_round(peers)
        after = stacked(peers)
        for b, x in zip(before, after, strict=True):
            assert torch.allclose(x.sum(0), b.sum(0), atol=1e-4)
        return max(
            float(x.std(0).max()) / float(b.std(0).max())
            for b, x in zip(before, after, strict=True)
        )
    finally:
        close_all(peers)


def test_powergossip_reaches_consensus_on_a_one_peer_exponential_graph(one_thread, monkeypatch):
    assert _powergossip_spread(40) < 0.4
    # sides by round parity (as before time-varying graphs): with an even period every edge
    # takes the same side at each activation, its vector never moves, and consensus stalls
    monkeypatch.setattr(Neighbourhood, "sweep", property(lambda hood: hood.round))
    assert _powergossip_spread(40) > 0.8


def test_broadcasting_algorithms_are_refused_on_time_varying_topologies():
    topology = topology_from_dict({"kind": "one-peer-exponential", "n": 4})
    with pytest.raises(ValueError, match="Choco cannot run on the time-varying topology"):
        _memory_network(topology, lambda: Choco(parse_spec("topk:ratio=0.1")), mlp_models(4))
    with pytest.raises(ValueError, match="DEF-ATC cannot run on the time-varying topology"):
        _memory_network(topology, lambda: DEFATC(parse_spec("topk:ratio=0.1")), mlp_models(4))
    static = build_topology("ring", n=4)  # the same algorithm on a static topology is fine
    _, peers = _memory_network(static, lambda: Choco(parse_spec("topk:ratio=0.1")), mlp_models(4))
    close_all(peers)


def test_the_guides_time_varying_examples_are_valid_topologies():
    guide = (Path(__file__).resolve().parent.parent / "docs/guides/topologies.md").read_text()
    section = guide.split("## Time-varying topologies", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    kinds = {topology_from_dict(yaml.safe_load(block)).kind for block in blocks}
    assert kinds == {"one-peer-exponential", "base-k", "random-matching", "rounds"}


def test_a_peer_starting_late_joins_partners_that_ran_ahead_of_it():
    """One-peer exponential on 4 peers over gRPC: peers 0 and 1 finish round 0 together (their
    round-0 edge) while peer 3 has not started. Peer 3's handshake then reaches peer 1 at
    round 1 on an edge that is up but has never exchanged: it agrees a resume round (it was
    refused as if it would park a working edge, so peer 3 could not start, which made
    `simulate` over worker processes fail after 30 s)."""
    topology = build_topology("one-peer-exponential", n=4)
    peers = [
        Peer.over_grpc(m, topology, r, DPSGD(), bind="127.0.0.1:0", round_timeout=10)
        for r, m in enumerate(mlp_models(4))
    ]
    try:
        addresses = {p.rank: p.address for p in peers}
        run_in_threads([lambda p=p: p.start(10, addresses) for p in peers[:3]])
        run_in_threads([peers[0].gossip, peers[1].gossip])  # round 0: 0 with 1, 2 waits for 3
        assert (peers[0].round, peers[1].round) == (1, 1)
        peers[3].start(5, addresses)  # the handshake with peer 1 (round 1) is answered
    finally:
        close_all(peers)


def test_simulate_runs_a_time_varying_topology_over_worker_processes(tmp_path):
    """8 peers over 2 worker processes, each starting its peers one after another: a peer
    whose partners are ready runs rounds ahead while a neighbour is still starting, and that
    neighbour's handshake (at an earlier round) must agree a resume round rather than be
    refused as if it parked a working edge (it was refused, and simulate failed after 30 s)."""
    spec = tmp_path / "op8.yaml"
    spec.write_text("name: op8\nkind: one-peer-exponential\nn: 8\n")
    report = tmp_path / "op8.json"
    argv = ["simulate", "--quiet", "--topology", str(spec), "--workers", "2", "--rounds", "24"]
    argv += ["--algorithm", "dpsgd", "--local-steps", "4", "--eval-every", "0"]
    assert main([*argv, "--report", str(report)]) == 0
    result = json.loads(report.read_text())
    assert all(p["gossip_rounds"] >= 6 for p in result["per_peer"])
    assert result["final_test_accuracy"] > 0.5
