"""Bandwidth-adaptive levels for Choco-SGD and DEF-ATC: ladders per compressor family, one level
per peer (its slowest link's), decoded by every neighbour from the schedule's link table.

Ladders are checked on their own (ordered by bytes, no compression at the top); peers on a
ring with different levels keep both ends' tracked copies identical and Choco's network sum;
hostile levels are refused naming the field; and a throttled ring reporting to a real
coordinator lowers the levels of a link's ends when its bandwidth drops tenfold and raises them
when it recovers, with both ends of every edge always in step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_network, gossip_round, run_in_threads
from helpers import (
    assert_clean,
    assert_sum_kept,
    benchmark,
    close_all,
    level_by_round,
    levels_schedule,
    mlp_models,
    network_sum,
    throttled_ring,
    tracked,
)

from gossipcomp.compress import parse_spec
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.gossip import DEFATC, Choco
from gossipcomp.gossip.base import PeerLeveled
from gossipcomp.levels.ladder import ladder_for
from gossipcomp.levels.rate import peer_levels
from gossipcomp.peer import Peer
from gossipcomp.schedule.costs import LinkCost
from gossipcomp.schedule.schedule import ScheduleRefused
from gossipcomp.topology import build_topology
from gossipcomp.topology.files import load_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.throttled import LinkRates, RateChange
from gossipcomp.workload.models import model_signature

RING4 = build_topology("ring", n=4)
RING8 = build_topology("ring", n=8)
NUMELS = [64 * 256, 256, 256 * 256, 256, 2560, 10]


@pytest.mark.parametrize(
    "spec",
    [
        "topk:ratio=0.01",
        "randomk:ratio=0.01,unbiased=false",
        "randomk:ratio=0.03",
        "qsgd:levels=16",
        "ef+topk:ratio=0.05",
        "dgc:ratio=0.001",
        "sign",
    ],
)
def test_a_ladder_is_ordered_by_bytes_with_no_compression_at_the_top(spec):
    ladder = ladder_for(spec, NUMELS)
    assert len(ladder.specs) == len(ladder.nbytes) >= 3
    assert list(ladder.nbytes) == sorted(set(ladder.nbytes))  # strictly increasing
    for level, (rung, nbytes) in enumerate(zip(ladder.specs, ladder.nbytes, strict=True), 1):
        assert sum(parse_spec(rung).wire_bytes(n) for n in NUMELS) == nbytes
        assert ladder.spec(level) == rung
    top = parse_spec(ladder.specs[-1])
    assert top.name.removeprefix("ef+") == "identity"
    assert ladder.nbytes[-1] == 4 * sum(NUMELS)
    assert ladder.specs[ladder.default - 1] == parse_spec(spec).spec  # the configured one
    assert all(s.startswith("ef+") == spec.startswith("ef+") for s in ladder.specs)


def test_qsgd_rungs_are_the_most_levels_each_bit_width_carries():
    ladder = ladder_for("qsgd:levels=7", NUMELS)
    assert ladder.specs == tuple(f"qsgd:levels={s}" for s in (1, 3, 7, 15, 31, 63, 127)) + (
        "identity",
    )
    # levels=16 needs 5 bits, like 31: the configured one takes that rung
    assert "qsgd:levels=16" in ladder_for("qsgd:levels=16", NUMELS).specs
    assert "qsgd:levels=31" not in ladder_for("qsgd:levels=16", NUMELS).specs


@pytest.mark.parametrize("level", [0, -1, 13, 1 << 40, True, "3", 2.0])
def test_a_level_off_the_ladder_is_refused_naming_it(level):
    ladder = ladder_for("topk:ratio=0.01", NUMELS)
    assert ladder.top == 12
    expected = r"^level of peer 3 \(the ladder .*\): expected an integer in \[1, 12\], got "
    with pytest.raises(ValueError, match=expected):
        ladder.check(level, "level of peer 3")


def test_a_peer_broadcasts_at_its_slowest_links_level():
    around = {p: RING8.neighbors(p) for p in range(8)}
    levels = peer_levels({(0, 1): 2, (1, 2): 9, (3, 4): 5, (0, 7): 4}, around, default=7)
    assert levels == {0: 2, 1: 2, 2: 7, 3: 5, 4: 5, 5: 7, 6: 7, 7: 4}
    assert peer_levels({}, around, default=7) == dict.fromkeys(range(8), 7)


def _local_step(peers: list[Peer], generator: torch.Generator) -> None:
    """Move every peer's model its own way, as a local optimizer step would."""
    with torch.no_grad():
        for peer in peers:
            for p in peer.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.01)


