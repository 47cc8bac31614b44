"""Planning merged all-reduce groups on measured costs (gossipcomp.allreduce.merged): the
backward is timed after a warm-up, every compressor a planner may choose is priced, and the
plan carries the step time its cost model predicts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from gossipcomp.allreduce import Communicator, spawn
from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.merged import Plan, make_plan, measure_backward
from gossipcomp.schedule import check_cover, make_planner
from gossipcomp.schedule.planners import planner_specs
from gossipcomp.workload.models import build_resmlp


def _backward(model: torch.nn.Module) -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)

    def run() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    return run


def test_measure_backward_leaves_out_the_first_pass_and_keeps_backward_order() -> None:
    model = build_resmlp(0, depth=4)
    passes = []
    run = _backward(model)

    def counted() -> None:
        passes.append(1)
        run()

    tensors, compute_s = measure_backward(model, counted, repeats=3)
    assert len(passes) == 4  # one untimed warm-up, then the timed ones
    for repeats in (0, True, 2.0, 1001):
        with pytest.raises(
            ValueError, match=r"^measure_backward: repeats: expected an integer in "
        ):
            measure_backward(model, counted, repeats=repeats)
    assert len(passes) == 4  # refused before any pass
    assert [t.name for t in tensors] == [n for n, _ in model.named_parameters()]
    ready = [t.ready_at for t in tensors]
    assert all(a >= b for a, b in zip(ready, ready[1:], strict=False))  # last layer first
    assert 0 < ready[0] <= compute_s * 1.5


def test_strategy_is_priced_for_every_candidate() -> None:
    strategy = make_planner("strategy:candidates=identity|fp16|user")
    assert planner_specs(strategy, "sign") == ("identity", "fp16", "sign")
    assert planner_specs(make_planner("mergecomp"), "sign") == ("sign",)


def _plan_worker(session: Session, planner: str) -> Plan:
    model = build_resmlp(0, depth=6)
    tensors, compute_s = measure_backward(model, _backward(model), repeats=2)
    comm = Communicator()
    try:
        return make_plan(planner, tensors, "sign", comm, compute_s)
    finally:
        comm.close()


def test_strategy_plans_on_gloo_with_a_prediction_instead_of_falling_back() -> None:
    """Before: the cost model priced only the user's compressor, so strategy (which weighs
    identity and fp16 too) could not plan and fell back to groups of 1 MiB, predicting nothing."""
    plans = spawn(_plan_worker, 2, ("strategy",), timeout_s=30, deadline_s=120)
    assert plans[0] == plans[1]
    plan = plans[0]
    names = [n for n, _ in build_resmlp(0, depth=6).named_parameters()]
    check_cover(plan.groups, names)
    assert plan.predicted_s > 0
    assert {g.compressor for g in plan.groups} <= {"identity", "fp16", "sign"}
