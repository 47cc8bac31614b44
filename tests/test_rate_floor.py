"""The rate controller's budget on a network slower than compute (levels/rate.py
`round_budget`): a round waits for its slowest link, so the budget is at least what that link
takes at the lowest level, and faster links rise to what fits beside it instead of all sinking
to the lowest level (what a budget of a few ms of compute did on links of a few Mbit/s)."""

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


def test_faster_links_fill_the_time_the_slowest_link_takes_at_the_lowest_level() -> None:
    slow, fast = (0, 1), (1, 2)
    sends = {slow: _sends(10 * KB, 250 * KB), fast: _sends(10 * KB, 4000 * KB)}
    controller = RateController(COSTS)
    chosen = controller.update({}, sends, COMPUTE_S)
    # the slow link's lowest level takes 40 ms: no round is shorter, so the budget is 40 ms,
    # the slow link stays at the lowest level and the fast one carries 160 KB in those 40 ms
    assert controller.budget_s == pytest.approx(0.040)
    assert chosen == {slow: 1, fast: 16}


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
