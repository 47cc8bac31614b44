"""Bandwidth-adaptive compression: per-link PowerGossip ranks chosen from measured links.

The rate controller is tested on its own (budget extremes, patience, estimates), PowerGossip with
a different rank per link keeps the network average and both ends' vectors equal, and a ring of
peers over the in-process throttled transport, reporting to a real coordinator, lowers a link's
rank when its bandwidth drops tenfold and raises it again when it recovers, with both ends of
every edge always on the same level.
"""

from __future__ import annotations

import logging

import grpc
import pytest
import torch
from conftest import build_network, gossip_round, run_in_threads, stacked
from helpers import (
    assert_clean,
    assert_sum_kept,
    close_all,
    ladder_report,
    levels_schedule,
    link_level_by_round,
    mlp_models,
    stop_all,
    throttled_ring,
)

from gossipcomp.cli import build_parser
from gossipcomp.cli.coordinator import make_coordinator
from gossipcomp.coordinator import Coordinator, CoordinatorServer, ReportRefused
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.gossip import PowerGossip
from gossipcomp.levels.rate import (
    FIRST_DECISION_ROUND,
    LevelCosts,
    RateController,
    estimate_link,
    rank_ladder,
)
from gossipcomp.peer import Peer
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.costs import LinkCost
from gossipcomp.schedule.critical import CriticalPhase
from gossipcomp.schedule.schedule import LinkLevel, Schedule, ScheduleRefused
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION
from gossipcomp.transport.throttled import LinkRates, RateChange

RING4 = build_topology("ring", n=4)
LADDER = LevelCosts({1: 1_000, 2: 2_000, 4: 4_000, 8: 8_000, 16: 16_000}, exchanges_per_round=1)