def _assert_ends_agree(peers: list[Peer]) -> None:
    for peer in peers:
        own, _ = tracked(peer)
        for j in peer.topology.neighbors(peer.rank):
            theirs = tracked(peers[j])[1][peer.rank]
            for a, b in zip(own, theirs, strict=True):
                assert torch.equal(a, b), (peer.rank, j)


@pytest.mark.parametrize("algorithm", ["choco", "def"])
@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.05", "qsgd:levels=16", "randomk:ratio=0.05", "ef+topk:ratio=0.05"]
)
def test_peers_at_different_levels_keep_both_ends_in_step(algorithm, spec):
    """Two schedules give the ring's links different levels, so peers broadcast at different
    levels and change them mid-run: every exchange is accepted, each peer's own copy equals
    what its neighbours track bit for bit, Choco keeps the network sum, and a peer at a lower
    level sends fewer bytes."""
    kind = Choco if algorithm == "choco" else DEFATC
    # identical initial models (DEF-ATC's references start at them), then local steps apart
    peers = build_network(RING4, mlp_models(4, same=True), lambda: kind(parse_spec(spec)))
    generator = torch.Generator().manual_seed(0)
    try:
        assert isinstance(peers[0].algorithm, PeerLeveled)
        top = peers[0].algorithm.level_costs(peers[0].gossiped).levels[-1]
        first = levels_schedule(1, 2, {(0, 1): 1, (1, 2): top, (2, 3): 3, (0, 3): top})
        second = levels_schedule(2, 5, {(0, 1): top, (0, 3): 2})
        for peer in peers:
            peer.apply(first)
            peer.apply(second)
        sent = []
        for _ in range(8):
            _local_step(peers, generator)
            before = network_sum(peers)
            start = [p.stats.bytes_sent_total for p in peers]
            gossip_round(peers)
            sent.append([p.stats.bytes_sent_total - s for p, s in zip(peers, start, strict=True)])
            if algorithm == "choco":  # the network sum is kept
                assert_sum_kept(before, peers, 1e-4)
        assert_clean(peers)
        _assert_ends_agree(peers)

        # headers differ by a byte or two (sender ids): "alike" is within 16 bytes
        def alike(a: int, b: int) -> bool:
            return abs(a - b) <= 16

        # round 3 (first schedule): peers 0 and 1 at level 1, peers 2 and 3 at level 3
        assert alike(sent[3][0], sent[3][1]) and alike(sent[3][2], sent[3][3])
        assert sent[3][0] + 16 < sent[3][3]
        # round 6 (second): peers 0 and 3 at level 2, peers 1 and 2 at the default
        assert alike(sent[6][0], sent[6][3]) and alike(sent[6][1], sent[6][2])
        assert sent[6][0] + 16 < sent[6][1]
        labels = [c["level"] for c in peers[0].stats.peer_levels]
        assert [parse_spec(x).spec for x in labels] == labels and len(labels) == 2
    finally:
        close_all(peers)


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({(0, 1): 10_000}, r"^schedule epoch 1: link 0-1 level \(the ladder of choco\): "),
        ({(2, 3): 13}, r"link 2-3 level \(.*\): expected an integer in \[1, 10\], got 13$"),
        ({(0, 2): 2}, "not an edge"),
    ],
)
def test_a_hostile_schedule_level_is_refused_naming_the_field_and_nothing_changes(links, message):
    peers = build_network(RING4, mlp_models(4), lambda: Choco(parse_spec("topk:ratio=0.05")))
    try:
        with pytest.raises(ScheduleRefused, match=message):
            peers[0].apply(levels_schedule(1, 5, links))
        assert peers[0].schedules.newest.epoch == 0
        gossip_round(peers)
        assert all(p.stats.failed_exchanges == {} for p in peers)
        with pytest.raises(ValueError, match="level of peer 1"):
            peers[0].algorithm.peer_specs(peers[0].gossiped, None, {1: 0})
        with pytest.raises(ValueError, match="level for peer 2: expected this peer"):
            peers[0].algorithm.peer_specs(peers[0].gossiped, None, {2: 1})
    finally:
        close_all(peers)


