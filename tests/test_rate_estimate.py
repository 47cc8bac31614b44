"""The rate controller on synthetic links whose sends take a fixed time whatever their size (a
busy CPU, not bandwidth) or whose bandwidth drops tenfold: latency is told from bandwidth, a
level does not go down on time that does not grow with bytes, and a real drop still lowers it
within a few decisions and a recovery raises it again."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest

from gossipcomp.levels.rate import CALM_DECISIONS, LevelCosts, RateController, estimate_link
from gossipcomp.schedule.costs import LinkCost

# bytes per round of Choco's top-k ladder on the wide MLP (1e-4 ... 0.5, identity), one exchange
LADDER = LevelCosts(
    {
        level: nbytes
        for level, nbytes in enumerate(
            (936, 1840, 4536, 9048, 18064, 45088, 90144, 180248, 450584, 901144, 1802272),
            start=1,
        )
    },
    exchanges_per_round=1,
)
KEY = (0, 1)
BUDGET = 0.05
SENDS_PER_DECISION = 2  # decisions every two rounds, one send per round
HISTORY = 16  # sends a peer reports per neighbour


def _run(
    start: int, link: Callable[[int, int], float], decisions: int, budget: float = BUDGET
) -> list[int]:
    """The level after each decision of a controller fed the link's last HISTORY sends, the
    link carrying the level in force."""
    controller = RateController(LADDER)
    level, levels = start, []
    # the level before the first decision (one below): a link that only ever carried one size
    # cannot tell its latency from its bandwidth, and is priced as bytes only
    before = LADDER.bytes_per_round[start - 1]
    sends = [(before, link(0, before)) for _ in range(4)]
    for decision in range(decisions):
        for _ in range(SENDS_PER_DECISION):
            nbytes = LADDER.bytes_per_round[level]
            sends.append((nbytes, link(decision, nbytes)))
        level = controller.update({KEY: level}, {KEY: [sends[-HISTORY:]]}, budget)[KEY]
        levels.append(level)
    return levels


def _busy(seed: int, per_byte: float = 0.0) -> Callable[[int, int], float]:
    """20 ms plus up to 10 ms of noise whatever the size, one send in eight held up 200 ms more
    (a busy CPU, in spells when unlucky), plus `per_byte` seconds per byte."""
    rng = random.Random(seed)

    def seconds(decision: int, nbytes: int) -> float:
        spike = 0.2 if rng.random() < 1 / 8 else 0.0
        return 0.02 + rng.uniform(0.0, 0.01) + spike + nbytes * per_byte

    return seconds


def test_sends_that_take_20_ms_whatever_their_size_do_not_ratchet_the_level_down():
    """No bandwidth limit and a 50 ms budget: every level fits. Over 20 such links (120
    decisions each) the level ends at or above where it started on nearly all, at the top on
    most; the old estimate (the slowest send's seconds per byte, no latency) took all 20 to
    the lowest level. An unlucky busy spell at the start can still hold one low."""
    finals = [_run(7, _busy(seed), 120)[-1] for seed in range(20)]
    assert sum(level >= 7 for level in finals) >= 17, finals
    assert statistics.median(finals) == LADDER.levels[-1], finals


def test_a_busy_link_with_bandwidth_stays_where_its_bandwidth_puts_it():
    """The same busy sends plus 100 Mbit/s: level 7 (7 ms of bytes) fits, level 8 (14 ms) fits
    but is too close to the budget to rise to (the dead band). Over 20 links most end at 7 or
    8 (the old estimate: all 20 at the lowest level)."""
    finals = [_run(7, _busy(seed, 8e-8), 120)[-1] for seed in range(20)]
    assert sum(level >= 7 for level in finals) >= 13, finals
    assert statistics.median(finals) >= 7, finals
    assert sum(level == LADDER.levels[0] for level in finals) <= 1, finals


def test_a_tenfold_drop_lowers_the_level_within_a_few_decisions_and_recovery_raises_it():
    """5 ms latency plus 100 Mbit/s, 10 Mbit/s from decision 20 to 45: the level goes to one
    whose bytes fit the slow link within three decisions, and back up after the recovery."""
    rng = random.Random(0)

    def link(decision: int, nbytes: int) -> float:
        per_byte = 8e-7 if 20 <= decision < 45 else 8e-8
        return 0.005 + nbytes * per_byte + rng.uniform(0.0, 0.002)

    levels = _run(7, link, 80)
    fits_slow = max(x for x in LADDER.levels if LADDER.seconds(x, LinkCost(0.005, 8e-7)) <= BUDGET)
    fits_fast = max(x for x in LADDER.levels if LADDER.seconds(x, LinkCost(0.005, 8e-8)) <= BUDGET)
    assert levels[19] > fits_slow, levels
    assert all(level <= fits_slow for level in levels[23:45]), levels
    assert min(levels[23:45]) >= fits_slow - 1, levels  # not to the bottom
    assert levels[-1] >= fits_fast - 1, levels


def test_the_latency_is_what_a_much_smaller_message_also_took():
    """A link carried 90 KB in 20 ms, then 1 KB in 20 ms: the time is latency, not 20 ms per KB
    (which the old estimate read from the one size of its window)."""
    sends = [(90_000, 0.02)] * 8 + [(1_000, 0.02)] * 8
    estimate = estimate_link(sends)
    assert estimate.latency_s == pytest.approx(0.02)
    assert estimate.seconds_per_byte == pytest.approx(0.0, abs=1e-12)
    # a fitted latency: 4 ms plus 1 us per byte over sizes 8x apart, the window one size
    fitted = [(b, 0.004 + b * 1e-6) for b in (1_000, 8_000) * 4] + [(8_000, 0.012)] * 8
    assert estimate_link(fitted).latency_s == pytest.approx(0.004, rel=1e-6)
    assert estimate_link(fitted).seconds_per_byte == pytest.approx(1e-6, rel=1e-6)
    # sizes closer than SEPARABLE_SPAN (PowerGossip's two steps) separate nothing: bytes only
    close = [(10_000, 0.02), (10_300, 0.01), (10_000, 0.03), (10_300, 0.012)]
    assert estimate_link(close).latency_s == 0.0


def test_a_link_keeps_the_latency_its_earlier_sizes_showed_once_its_sends_are_one_size():
    """Once a link's reported sends are all of one size, the controller still knows the latency
    two sizes showed it before, and keeps its level."""
    controller = RateController(LADDER)
    mixed = [(90144, 0.048)] * 8 + [(45088, 0.048)] * 8
    assert controller.update({KEY: 6}, {KEY: [mixed]}, BUDGET) == {KEY: 6}
    one_size = [(45088, 0.052)] * 16  # alone: 52 ms as bytes, over the 50 ms budget
    for _ in range(4):
        assert controller.update({KEY: 6}, {KEY: [one_size]}, BUDGET) == {KEY: 6}
    fresh = RateController(LADDER)
    fresh.update({KEY: 6}, {KEY: [one_size]}, BUDGET)
    assert fresh.update({KEY: 6}, {KEY: [one_size]}, BUDGET) == {KEY: 5}


def test_a_link_slower_than_the_budget_whatever_the_size_keeps_its_level():
    """Latency over the budget and bytes nearly free: a lower level would not be faster, so the
    level does not go down (the old controller dropped to the lowest)."""
    controller = RateController(LADDER)
    assert controller.choose(7, LinkCost(0.08, 1e-9), BUDGET) == 8  # up: its bytes are free
    # bytes that matter still lower it, to the highest level whose bytes take a quarter of it
    assert controller.choose(7, LinkCost(0.08, 6e-7), BUDGET) == 5


def test_a_link_lowered_right_after_it_rose_needs_more_patience_to_rise_again():
    """Estimates that alternate between fitting the next level and not (noise) would flap a
    link every few decisions: after a raise then a drop, rising again takes twice the
    decisions, and a first decision prices every second as bytes."""
    controller = RateController(LADDER)
    fast = [(45088, 0.005)] * 8 + [(90144, 0.006)] * 8  # level 8 fits in 0.6 x budget
    slow = [(90144, 0.2)] * 16  # level 7 over 3 x budget: down at once
    assert controller.update({KEY: 6}, {KEY: [fast]}, BUDGET) == {KEY: 6}
    assert controller.update({KEY: 6}, {KEY: [fast]}, BUDGET) == {KEY: 6}
    assert controller.update({KEY: 6}, {KEY: [fast]}, BUDGET) == {KEY: 7}
    assert controller.update({KEY: 7}, {KEY: [slow]}, BUDGET)[KEY] < 7
    rises = [controller.update({KEY: 6}, {KEY: [fast]}, BUDGET)[KEY] for _ in range(6)]
    assert rises == [6, 6, 6, 6, 6, 7], rises
    # a first decision: 20 ms for 1 KB and for 90 KB (all latency, the top would fit), priced
    # as bytes at 90 KB's rate: level 8, 180 KB in 40 ms
    first = [(936, 0.02)] * 4 + [(90144, 0.02)] * 4
    assert RateController(LADDER).update({}, {KEY: [first]}, BUDGET) == {KEY: 8}


def test_the_patience_a_flap_earned_calms_down_while_the_link_holds_its_level():
    """A link lowered right after a rise because the network moved, not because the estimate
    was noise, would rise at half pace when the network moves back, a phase later: each
    `CALM_DECISIONS` decisions without a change halve the backoff again."""
    controller = RateController(LADDER)
    fast = [(45088, 0.005)] * 8 + [(90144, 0.006)] * 8  # level 8 fits in 0.6 x budget
    slow = [(90144, 0.2)] * 16
    hold = [(45088, 0.025)] * 16  # level 6 fits, level 7 (50 ms) not within 0.6 x budget
    for _ in range(3):
        controller.update({KEY: 6}, {KEY: [fast]}, BUDGET)
    assert controller.update({KEY: 7}, {KEY: [slow]}, BUDGET)[KEY] < 7  # flapped: backoff 2
    for _ in range(CALM_DECISIONS):
        assert controller.update({KEY: 6}, {KEY: [hold]}, BUDGET) == {KEY: 6}
    rises = [controller.update({KEY: 6}, {KEY: [fast]}, BUDGET)[KEY] for _ in range(3)]
    assert rises == [6, 6, 7], rises
