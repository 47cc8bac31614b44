"""The rate controller's budget on a network slower than compute (levels/rate.py
`round_budget`): a round waits for its slowest link, so the budget is at least what that link
takes at the lowest level (as measured where it is there), and faster links rise beside it
instead of all sinking to the lowest level (what a budget of a few ms of compute did on links
of a few Mbit/s), up to a ceiling: no more than `drop_at` times the lowest level's bytes, so a
link the slow link's speed moves onto costs at most `drop_at` budgets a round until it drops."""

from __future__ import annotations

import pytest

from gossipcomp.levels.rate import LevelCosts, RateController

KB = 1000
COSTS = LevelCosts({1: 10 * KB, 2: 20 * KB, 4: 40 * KB, 8: 80 * KB, 16: 160 * KB}, 1)
COMPUTE_S = 0.005  # a round's compute: the default budget


def _sends(nbytes: int, bytes_per_s: float) -> list[list[tuple[int, float]]]:
    """Both directions of a link: 8 sends of `nbytes`, each taking nbytes / bytes_per_s."""
    one = [(nbytes, nbytes / bytes_per_s)] * 8
    return [one, list(one)]


def test_faster_links_rise_beside_the_slowest_link_up_to_the_ceiling() -> None:
    slow, fast = (0, 1), (1, 2)
    sends = {slow: _sends(10 * KB, 250 * KB), fast: _sends(10 * KB, 4000 * KB)}
    controller = RateController(COSTS)
    chosen = controller.update({}, sends, COMPUTE_S)
    # the slow link's lowest level takes 40 ms: no round is shorter, so the budget is 40 ms and
    # the slow link stays at the lowest level. The fast one could carry 160 KB in those 40 ms,
    # but were the slow link's speed to move onto it, 160 KB would take 16 budgets a round
    # until its drop: it rises to the highest level within drop_at x 10 KB (30 KB: level 2)
    assert controller.budget_s == pytest.approx(0.040)
    assert controller.floor_link == slow
    assert controller.ceiling_bytes == pytest.approx(controller.drop_at * 10 * KB)
    assert chosen == {slow: 1, fast: 2}
    # and it does not go past the ceiling later either, however often it is asked
    for _ in range(12):
        chosen = controller.update(chosen, sends, COMPUTE_S)
    assert chosen == {slow: 1, fast: 2}
    # what it carries would take at most drop_at budgets at the slow link's speed
    assert COSTS.bytes_per_round[chosen[fast]] / (250 * KB) <= controller.drop_at * 0.040


def test_the_floor_of_a_link_at_the_lowest_level_is_its_round_as_measured() -> None:
    """A 250 KB/s link behind a token bucket that lets the smaller of a round's two payloads
    through at once (PowerGossip's right and left steps, 6 and 14 KB: 10 KB a round at the
    lowest level): the latency and bytes fitted through the two sizes put the lowest level at
    a few ms, and the other links rose on that budget (docs/benchmarks.md, e9). The floor is
    now what its rounds took: the median of its last sends."""
    slow, fast = (0, 1), (1, 2)
    bucketed = [(6 * KB, 0.004), (14 * KB, 14 * KB / (250 * KB))] * 4
    sends = {slow: [bucketed, list(bucketed)], fast: _sends(10 * KB, 4000 * KB)}
    controller = RateController(COSTS)
    controller.update({}, sends, COMPUTE_S)  # no level yet: nothing measured at one
    assert controller.floor_s < 0.015  # the model's lowest level: the bucket's quick half
    levels = {slow: 1, fast: 1}
    levels = controller.update(levels, sends, COMPUTE_S)
    assert controller.floor_s == pytest.approx((0.004 + 0.056) / 2)
    assert controller.budget_s == pytest.approx(0.030)
    # the slow link holds the lowest level: the model prices its level 2 at 13 ms, under 0.6 x
    # the 30 ms its own measured round set, but every round waits for it (it rose to level 2
    # after three decisions, and the model's floor then dropped it back)
    for _ in range(8):
        levels = controller.update(levels, sends, COMPUTE_S)
        assert levels[slow] == 1 and controller.floor_link == slow