def test_a_checkpoint_restores_the_level_in_force():
    peers = build_network(
        RING4, mlp_models(4, same=True), lambda: DEFATC(parse_spec("topk:ratio=0.05"))
    )
    try:
        for peer in peers:
            peer.apply(levels_schedule(1, 1, {(0, 1): 2}))
        gossip_round(peers)
        gossip_round(peers)
        state = peers[0].state_dict()
        assert peers[0].algorithm._levels.own == 2
    finally:
        close_all(peers)
    model = mlp_models(1, same=True)[0]
    identity = Identity(0, RING4.hash, model_signature(model))
    transport = InMemoryTransport(identity, RING4.neighbors(0), InMemoryHub())
    fresh = Peer(model, RING4, 0, DEFATC(parse_spec("topk:ratio=0.05")), transport, ready=False)
    try:  # restored before start(), as a restarted peer is
        fresh.load_state_dict(state)
        assert fresh.algorithm._levels.levels == {0: 2, 1: 2, 3: fresh.algorithm.default_level()}
    finally:
        fresh.close()


def _throttled_ring(rates: LinkRates, spec: str) -> list[Peer]:
    return throttled_ring(RING4, mlp_models(4, hidden=256), rates, lambda: Choco(parse_spec(spec)))


def _run_adaptive(peers: list[Peer], budget: float, rounds: int, on_round=None) -> None:
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=budget)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    clients = [CoordinatorClient(server.address, p, None, report_every=1) for p in peers]

    def train(peer: Peer, client: CoordinatorClient) -> None:
        for _ in range(rounds):
            peer.gossip()
            client.after_round()
            if on_round is not None:
                on_round(peer)

    try:
        run_in_threads(
            [lambda p=p, c=c: train(p, c) for p, c in zip(peers, clients, strict=True)], 120
        )
    finally:
        for client in clients:
            client.close()
        server.stop()


def test_a_link_that_slows_tenfold_lowers_its_ends_levels_and_they_rise_when_it_recovers(
    one_thread,
):
    """Choco with top-k on ring4 over the throttled transport, a coordinator choosing levels
    every round within a 120 ms budget (CPU noise on a busy machine, tens of ms, stays small
    beside it). Link 0-1 drops from 8 to 0.8 Mbit/s at round 24 and recovers at round 52. Peers 0 and 1 fall to a level whose payload fits the slow link within
    12 rounds, the link's transfers fit the budget again before it recovers, and the levels
    rise after it. No exchange fails or mismatches, and both ends track the same copies."""
    budget, rounds, drop, back = 0.12, 80, 24, 52
    rates = LinkRates(8, [RateChange(0, 1, 0.8, drop), RateChange(0, 1, 8, back)])
    peers = _throttled_ring(rates, "topk:ratio=0.01")
    slow_sends: list[float] = []

    def watch(peer: Peer) -> None:
        if peer.rank == 0 and peer.round == back - 1:
            slow_sends.extend(s for _, s in peer.sends.samples(1)[-2:])

    try:
        _run_adaptive(peers, budget, rounds, watch)
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        slow = LinkCost(0.0, 8 / 0.8e6)
        fits_slow = max(x for x in costs.levels if costs.seconds(x, slow) <= budget)
        for rank in (0, 1):
            level = level_by_round(peers[rank], rounds)
            assert level[drop - 1] > fits_slow, (level, fits_slow)
            assert level[drop + 12] <= fits_slow, (level, fits_slow)
            assert level[rounds] > level[back - 1], level
        assert slow_sends and max(slow_sends) <= 1.25 * budget, slow_sends
        for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
            ends = [[c for c in peers[r].stats.link_levels if c["link"] == [a, b]] for r in (a, b)]
            assert ends[0] == ends[1]
        assert_clean(peers)
        _assert_ends_agree(peers)
    finally:
        close_all(peers)


