"""Tests for schedule/planners.py and bruteforce.py: optimality against exhaustive search,
decision time, the extremes, MG-WFBP's rule on timelines worked out by hand, the measured
MergeComp search, and errors on bad specs and inputs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gossipcomp.schedule import (
    PLANNERS,
    CompressorCost,
    CostModel,
    LinkCost,
    MergeComp,
    TensorGroup,
    TensorInfo,
    brute_force,
    check_cover,
    make_planner,
    predict_iteration,
    random_instance,
)
from gossipcomp.schedule.planners import measured_search

CANDIDATES = ["identity", "fp16", "sign"]
STRATEGY = "strategy:candidates=identity|fp16|user"
MODES = ("gossip", "allreduce")


def _gap(tensors: list[TensorInfo], costs: CostModel, planner: str, candidates: list[str]) -> float:
    plan = make_planner(planner).plan(tensors, costs, "sign")
    check_cover(plan, [t.name for t in tensors])
    optimum = brute_force(tensors, costs, candidates)
    gap = predict_iteration(tensors, plan, costs) / optimum.seconds - 1
    assert gap >= -1e-9, "brute force missed a better plan"
    return gap


@pytest.mark.parametrize("mode", MODES)
def test_mergecomp_and_strategy_are_within_5_percent_of_brute_force(mode: str) -> None:
    rng = np.random.default_rng(12)
    worst = {"mergecomp": 0.0, "strategy": 0.0}
    for _ in range(40):
        tensors, costs = random_instance(rng, int(rng.integers(1, 9)), mode, CANDIDATES)  # type: ignore[arg-type]
        worst["mergecomp"] = max(worst["mergecomp"], _gap(tensors, costs, "mergecomp", ["sign"]))
        worst["strategy"] = max(worst["strategy"], _gap(tensors, costs, STRATEGY, CANDIDATES))
    assert worst["mergecomp"] <= 0.05 and worst["strategy"] <= 0.05, worst


def test_brute_force_prices_plans_as_predict_iteration_does() -> None:
    rng = np.random.default_rng(3)
    for mode in MODES:
        for _ in range(10):
            tensors, costs = random_instance(rng, 6, mode, CANDIDATES)  # type: ignore[arg-type]
            optimum = brute_force(tensors, costs, CANDIDATES)
            assert optimum.plans_tried == 3 * 4**5  # sum over partitions of 3^groups
            predicted = predict_iteration(tensors, optimum.groups, costs)
            assert predicted == pytest.approx(optimum.seconds, rel=1e-12)
            for name in ("per-tensor", "single", "mgwfbp"):  # never better than the optimum
                plan = make_planner(name).plan(tensors, costs, "sign")
                assert predict_iteration(tensors, plan, costs) >= optimum.seconds * (1 - 1e-12)


@pytest.mark.parametrize("tensors", [0, True, 3.0, 100_001])
def test_a_random_instance_of_a_size_out_of_range_is_refused(tensors) -> None:
    expected = r"^random_instance: tensors: expected an integer in \[1, 100000\], got "
    with pytest.raises(ValueError, match=expected):
        random_instance(np.random.default_rng(0), tensors, "gossip", CANDIDATES)


def test_brute_force_refuses_instances_too_large_to_enumerate() -> None:
    tensors, costs = random_instance(np.random.default_rng(0), 13, "gossip", CANDIDATES)
    with pytest.raises(ValueError, match="expected 1 to 12"):
        brute_force(tensors, costs, CANDIDATES)
    with pytest.raises(ValueError, match="no candidate"):
        brute_force(tensors[:3], costs, [])


@pytest.mark.parametrize("mode", MODES)
def test_every_planner_decides_for_200_tensors_within_100_ms(mode: str) -> None:
    # CPU time of this thread, best of three: what a decision costs, whatever else the shared
    # machine runs meanwhile
    tensors, costs = random_instance(np.random.default_rng(5), 200, mode, CANDIDATES)  # type: ignore[arg-type]
    for name in PLANNERS:
        planner = make_planner(name)
        times = []
        for _ in range(3):
            start = time.thread_time()
            plan = planner.plan(tensors, costs, "sign")
            times.append(time.thread_time() - start)
        check_cover(plan, [t.name for t in tensors])
        assert min(times) < 0.1, (name, times)


def _uniform_costs(mode: str, latency: float, compute_s: float) -> CostModel:
    return CostModel(
        {"identity": CompressorCost(0.0, 0.0), "sign": CompressorCost(2e-4, 1e-9)},
        LinkCost(latency, 1e-9),
        compute_s,
        mode,  # type: ignore[arg-type]
    )


def test_extremes_per_tensor_and_single() -> None:
    tensors = [TensorInfo(f"t{k}", 1000 * (k + 1)) for k in range(6)]
    costs = _uniform_costs("gossip", 1e-3, 0.01)
    per_tensor = make_planner("per-tensor").plan(tensors, costs, "sign")
    single = make_planner("single").plan(tensors, costs, "sign")
    assert [g.names for g in per_tensor] == [(t.name,) for t in tensors]
    assert [g.names for g in single] == [tuple(t.name for t in tensors)]
    # gossip sends one envelope whatever the grouping, so only fixed compression costs differ:
    # merging everything is optimal, and per-tensor pays 5 extra fixed costs: 0.2 ms to
    # compress and a 4-byte scale on the wire (1e-9 s/B)
    assert make_planner("mergecomp").plan(tensors, costs, "sign") == single
    extra = predict_iteration(tensors, per_tensor, costs) - predict_iteration(
        tensors, single, costs
    )
    assert extra == pytest.approx(5 * (2e-4 + 4e-9), rel=1e-9)


def test_mergecomp_keeps_tensors_apart_when_each_transfer_hides_behind_backward() -> None:
    # gradients 10 ms apart, each transfer ~0.1 ms: sending each as soon as it is ready ends
    # communication 0.1 ms after the last one; any merge delays a transfer to a later ready time
    tensors = [TensorInfo(f"t{k}", 1000, ready_at=0.01 * (6 - k)) for k in range(6)]
    costs = _uniform_costs("allreduce", 1e-4, 0.06)
    plan = make_planner("mergecomp").plan(tensors, costs, "identity")
    assert len(plan) == 6
    assert predict_iteration(tensors, plan, costs) == pytest.approx(0.06 + 1e-4 + 4000e-9)


def _identity_costs(latency: float, per_byte: float) -> CostModel:
    return CostModel(
        {"identity": CompressorCost(0.0, 0.0)}, LinkCost(latency, per_byte), 0.1, "allreduce"
    )


def _mgwfbp(ready_ms: list[float], numel: list[int], costs: CostModel) -> list[tuple[str, ...]]:
    """Plan for tensors given in the order backward readies them (t0 first); the model holds
    them the other way round."""
    tensors = [
        TensorInfo(f"t{k}", numel[k], ready_ms[k] / 1000) for k in reversed(range(len(numel)))
    ]
    return [g.names for g in make_planner("mgwfbp").plan(tensors, costs, "identity")]


def test_mgwfbp_sends_each_gradient_alone_when_transfers_end_before_the_next_is_ready() -> None:
    # a = 0.5 ms, t_c = a + 4000 B * 1e-9 = 0.504 ms. t0: tau_c = 1, r(t1) = 11 >= 1.504: cut.
    # t1: tau_c = 11, r(t2) = 21 >= 11.504: cut.
    costs = _identity_costs(5e-4, 1e-9)
    assert _mgwfbp([1, 11, 21], [1000, 1000, 1000], costs) == [("t2",), ("t1",), ("t0",)]


def test_mgwfbp_merges_gradients_closer_than_the_latency() -> None:
    # a = 0.5 ms. t0: tau_c = 1.0, t_c = 0.504, r(t1) = 1.2 < 1.504 and 1.2 - 1.0 < a: merge.
    # {t0,t1}: tau_c = 1.2, t_c = 0.508, r(t2) = 1.4 < 1.708 and 1.4 - 1.2 < a: merge.
    costs = _identity_costs(5e-4, 1e-9)
    assert _mgwfbp([1.0, 1.2, 1.4], [1000, 1000, 1000], costs) == [("t2", "t1", "t0")]


def test_mgwfbp_merges_behind_a_busy_link_and_not_across_a_long_gap() -> None:
    # a = 0.1 ms, 1e-9 s/B, t_c(t0) = 0.1 + 3.0 = 3.1 ms. t0: tau_c = 1, r(t1) = 2 < 4.1 but
    # tau_c < r and r - tau_c = 1 >= a: cut; the link is busy until 4.1.
    # t1: tau_c = max(2, 4.1) = 4.1 > r(t2) = 2.5 and 2.5 < 4.1 + t_c: merge t2 into t1.
    costs = _identity_costs(1e-4, 1e-9)
    plan = _mgwfbp([1.0, 2.0, 2.5], [750_000, 1000, 1000], costs)
    assert plan == [("t2", "t1"), ("t0",)]


def test_strategy_compresses_only_where_communication_shows() -> None:
    tensors = [TensorInfo(f"t{k}", 200_000, ready_at=0.001 * (4 - k)) for k in range(4)]
    slow = CostModel(
        {"identity": CompressorCost(0, 0), "sign": CompressorCost(1e-4, 1e-9)},
        LinkCost(1e-4, 1e-7),  # 10 MB/s: 80 ms to send a tensor uncompressed
        0.004,
        "allreduce",
    )
    plan = make_planner("strategy:candidates=identity|sign").plan(tensors, slow, "sign")
    assert {g.compressor for g in plan} == {"sign"}
    # compute of 10 s hides even uncompressed transfers: no compression anywhere
    hidden = CostModel(slow.compressors, slow.link, 10.0, "allreduce")
    plan = make_planner("strategy:candidates=identity|sign").plan(tensors, hidden, "sign")
    assert {g.compressor for g in plan} == {"identity"}
    assert predict_iteration(tensors, plan, hidden) == 10.0


def _true_time(tensors: list[TensorInfo]) -> callable:  # type: ignore[valid-type]
    """A 'measured' step time the model does not know: 0.3 ms per group plus 1 ms for each
    group over 2500 elements (as if large buffers fell out of cache)."""
    numel = {t.name: t.numel for t in tensors}

    def measure(groups: tuple[TensorGroup, ...]) -> float:
        sizes = [sum(numel[n] for n in g.names) for g in groups]
        return 3e-4 * len(sizes) + 1e-3 * sum(size > 2500 for size in sizes)

    return measure


def test_measured_mergecomp_finds_the_measured_optimum_and_times_each_plan_once() -> None:
    tensors = [TensorInfo(f"t{k}", 1000) for k in range(8)]
    costs = _uniform_costs("gossip", 1e-3, 0.01)
    seen: list[tuple[tuple[str, ...], ...]] = []
    truth = _true_time(tensors)

    def measure(groups: tuple[TensorGroup, ...]) -> float:
        seen.append(tuple(g.names for g in groups))
        return truth(groups)

    plan = MergeComp(measure=measure, budget=200).plan(tensors, costs, "sign")
    check_cover(plan, [t.name for t in tensors])
    # the model alone would merge everything (8000 elements: 1.3 ms); the optimum measured is
    # groups of at most 2 tensors: 4 groups, 1.2 ms
    assert truth(plan) == pytest.approx(1.2e-3)
    assert len(seen) == len(set(seen))  # memoised: no plan timed twice


def test_measured_search_stays_within_its_budget_and_refuses_bad_measurements() -> None:
    calls = []

    def measure(cuts: tuple[int, ...]) -> float:
        calls.append(cuts)
        return float(len(cuts))

    best, seconds = measured_search(50, measure, [(0, 25, 50), (0, 50)], budget=7)
    assert len(calls) == 7 or (len(calls) < 7 and best == (0, 50))
    assert seconds == min(float(len(c)) for c in calls)
    with pytest.raises(ValueError, match=r"^mergecomp: a measurement \(seconds\): .*, got nan$"):
        measured_search(5, lambda cuts: float("nan"), [(0, 5)], budget=3)
    with pytest.raises(ValueError, match=r"^mergecomp: a measurement \(seconds\): .*, got True$"):
        measured_search(5, lambda cuts: True, [(0, 5)], budget=3)
    expected = r"^mergecomp: budget \(measurements\): expected an integer in \[1, 100000\], got "
    for budget in (0, True, 2.0, 100_001):
        with pytest.raises(ValueError, match=expected):
            MergeComp(measure=lambda g: 0.0, budget=budget)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("greedy", "unknown planner 'greedy'; known: mergecomp, mgwfbp, per-tensor"),
        ("mgwfbp:candidates=fp16", "only strategy takes an argument"),
        ("strategy:levels=3", "only strategy takes an argument"),
        ("strategy:candidates=", "no candidates"),
        ("strategy:candidates=fp16|bogus", "unknown compressor 'bogus'"),
        ("s" * 5000, "expected a string of at most 1000"),
    ],
)
def test_make_planner_refuses_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_planner(spec)


def test_planners_refuse_bad_inputs() -> None:
    costs = _uniform_costs("allreduce", 1e-4, 0.01)
    rising = [TensorInfo("a", 10, ready_at=0.001), TensorInfo("b", 10, ready_at=0.002)]
    for name in PLANNERS:
        with pytest.raises(ValueError, match="nothing to plan"):
            make_planner(name).plan([], costs, "sign")
        with pytest.raises(ValueError, match="ready_at not to increase"):
            make_planner(name).plan(rising, costs, "sign")
    twins = [TensorInfo("a", 10), TensorInfo("a", 20)]
    with pytest.raises(ValueError, match="tensor names repeat"):
        make_planner("single").plan(twins, costs, "sign")
    many = [TensorInfo(f"t{k}", 1) for k in range(20_001)]
    with pytest.raises(ValueError, match="20001 tensors to plan; expected at most 20000"):
        make_planner("mergecomp").plan(many, costs, "sign")
    with pytest.raises(ValueError, match="no costs for compressor 'topk:ratio=0.1'"):
        make_planner("mergecomp").plan(rising[::-1], costs, "topk:ratio=0.1")