def test_the_floor_follows_a_slow_link_that_sped_up_within_three_sends() -> None:
    """The slow link at the lowest level went from 250 to 4000 KB/s three sends ago: the
    lower median of its window (5 of 8 sends slow) still put the floor at 40 ms, and that
    budget let a link that slowed in its place keep its level; the median of its last half
    window (3 of 4 fast) puts the floor where the link is now."""
    was_slow, fast = (0, 1), (1, 2)
    window = [(10 * KB, 0.040)] * 5 + [(10 * KB, 0.0025)] * 3
    sends = {was_slow: [window, list(window)], fast: _sends(10 * KB, 4000 * KB)}
    controller = RateController(COSTS)
    controller.update({was_slow: 1, fast: 2}, sends, COMPUTE_S)
    assert controller.floor_s == pytest.approx(0.0025)
    assert controller.budget_s == COMPUTE_S
    assert controller.ceiling_bytes is None  # compute sets the budget: no ceiling


def test_links_that_fit_the_compute_budget_keep_it() -> None:
    fast, faster = (0, 1), (1, 2)
    sends = {fast: _sends(10 * KB, 4000 * KB), faster: _sends(10 * KB, 40_000 * KB)}
    controller = RateController(COSTS)
    chosen = controller.update({}, sends, COMPUTE_S)
    assert controller.budget_s == COMPUTE_S  # 2.5 ms at the lowest level: under the budget
    assert chosen == {fast: 2, faster: 16}  # 5 ms and 4 ms: what fits the compute time


def test_the_budget_follows_the_slowest_link_as_it_moves() -> None:
    a, b = (0, 1), (1, 2)
    controller = RateController(COSTS)
    controller.update({}, {a: _sends(10 * KB, 250 * KB), b: _sends(10 * KB, 4000 * KB)}, 0.005)
    assert controller.budget_s == pytest.approx(0.040)
    controller.update({}, {a: _sends(10 * KB, 4000 * KB), b: _sends(10 * KB, 500 * KB)}, 0.005)
    assert controller.budget_s == pytest.approx(0.020)  # b now the slowest, at twice a's rate


def test_a_link_the_slowest_speed_moved_onto_keeps_the_floor_while_above_the_lowest() -> None:
    """The slowest speed moved from `was_slow` (at the lowest level, now measured fast) onto
    `now_slow`, still at level 4 behind a token bucket that lets the smaller of a round's two
    payloads through at once: the model fitted through its two sizes prices the lowest level
    at a few ms, and the budget fell to the compute time, dropping the fast link with it
    (docs/benchmarks.md, run 11). Its rounds as measured, scaled to the lowest level's bytes,
    keep the floor where it is; the fast link keeps its level and the slow one goes down."""
    costs = LevelCosts({1: 10 * KB, 2: 20 * KB, 4: 40 * KB, 8: 80 * KB}, 2)  # two sends a round
    was_slow, now_slow, fast = (0, 1), (1, 2), (2, 3)
    sped_up = [(5 * KB, 0.040)] * 5 + [(5 * KB, 0.00125)] * 3
    bucketed = [(12 * KB, 0.004), (28 * KB, 0.112)] * 4  # 250 KB/s past the bucket's burst
    quick = [(20 * KB, 0.005)] * 8
    sends = {was_slow: [sped_up] * 2, now_slow: [bucketed] * 2, fast: [quick] * 2}
    levels = {was_slow: 1, now_slow: 4, fast: 4}
    controller = RateController(costs)
    chosen = controller.update(levels, sends, COMPUTE_S)
    measured = controller.measured_above[now_slow]
    assert measured == pytest.approx(2 * (0.004 + 0.112) / 2)  # two sends a round, the median
    assert costs.seconds(1, controller.estimated[now_slow]) < COMPUTE_S  # the model: fast
    assert controller.floor_link == now_slow
    assert controller.budget_s == pytest.approx(measured / 4)  # 10 KB of its 40 KB a round
    assert chosen[fast] == 4  # 10 ms a round at level 4: within the 29 ms floor
    chosen = controller.update(chosen, sends, COMPUTE_S)
    assert chosen == {was_slow: 1, now_slow: 1, fast: 4}