@pytest.mark.parametrize(("budget", "where"), [(1e4, "top"), (1e-6, "bottom")])
def test_a_very_high_budget_sends_uncompressed_and_a_very_low_one_a_low_level(
    one_thread, budget, where
):
    """A very low budget takes every peer below the configured level (qsgd 16) into the
    lowest rungs, at or above the floor (levels/codecs.py). Not necessarily to the floor
    itself: over these 100 Mbit/s links the lowest rungs' bytes take 1-2 ms, less than the
    sends' own noise between four peers in threads (4-30 ms), so the estimate sees no cost
    per byte in them (levels/rate.py `send_noise`) and may carry one of them."""
    peers = _throttled_ring(LinkRates(100), "qsgd:levels=16")
    try:
        _run_adaptive(peers, budget, 24)
        levels = peers[0].algorithm._levels
        ladder = levels.ladder
        own = [p.algorithm._levels.own for p in peers]
        if where == "top":
            assert own == [ladder.top] * len(peers)
            assert ladder.spec(ladder.top) == "identity"
        else:
            assert all(levels.floor <= level < ladder.default for level in own), own
        assert all(p.stats.mismatched_epoch_exchanges == 0 for p in peers)
        _assert_ends_agree(peers)
    finally:
        close_all(peers)


def test_a_public_copy_per_edge_trains_exactly_as_one_per_peer_when_every_link_has_one_level():
    """benchmarks/peer_levels.py's training mode: with every link at the same level, a peer's
    public copies for its neighbours all receive the same compressed differences, so a copy
    per edge must train bit for bit as one copy per peer (the same rounds, the same accuracy,
    the same bytes); a copy per edge whose difference reached every neighbour, not only its
    own, would not. (Which copy a peer mixes against cannot show here, all being equal: the
    test below checks that with levels that differ.)"""
    peer_levels_benchmark = benchmark("peer_levels")
    ring4 = load_topology("ring4")
    levels = ("topk:ratio=0.05",) * 4
    result = peer_levels_benchmark.train_all(ring4, levels, [1], rounds=20, target=0.3)
    runs = result["runs"]
    assert runs["floor"][0]["rounds_to_target"] is not None  # 0.3 is reached in 20 rounds
    for name in ("per_peer", "per_edge", "top"):
        for key in ("rounds_to_target", "final_accuracy", "bytes_per_round"):
            assert runs[name][0][key] == runs["floor"][0][key], (name, key)
    assert result["median_rounds_over_floor"] == dict.fromkeys(runs, 1.0)


