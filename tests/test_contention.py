"""Communication that shares the backward's core (CostModel.contention): the finish-time rule,
the planners' optima under it (checked against every partition), and its estimate from the
calibration probes (allreduce/calibrate.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from gossipcomp.allreduce.calibrate import Calibration, ProbeStep, contention_of, in_step_costs
from gossipcomp.schedule import (
    CompressorCost,
    CostModel,
    TensorGroup,
    TensorInfo,
    make_planner,
    predict_iteration,
    random_instance,
)
from gossipcomp.schedule.costs import MAX_CONTENTION, overlapped_finish

SPECS = ["identity", "fp16", "sign"]


def test_overlapped_communication_runs_slower_until_the_backward_ends_and_keeps_its_work():
    backward_end = 10.0
    assert overlapped_finish(2.0, 3.0, backward_end, 0.0) == 5.0
    assert overlapped_finish(12.0, 3.0, backward_end, 1.0) == 15.0  # after the backward
    assert float(overlapped_finish(2.0, 3.0, backward_end, 1.0)) == 8.0  # inside: twice as long
    crossing = float(overlapped_finish(6.0, 3.0, backward_end, 1.0))
    # 4 s beside the backward do 2 s of work, the last 1 s after it at full speed
    assert crossing == pytest.approx(11.0)
    starts = np.linspace(0.0, 14.0, 281)
    for contention in (0.25, 1.0, MAX_CONTENTION):
        finish = np.asarray(overlapped_finish(starts, 3.0, backward_end, contention))
        assert np.all(np.diff(finish) >= -1e-12)  # never earlier for a later start
        assert np.all(finish >= starts + 3.0 - 1e-12)  # never faster than alone
        inside = starts < backward_end
        work = np.where(  # the seconds of work done: slowed before the end, full speed after
            inside,
            (np.minimum(finish, backward_end) - starts) / (1 + contention)
            + np.maximum(0.0, finish - backward_end),
            finish - starts,
        )
        assert np.allclose(work, 3.0)


def test_a_cost_model_refuses_a_contention_out_of_range() -> None:
    _, costs = random_instance(np.random.default_rng(0), 3, "allreduce", ["sign"])
    for bad in (-0.1, MAX_CONTENTION + 1, float("nan")):
        with pytest.raises(ValueError, match="contention"):
            replace(costs, contention=bad)
    _, gossip = random_instance(np.random.default_rng(0), 3, "gossip", ["sign"])
    with pytest.raises(ValueError, match="only all-reduce overlaps"):
        replace(gossip, contention=0.5)


def _best_over_every_partition(
    tensors: list[TensorInfo], costs: CostModel, specs: list[str]
) -> float:
    """The least predicted time over every contiguous partition and every spec per group."""
    n = len(tensors)
    best = float("inf")
    for mask in range(1 << (n - 1)):
        cuts = [0, *(k + 1 for k in range(n - 1) if mask >> k & 1), n]
        names = [tuple(t.name for t in tensors[a:b]) for a, b in itertools.pairwise(cuts)]
        for chosen in itertools.product(specs, repeat=len(names)):
            plan = [TensorGroup(g, s) for g, s in zip(names, chosen, strict=True)]
            best = min(best, predict_iteration(tensors, plan, costs))
    return best


@pytest.mark.parametrize("contention", [0.5, 2.0])
def test_mergecomp_and_strategy_stay_optimal_when_communication_shares_the_core(contention):
    """The dynamic programme is exact under the contended timeline too (its finish time never
    decreases with the start): mergecomp's plan is the best of all partitions, and strategy's
    (after its fidelity stage) is the best of all partitions and compressors."""
    rng = np.random.default_rng(7)
    for _ in range(12):
        n = int(rng.integers(1, 6))
        tensors, costs = random_instance(rng, n, "allreduce", SPECS)
        costs = replace(costs, contention=contention)
        merged = make_planner("mergecomp").plan(tensors, costs, "sign")
        optimum = _best_over_every_partition(tensors, costs, ["sign"])
        assert predict_iteration(tensors, merged, costs) == pytest.approx(optimum, rel=1e-9)
        chosen = make_planner("strategy:candidates=identity|fp16|user").plan(tensors, costs, "sign")
        optimum = _best_over_every_partition(tensors, costs, SPECS)
        assert predict_iteration(tensors, chosen, costs) == pytest.approx(optimum, rel=1e-9)


def test_contention_prices_overlap_higher_and_leaves_one_group_alone() -> None:
    """Communication that starts after the backward (one group) costs the same with or
    without contention; a plan that overlaps costs more, never less, as contention grows."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        tensors, costs = random_instance(rng, 8, "allreduce", ["sign"])
        single = [TensorGroup(tuple(t.name for t in tensors), "sign")]
        per_tensor = [TensorGroup((t.name,), "sign") for t in tensors]
        times = []
        for contention in (0.0, 0.5, 1.0, 3.0):
            contended = replace(costs, contention=contention)
            assert predict_iteration(tensors, single, contended) == pytest.approx(
                predict_iteration(tensors, single, costs)
            )
            times.append(predict_iteration(tensors, per_tensor, contended))
        assert times == sorted(times)


def _steps(slowdown: float, overlapped: float, probe_steps: int = 3) -> list[ProbeStep]:
    """Probe steps of a 40 ms backward: per-tensor ones `slowdown` s longer, their groups busy
    `overlapped` s of it plus 50 ms after it (the wait)."""
    steps = []
    for _ in range(probe_steps):
        backward = 0.040 + slowdown
        groups = ((1000, overlapped / 2), (1000, overlapped / 2 + 0.050))
        steps.append(
            ProbeStep("per-tensor", 0.01, backward, (0.0,), groups, 0.01 + backward + 0.05)
        )
        steps.append(ProbeStep("single", 0.01, 0.040, (0.0,), ((2000, 0.09),), 0.14))
    return steps


def test_contention_is_the_backward_slowdown_over_the_communication_beside_it() -> None:
    assert contention_of(_steps(0.010, 0.020)) == pytest.approx(0.5)
    assert contention_of(_steps(0.0, 0.040)) == 0.0  # a core to spare: no slowdown
    assert contention_of(_steps(-0.002, 0.040)) == 0.0  # faster beside it: noise, not a gain
    assert contention_of(_steps(0.5, 0.001)) == MAX_CONTENTION  # bounded
    with pytest.raises(ValueError, match="both probes"):
        contention_of([s for s in _steps(0.01, 0.02) if s.probe == "single"])


def test_a_calibration_carries_its_contention_into_the_cost_model() -> None:
    steps = tuple(_steps(0.010, 0.020))
    tensors = (TensorInfo("w", 2000, 0.0),)
    calibration = Calibration("sign", tensors, 0.040, 0.01, steps, contention_of(steps))
    costs = in_step_costs(calibration, {"sign": CompressorCost(0.0, 0.0)})
    assert costs.contention == pytest.approx(0.5)