def test_the_ladder_runs_in_powers_of_two_up_to_no_compression():
    assert rank_ladder(1) == (1,)
    assert rank_ladder(64) == (1, 2, 4, 8, 16, 32, 64)
    assert rank_ladder(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    with pytest.raises(ValueError, match="largest useful rank"):
        rank_ladder(0)


def test_a_very_high_budget_picks_no_compression_and_a_very_low_one_the_lowest_level():
    controller = RateController(LADDER)
    link = LinkCost(0.001, 1e-6)
    assert controller.choose(None, link, budget_s=1e6) == 16
    assert controller.choose(None, link, budget_s=1e-9) == 1
    assert controller.choose(4, link, budget_s=1e6) == 8  # up one step at a time
    assert controller.choose(8, link, budget_s=1e-9) == 1


def test_levels_do_not_flap_inside_the_dead_band_and_need_repeated_proposals():
    controller = RateController(LADDER, raise_after=3, lower_after=2)
    budget = 0.01
    # 1e-6 s/byte: level 8 takes 8 ms (fits), level 16 takes 16 ms (does not)
    sends = {(0, 1): [[(1_000, 0.001), (8_000, 0.008)]]}
    assert controller.update({}, sends, budget) == {(0, 1): 8}
    # level 4 at 4 ms: 8 would take 8 ms, beyond 0.6 x budget: stays (dead band)
    assert controller.update({(0, 1): 4}, sends, budget) == {(0, 1): 4}
    faster = {(0, 1): [[(1_000, 0.0002), (8_000, 0.0016)]]}  # 5x faster: 16 fits in 0.6 x
    assert controller.update({(0, 1): 4}, faster, budget) == {(0, 1): 4}
    assert controller.update({(0, 1): 4}, faster, budget) == {(0, 1): 4}
    assert controller.update({(0, 1): 4}, faster, budget) == {(0, 1): 8}  # third time, one step
    # a little too slow: lowered on the second proposal in a row
    slower = {(0, 1): [[(1_000, 0.0007), (16_000, 0.0112)]]}
    assert controller.update({(0, 1): 16}, slower, budget) == {(0, 1): 16}
    assert controller.update({(0, 1): 16}, slower, budget) == {(0, 1): 8}
    # ten times slower: far over budget, lowered at once
    crawl = {(0, 1): [[(1_000, 0.01), (8_000, 0.08)]]}
    assert controller.update({(0, 1): 8}, crawl, budget) == {(0, 1): 1}


def test_a_floor_only_link_sets_the_budget_and_counts_no_patience():
    """A link in `floor_only` (a peer deciding alone: the edge its neighbour decides, or one
    whose change still waits) is measured for the floor of the budget and nothing else: its
    slow rounds let the other link fill their time, and however often it would have been
    raised, no proposal or streak of it is kept, so when its level does change no stale
    patience decides its next step."""
    controller = RateController(LADDER, raise_after=3, lower_after=2)
    fast = [(1_000, 0.0001), (8_000, 0.0008)]  # 1e-7 s a byte
    slow = [(1_000, 0.01), (2_000, 0.02)]  # 1e-5 s a byte: level 1 takes 10 ms
    sends = {(0, 1): [slow], (0, 2): [fast]}
    level = 1
    for _ in range(3):
        chosen = controller.update({(0, 1): 1, (0, 2): level}, sends, 1e-9, floor_only={(0, 1)})
        assert chosen[(0, 1)] == 1  # never decided here
        level = chosen[(0, 2)]
    assert controller.budget_s == pytest.approx(0.01, rel=0.05)  # the slow link's floor
    assert level == 2  # the fast link rose into that time (to 3x level 1's bytes at most)
    faster = {(0, 1): [fast], (0, 2): [fast]}
    for _ in range(3):
        controller.update({(0, 1): 1, (0, 2): level}, faster, 1e-9, floor_only={(0, 1)})
    assert (0, 1) not in controller._streaks and (0, 1) not in controller._changes


def test_a_link_is_as_slow_as_its_slower_direction():
    controller = RateController(LADDER)
    fast, slow = [(1_000, 0.0001), (8_000, 0.0008)], [(1_000, 0.001), (8_000, 0.008)]
    assert controller.update({}, {(0, 1): [fast, slow]}, 0.01) == {(0, 1): 8}
    assert controller.update({}, {(0, 1): [fast]}, 0.01) == {(0, 1): 16}


def test_the_estimate_recovers_latency_and_bandwidth_from_recent_sends():
    samples = [(b, 0.002 + b * 4e-7) for b in (1_000, 5_000, 20_000, 3_000, 9_000, 12_000)]
    estimate = estimate_link(samples)
    assert estimate.latency_s == pytest.approx(0.002, rel=1e-6)
    assert estimate.seconds_per_byte == pytest.approx(4e-7, rel=1e-6)
    # only the last sends count: a link that slowed ten times is seen as slow
    slowed = samples + [(b, 0.002 + b * 4e-6) for b in (1_000, 5_000, 20_000, 3_000, 9_000, 7)]
    assert estimate_link(slowed).seconds_per_byte == pytest.approx(4e-6, rel=1e-3)
    # three slow sends after five fast ones already show: the last half of the window decides
    fast = [(b, b * 4e-7) for b in (1_000, 5_000, 20_000, 3_000, 9_000, 12_000)]
    first_slow = fast[1:] + [(b, b * 4e-6) for b in (8_000, 2_000, 4_000)]
    assert estimate_link(first_slow).seconds_per_byte > 2e-6
    # a link that sped up is believed only once the whole window is fast
    assert (
        estimate_link([(b, b * 4e-6) for b in (1_000, 7_000)] * 3 + fast[:2]).seconds_per_byte
        > 2e-6
    )
    # one size only, no latency known: the median send's seconds per byte, no latency
    assert estimate_link([(1_000, 0.01), (1_000, 0.02), (1_000, 0.2)]) == LinkCost(0.0, 2e-5)
    with pytest.raises(ValueError, match="no send"):
        estimate_link([])


def test_powergossip_with_a_rank_per_link_keeps_the_average_and_both_ends_agree():
    """Ranks 1, 4, 16 and the default on the four edges of a ring, then changed mid-run (some
    cut, some grown): the network sum of every parameter is kept, each edge's power vectors are
    identical at both ends, and what is sent over each edge has that edge's rank's size."""
    peers = build_network(RING4, mlp_models(4), lambda: PowerGossip(rank=2))
    try:
        before = [x.sum(0) for x in stacked(peers)]
        first = levels_schedule(1, 2, {(0, 1): 1, (1, 2): 4, (2, 3): 16})
        second = levels_schedule(2, 5, {(0, 1): 8, (1, 2): 2, (0, 3): 3})
        for peer in peers:
            peer.apply(first)
            peer.apply(second)
        sent: list[dict[int, dict[int, int]]] = []
        for _ in range(8):
            start = {p.rank: dict(p.stats.bytes_sent) for p in peers}
            gossip_round(peers)
            sent.append(
                {
                    p.rank: {j: n - start[p.rank].get(j, 0) for j, n in p.stats.bytes_sent.items()}
                    for p in peers
                }
            )
        assert_clean(peers)
        assert_sum_kept(before, peers, 1e-4)
        for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
            mine, theirs = peers[a].algorithm._state, peers[b].algorithm._state
            for (j, i, side), vector in mine.items():
                if j == b:
                    torch.testing.assert_close(vector, theirs[(a, i, side)], rtol=0, atol=0)
        # round 3 (first schedule): 16 > 4 > 1 in bytes; round 6 (second): link 0-1 at 8 > 2
        assert sent[3][2][3] > sent[3][1][2] > sent[3][0][1]
        assert sent[6][0][1] > sent[6][1][2]
        # both ends of an edge send alike (headers differ by a varint or two: sender ids)
        assert abs(sent[6][1][0] - sent[6][0][1]) <= 8
    finally:
        close_all(peers)


@pytest.mark.parametrize(
    ("levels", "message"),
    [
        ({(0, 1): 10_000}, r"link level for peer 1 \(a rank; .*\): expected an integer in \[1, "),
        ({(0, 2): 2}, "not an edge"),
    ],
)
def test_a_link_level_the_peer_cannot_use_is_refused_and_nothing_changes(levels, message):
    peers = build_network(RING4, mlp_models(4), lambda: PowerGossip(rank=2))
    try:
        with pytest.raises(ScheduleRefused, match=message):
            peers[0].apply(levels_schedule(1, 5, levels))
        assert peers[0].schedules.newest.epoch == 0
        gossip_round(peers)
        assert all(p.stats.failed_exchanges == {} for p in peers)
    finally:
        close_all(peers)


def test_levels_for_an_algorithm_without_them_are_refused():
    from gossipcomp.gossip import DPSGD

    peers = build_network(RING4, mlp_models(4), DPSGD)
    try:
        with pytest.raises(ScheduleRefused, match="no per-link level"):
            peers[0].apply(levels_schedule(1, 5, {(0, 1): 1}))
    finally:
        close_all(peers)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"level_costs": [cpb.LevelCost(level=1, bytes_per_round=0)]}, "bytes"),
        (
            {
                "level_costs": [
                    cpb.LevelCost(level=1, bytes_per_round=5),
                    cpb.LevelCost(level=1, bytes_per_round=6),
                ]
            },
            "twice",
        ),
        (
            {"level_costs": [cpb.LevelCost(level=i + 1, bytes_per_round=1) for i in range(65)]},
            "at most",
        ),
        ({"level_costs": [cpb.LevelCost(level=1 << 30, bytes_per_round=1)]}, "level"),
        ({"sends": [cpb.LinkSamples(neighbour=2, bytes=[1], seconds=[0.1])]}, "not a neighbour"),
        ({"sends": [cpb.LinkSamples(neighbour=1, bytes=[1], seconds=[-1.0])]}, "sends"),
    ],
)
def test_a_report_with_a_malformed_ladder_or_sends_is_refused(change, message):
    coordinator = Coordinator(RING4, adaptive=True, report_every=1)
    report = cpb.PeerReport(
        protocol_version=PROTOCOL_VERSION,
        sender=0,
        topology_hash=RING4.hash,
        model_signature="m",
        exchanges_per_round=1,
        **change,
    )
    with pytest.raises(ReportRefused, match=message) as refused:
        coordinator.check(report)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_link_changes_are_parsed_and_bad_ones_named():
    rates = LinkRates(100, [RateChange.parse("0-1:10@30"), RateChange.parse("1-0:50@60")])
    assert rates.bytes_per_second(1, 0, 29) == pytest.approx(100e6 / 8)
    assert rates.bytes_per_second(1, 0, 30) == pytest.approx(10e6 / 8)
    assert rates.bytes_per_second(0, 1, 61) == pytest.approx(50e6 / 8)
    assert rates.bytes_per_second(1, 2, 61) == pytest.approx(100e6 / 8)
    for text in ("0-1:10", "0-1:ten@3", "0-0:10@3", "0-1:-5@3", "0-1:nan@3"):
        with pytest.raises(ValueError):
            RateChange.parse(text)