@pytest.mark.parametrize("per_edge", [True, False])
def test_the_peer_levels_choco_network_keeps_both_ends_copies_equal_and_the_average(per_edge):
    """benchmarks/peer_levels.py's Choco network with levels that differ by link: every copy a
    peer tracks of a neighbour's public copy equals the one the neighbour keeps for it (per
    edge: its copy for that peer; per peer: its one copy), and the network average of every
    group is unchanged by gossip (each edge's step is the same at both ends)."""
    peer_levels_benchmark = benchmark("peer_levels")
    ring4 = load_topology("ring4")
    levels = dict(
        zip(
            [(0, 1), (1, 2), (2, 3), (0, 3)],
            ["topk:ratio=0.02", "topk:ratio=0.05", "topk:ratio=0.2", "topk:ratio=0.2"],
            strict=True,
        )
    )
    generator = torch.Generator().manual_seed(3)
    groups = [[torch.randn(300, generator=generator), torch.randn(7, 5, generator=generator)]
              for _ in range(4)]  # fmt: skip
    means = [torch.stack([g[k] for g in groups]).mean(0) for k in range(2)]
    network = peer_levels_benchmark.ChocoNetwork(ring4, levels, per_edge, groups, 0, None)
    for r in range(6):
        network.round(r)
    for i in range(4):
        for j in ring4.neighbors(i):
            own = network.public[i][j if per_edge else -1]
            for g in range(2):
                assert torch.equal(network.tracked[j][i][g], own[g]), (i, j, g)
    for k in range(2):
        after = torch.stack([g[k] for g in groups]).mean(0)
        assert torch.allclose(after, means[k], atol=1e-6)
    assert any(not torch.equal(groups[0][0], g[0]) for g in groups[1:])  # not yet in consensus


def test_the_peer_levels_training_mode_refuses_levels_that_do_not_match_the_ring():
    peer_levels_benchmark = benchmark("peer_levels")
    with pytest.raises(ValueError, match=r"--link-levels: expected 4 .* got 2"):
        peer_levels_benchmark.train_all(
            load_topology("ring4"), ["topk:ratio=0.02"] * 2, [0], rounds=2, target=0.9
        )
    with pytest.raises(ValueError, match="--train: expected a ring topology"):
        peer_levels_benchmark.train_all(
            load_topology("star6"), ["topk:ratio=0.02"] * 6, [0], rounds=2, target=0.9
        )


def test_the_peer_levels_training_mode_runs_from_its_command_line(tmp_path):
    """The command docs/benchmarks.md quotes, in a tiny configuration: every arrangement is
    run for every seed and compared with the floor of the same seed."""
    out = tmp_path / "train.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/peer_levels.py", "--train", "--rounds", "6"]
        + ["--seeds", "0", "1", "--target", "0", "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"floor", "per_peer", "per_edge", "top"}
    assert all(len(rows) == 2 for rows in result["runs"].values())
    assert result["link_levels"]["0-1"] == "topk:ratio=0.02"
    floor_bytes = result["runs"]["floor"][0]["bytes_per_round"]
    assert result["runs"]["per_edge"][0]["bytes_per_round"] > floor_bytes  # links above it
    assert result["rounds_over_floor"]["floor"] == [1.0, 1.0]
    assert "d" not in result["config"] and result["config"]["topology"] == "ring4"
    # an option of the other mode is refused, naming it, rather than ignored
    refused = subprocess.run(
        [sys.executable, "benchmarks/peer_levels.py", "--train", "--d", "512", "--step", "0.1"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert "--d, --step: only for the consensus mode" in refused.stderr


def test_the_peer_levels_benchmark_runs_and_counts_what_each_option_keeps(tmp_path):
    """benchmarks/peer_levels.py in a tiny configuration (docs/benchmarks.md quotes it): a copy
    per edge keeps 2 x degree models, one level per peer 1 + degree; per peer sends fewer bytes
    than per edge; every run keeps the network average (Choco)."""
    out = tmp_path / "levels.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/peer_levels.py", "--d", "512", "--rounds", "4"]
        + ["--json", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs["per_edge"]["state_floats_per_peer"] == 4 * 512
    assert runs["per_peer"]["state_floats_per_peer"] == 3 * 512
    assert runs["slow"]["bytes_per_round"] < runs["per_peer"]["bytes_per_round"]
    assert runs["per_peer"]["bytes_per_round"] < runs["per_edge"]["bytes_per_round"]
    assert runs["per_edge"]["bytes_per_round"] < runs["fast"]["bytes_per_round"]
    assert all(row["average_drift"] < 1e-5 for row in runs.values())