def test_a_link_that_slows_tenfold_is_lowered_within_a_few_rounds_and_raised_when_it_recovers(
    one_thread,
):
    """ring4 over the throttled transport, a coordinator choosing levels every round within
    a 60 ms budget. Link 0-1 drops from 16 to 1.6 Mbit/s at round 16 and recovers at round 40.
    Its rank falls to one whose transfers fit the slow link before the link recovers (24
    rounds later; 9-12 rounds is typical, but in about one full-suite run in three the level
    stayed at its top for 12 rounds and more with the coordinator's margin at its base: not
    yet understood, docs/benchmarks.md), and its transfers return within the budget (a level's
    cost is the mean of the two sides' rounds, which alternate: rank 4 sends 6.7 and 14.6 kB,
    34 and 73 ms at 1.6 Mbit/s, so the mean of a pair is what must fit); after the recovery it
    rises again. Both ends of every edge
    change levels at the same rounds, and no exchange fails or mismatches."""
    budget, rounds, drop, back = 0.06, 64, 16, 40
    rates = LinkRates(16, [RateChange(0, 1, 1.6, drop), RateChange(0, 1, 16, back)])
    peers = throttled_ring(RING4, mlp_models(4, hidden=256), rates, lambda: PowerGossip(rank=1))
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=budget)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    clients = [CoordinatorClient(server.address, p, None, report_every=1) for p in peers]
    slow_sends: list[float] = []  # link 0-1's last sends (two of each side) before it recovers

    def train(peer: Peer, client: CoordinatorClient) -> None:
        for _ in range(rounds):
            peer.gossip()
            client.after_round()
            if peer.rank == 0 and peer.round == back - 1:
                slow_sends.extend(s for _, s in peer.sends.samples(1)[-4:])

    try:
        run_in_threads(
            [lambda p=p, c=c: train(p, c) for p, c in zip(peers, clients, strict=True)], 120
        )
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        slow = LinkCost(0.0, 8 / 1.6e6)
        fits_slow = max(x for x in costs.levels if costs.seconds(x, slow) <= budget)
        link01 = [c for c in peers[0].stats.link_levels if c["link"] == [0, 1]]
        assert link01 == [c for c in peers[1].stats.link_levels if c["link"] == [0, 1]]
        for a, b in ((1, 2), (2, 3), (0, 3)):
            ends = [[c for c in peers[r].stats.link_levels if c["link"] == [a, b]] for r in (a, b)]
            assert ends[0] == ends[1]
        level = link_level_by_round(peers[0], (0, 1), rounds)
        assert level[drop - 1] > fits_slow, (level, fits_slow)  # it was above what slow allows
        lowered = [r for r in range(drop, back) if level[r] <= fits_slow]
        trace = f"levels by round {sorted(level.items())}, fits the slow link: <= {fits_slow}"
        assert lowered, trace  # lowered while the link was slow
        assert level[rounds] > level[back - 1], level  # raised again after the recovery
        # the slow link's rounds fit the budget again before it recovers: the mean of its last
        # two rounds of each side, with room for a loaded machine's scheduling delays
        assert len(slow_sends) == 4, slow_sends
        assert sum(slow_sends) / 4 <= 1.25 * budget, (slow_sends, trace)
        assert_clean(peers)
    finally:
        stop_all(clients, server, peers)


def test_a_layer_whose_gradient_norm_changes_by_half_marks_a_critical_phase():
    phase = CriticalPhase(window=3)
    for _ in range(6):
        phase.observe([1.0, 2.0])
    assert not phase.critical  # two windows alike
    for _ in range(3):
        phase.observe([1.0, 1.2])  # the second layer fell by 40%: not yet critical
    assert not phase.critical
    for _ in range(3):
        phase.observe([1.6, 1.2])  # the first rose by 60%
    assert phase.critical
    for _ in range(3):
        phase.observe([1.6, 1.2])
    assert not phase.critical  # settled again
    with pytest.raises(ValueError, match="expected 2 layer norms"):
        phase.observe([1.0])


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        ({"window": 0}, r"^window: expected an integer in \[1, 1000000\], got 0$"),
        ({"window": True}, r"^window: .*, got True$"),
        ({"threshold": 0.0}, r"^threshold: expected a finite number in \(0, inf\), got 0.0$"),
        ({"threshold": float("inf")}, r"^threshold: .*, got inf$"),
    ],
)
def test_a_critical_phase_detector_refuses_bounds_out_of_range(bounds, expected):
    with pytest.raises(ValueError, match=expected):
        CriticalPhase(**bounds)


def _report(sender: int, critical: bool) -> cpb.PeerReport:
    """A ring4 peer's report at round 4 (helpers.ladder_report: level 8 fits a 10 ms budget)."""
    return ladder_report(RING4, sender, critical=critical)


def test_a_hold_publishes_the_lowest_level_until_its_round_then_rises_step_by_step(caplog):
    """`hold_lowest_until`: decisions before that round publish every link at the ladder's
    lowest level (said in the decision's line), a critical peer's too (no boost while held).
    Without the hold the first decision puts every link at level 8 (what fits the 10 ms budget
    here: the test below); with it the controller proposes nothing above the lowest level,
    so from the hold's round each link rises one rung at a time, each after its repeated
    proposals, three decisions a rung (2 at round 10, 4 at 13; a boosted one a rung above from
    the hold's end), never
    straight to a level its sends never tried."""
    coordinator = Coordinator(
        RING4, report_every=1, adaptive=True, round_budget=0.01, boost=True, hold_lowest_until=7
    )
    published = {}
    with caplog.at_level(logging.INFO, logger="gossipcomp.coordinator.levels"):
        for round in range(4, 14):
            for rank in range(4):
                report = _report(rank, critical=rank == 2)
                report.round = round
                coordinator.receive(report)
            published[round] = coordinator.published[-1]
    levels = {r: {(x.low, x.high): x.level for x in s.links} for r, s in published.items()}
    lowest = dict.fromkeys([(0, 1), (0, 3), (1, 2), (2, 3)], LADDER.levels[0])
    assert levels[4] == levels[5] == levels[6] == lowest
    assert published[4] is published[6]  # the held levels, published once
    assert levels[7] == levels[9] == {(0, 1): 1, (0, 3): 1, (1, 2): 2, (2, 3): 2}  # boosted
    assert levels[10] == levels[12] == {(0, 1): 2, (0, 3): 2, (1, 2): 4, (2, 3): 4}
    assert levels[13] == {(0, 1): 4, (0, 3): 4, (1, 2): 8, (2, 3): 8}
    lines = [r.getMessage() for r in caplog.records if r.name == "gossipcomp.coordinator.levels"]
    assert "held at the lowest level until round 7" in lines[0]
    assert not any("held" in line for line in lines[1:]), lines


def test_without_a_hold_the_first_decision_takes_the_level_that_fits():
    """The contrast of the test above: the same reports without a hold give level 8 at once."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    for rank in range(4):
        coordinator.receive(_report(rank, critical=False))
    assert {x.level for x in coordinator.published[-1].links} == {8}


@pytest.mark.parametrize("hold", [-1, 2**53, True, 1.5])
def test_a_hold_round_out_of_range_is_refused(hold):
    with pytest.raises(ValueError, match="hold_lowest_until"):
        Coordinator(RING4, report_every=1, adaptive=True, hold_lowest_until=hold)


def test_a_hold_without_adaptive_levels_is_refused():
    with pytest.raises(ValueError, match="hold_lowest_until 5: expected adaptive=True"):
        Coordinator(RING4, report_every=1, hold_lowest_until=5)


@pytest.mark.parametrize("boost", [False, True])
def test_boost_raises_the_links_of_a_critical_peer_one_level(boost):
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01, boost=boost)
    for rank in range(4):
        coordinator.receive(_report(rank, critical=rank == 2))
    levels = {(x.low, x.high): x.level for x in coordinator.published[-1].links}
    boosted = 16 if boost else 8
    assert levels == {(0, 1): 8, (0, 3): 8, (1, 2): boosted, (2, 3): boosted}


def test_each_change_of_levels_is_logged_with_its_budget_floor_and_estimates(caplog):
    """What a level change was decided on, one line: the round, the budget (10 ms given) and
    its floor (the slowest link at the lowest level: 1 ms at 1 us per byte), each link's
    level and settled estimate. Nothing is logged while the levels stay."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    with caplog.at_level(logging.INFO, logger="gossipcomp.coordinator.levels"):
        for rank in range(4):
            coordinator.receive(_report(rank, critical=False))
        for rank in range(4):  # the same sends again: the same levels
            again = _report(rank, critical=False)
            again.round = 6
            coordinator.receive(again)
    lines = [r.getMessage() for r in caplog.records if r.name == "gossipcomp.coordinator.levels"]
    assert len(lines) == 1, lines
    assert "at round 4: budget 10.0 ms (floor 1.0 ms" in lines[0]
    for link in ("0-1", "1-2", "2-3", "0-3"):
        assert f"{link} level 8 (0.0 ms + 1000 ns/B)" in lines[0]


def test_the_coordinator_decides_again_once_the_furthest_round_moved_report_every_on():
    """Reports every 2 rounds: levels decided at round 4 are decided again as soon as a report
    of round 6 comes (peer 0's links, slowed tenfold, are lowered then), not at round 8."""
    coordinator = Coordinator(RING4, report_every=2, adaptive=True, round_budget=0.01)
    for rank in range(4):
        coordinator.receive(_report(rank, critical=False))
    assert {x.level for x in coordinator.published[-1].links} == {8}
    slower = _report(0, critical=False)
    slower.round = 6
    for samples in slower.sends:
        samples.seconds[:] = [10 * s for s in samples.seconds]
    coordinator.receive(slower)
    levels = {(x.low, x.high): x.level for x in coordinator.published[-1].links}
    assert levels == {(0, 1): 1, (0, 3): 1, (1, 2): 8, (2, 3): 8}


def test_the_coordinator_decides_levels_only_past_the_start_up_rounds():
    """Start-up sends (handshakes, first rounds) are slow: no level is set until every peer
    has reported from round FIRST_DECISION_ROUND on."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    for rank in range(4):
        early = _report(rank, critical=False)
        early.round = FIRST_DECISION_ROUND - 1
        coordinator.receive(early)
    assert not any(schedule.links for schedule in coordinator.published)
    for rank in range(3):
        coordinator.receive(_report(rank, critical=False))
        assert not any(schedule.links for schedule in coordinator.published)  # peer 3 is not
    coordinator.receive(_report(3, critical=False))
    assert {x.level for x in coordinator.published[-1].links} == {8}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"budget_s": float("nan")}, "budget_s"),
        ({"budget_s": -1.0}, "budget_s"),
        ({"links": (LinkLevel(1, 2, 1), LinkLevel(0, 1, 1))}, "sorted"),
        ({"links": (LinkLevel(0, 1, 1), LinkLevel(0, 1, 2))}, "at most once"),
    ],
)
def test_schedule_links_and_budget_out_of_range_are_refused(values, message):
    with pytest.raises(ScheduleRefused, match=message):
        Schedule(1, 5, **values)


@pytest.mark.parametrize(
    ("low", "high", "level", "message"),
    [
        (1, 1, 2, "lower rank first"),
        (2, 1, 2, "lower rank first"),
        (0, 1, 0, "level 0"),
        (0, 1, 1 << 21, "level"),
        (-1, 1, 1, "low"),
    ],
)
def test_a_link_level_out_of_range_is_refused(low, high, level, message):
    with pytest.raises(ScheduleRefused, match=message):
        LinkLevel(low, high, level)


def test_link_levels_survive_the_schedule_dict_and_older_dicts_without_them_load():
    schedule = levels_schedule(3, 9, {(0, 1): 4, (2, 3): 1})
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    old = {"epoch": 1, "effective_round": 2, "planner": "single", "groups": []}
    assert Schedule.from_dict(old).links == ()
    with pytest.raises(ScheduleRefused, match=r"\[low, high, level\]"):
        Schedule.from_dict({**old, "links": [[0, 1]]})


def test_the_command_line_hold_reaches_the_coordinator():
    """`gossipcomp coordinator --adaptive --hold-lowest-until 9` builds a coordinator that
    holds until round 9 (the flag is not parsed and dropped)."""
    args = build_parser("coordinator").parse_args(
        ["coordinator", "--topology", "ring4", "--adaptive", "--hold-lowest-until", "9"]
    )
    assert make_coordinator(args, RING4).hold_lowest_until == 9
