"""Merged all-reduce costs measured inside training steps, and the cost model planned on them.

Why: an alpha-beta fit of collectives issued back to back on an idle link prices a collective
at under 1 ms, while inside a training step on a loaded machine each costs several: the
communication thread wakes up per group, shares the cores with the backward, and compresses on
the same thread; and a step is more than its backward (batch, forward, optimizer step). A
planner on the idle fit predicted steps 2-60% short of the measured ones (docs/benchmarks.md,
issue 24).

So before a merged run plans, it trains `steps` real steps under each of two probe plans, one
group per tensor and one group of all (the first step of each left out, a warm-up), and times
in each step: every group's whole synchronisation on the communication thread (pack, compress,
collective, decode, unpack: `MergedSync(timed=True)`), every parameter's gradient ready time and
the backward, and the rest of the step (batch, forward, optimizer step). `in_step_costs` then
fits the link on the steps' totals (`fit_link_totals`: a step's communication seconds less its
compression, timed alone, = alpha * groups + beta * wire bytes), so alpha carries what one more
collective costs inside a step; `Calibration.tensors` and `compute_s` are the backward as it
runs alone (the single probe's steps, where communication starts after it), `contention` how
much slower the communication runs beside it (`contention_of`: on two ranks sharing two cores a
group's compression and copies take the backward's core; plans that overlap were predicted
16-25% short without it, docs/benchmarks.md), and `outside_s` is added to a plan's predicted
step (`predict_step`). Every rank calibrates (the probes' collectives are collective); rank 0's
plan is the one broadcast (merged.make_plan).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gossipcomp.allreduce.comm import Communicator
from gossipcomp.allreduce.merged import (
    MergedSync,
    Plan,
    agree_plan,
    compressor_cost,
    plan_specs,
    stamped_backward,
    tensor_infos,
)
from gossipcomp.allreduce.settings import MAX_CALIBRATION_STEPS
from gossipcomp.compress import parse_spec
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.schedule import (
    CompressorCost,
    CostModel,
    LinkCost,
    TensorGroup,
    TensorInfo,
    predict_iteration,
)
from gossipcomp.schedule.costs import MAX_CONTENTION, fit_link_totals

MIN_STEPS = 2  # per probe: one warm-up and at least one timed step
MAX_STEPS = MAX_CALIBRATION_STEPS
PROBES = ("per-tensor", "single")


@dataclass(frozen=True)
class StepParts:
    """One training step cut where calibration times it: `loss` takes the next batch, zeroes
    the gradients and runs the forward; `update` applies the averaged gradients."""

    loss: Callable[[], torch.Tensor]
    update: Callable[[], None]


@dataclass(frozen=True)
class ProbeStep:
    """What one calibration step measured (seconds)."""

    probe: str  # "per-tensor" or "single"
    outside_s: float  # batch, zeroing, forward and optimizer step
    backward_s: float
    stamps: tuple[float, ...]  # each parameter's gradient ready time into the backward
    groups: tuple[tuple[int, float], ...]  # (elements, seconds) of each group's sync
    step_s: float  # the whole step


@dataclass(frozen=True)
class Calibration:
    """The probes' timed steps and what a cost model takes from them (module docstring)."""

    compressor: str
    tensors: tuple[TensorInfo, ...]  # model order, ready_at measured inside the steps
    compute_s: float  # the backward inside a step (median)
    outside_s: float  # the step less backward and communication wait (median)
    steps: tuple[ProbeStep, ...]
    contention: float = 0.0  # communication's slowdown beside the backward (`contention_of`)

    def probe_step_s(self, probe: str) -> float:
        """The median measured step of `probe`."""
        return statistics.median(s.step_s for s in self.steps if s.probe == probe)


def probe_groups(model: nn.Module, compressor: str, probe: str) -> tuple[TensorGroup, ...]:
    """The groups of `probe` ("per-tensor" or "single") for `model`'s trainable parameters."""
    return probe_plan(
        tuple(n for n, p in model.named_parameters() if p.requires_grad), compressor, probe
    )


def probe_plan(names: Sequence[str], compressor: str, probe: str) -> tuple[TensorGroup, ...]:
    """The groups of `probe` ("per-tensor" or "single") for tensors `names` (model order)."""
    names = tuple(names)
    if probe == "per-tensor":
        return tuple(TensorGroup((name,), compressor) for name in names)
    if probe == "single":
        return (TensorGroup(names, compressor),)
    raise ValueError(f"calibration probe {probe!r}: expected one of {', '.join(PROBES)}")


def calibrate(
    model: nn.Module,
    parts: StepParts,
    make_sync: Callable[[tuple[TensorGroup, ...]], MergedSync],
    compressor: str,
    steps: int,
) -> Calibration:
    """Train `steps` steps under each probe plan (module docstring) and return what was timed.

    `make_sync(groups)` builds a `MergedSync` with `timed=True` on the run's communicator
    (every rank calls `calibrate` together); each is closed after its probe, its error
    memories dropped with it."""
    checked_integer(
        "calibration steps per probe (the first a warm-up)", steps, MIN_STEPS, MAX_STEPS
    )
    measured: list[ProbeStep] = []
    for probe in PROBES:
        sync = make_sync(probe_groups(model, compressor, probe))
        if sync.timings is None:
            raise ValueError("calibrate: make_sync must build MergedSync(timed=True)")
        try:
            for index in range(steps):
                step = _timed_step(model, parts, sync, probe)
                if index:
                    measured.append(step)
        finally:
            sync.close()
    alone = [s for s in measured if s.probe == "single"]  # no communication beside it
    stamps = [statistics.median(column) for column in zip(*(s.stamps for s in alone), strict=True)]
    return Calibration(
        compressor=compressor,
        tensors=tuple(tensor_infos(model, stamps)),
        compute_s=statistics.median(s.backward_s for s in alone),
        outside_s=statistics.median(s.outside_s for s in measured),
        steps=tuple(measured),
        contention=contention_of(measured),
    )


def contention_of(steps: Sequence[ProbeStep]) -> float:
    """How much slower communication runs beside the backward than alone (CostModel's
    `contention`), from the probes: the backward of a per-tensor step, with the communication
    thread busy beside it, is longer than a single-group step's by the CPU that thread took
    from it; over the seconds the thread was busy during that backward (its groups' seconds
    less the wait after the backward) that is the share it runs slower. 0 where the backward
    did not slow (a core to spare)."""
    beside = [s for s in steps if s.probe == "per-tensor"]
    alone = [s for s in steps if s.probe == "single"]
    if not beside or not alone:
        raise ValueError("contention_of: expected steps of both probes")
    slowdown = statistics.median(s.backward_s for s in beside) - statistics.median(
        s.backward_s for s in alone
    )
    overlapped = statistics.median(
        min(s.backward_s, max(0.0, sum(sec for _, sec in s.groups) - _wait_s(s))) for s in beside
    )
    if slowdown <= 0.0 or overlapped <= 0.0:
        return 0.0
    return min(MAX_CONTENTION, slowdown / overlapped)


def _wait_s(step: ProbeStep) -> float:
    """Seconds a step waited for communication after its backward."""
    return max(0.0, step.step_s - step.outside_s - step.backward_s)


def _timed_step(model: nn.Module, parts: StepParts, sync: MergedSync, probe: str) -> ProbeStep:
    assert sync.timings is not None
    sync.timings.clear()
    start = time.perf_counter()
    loss = parts.loss()
    forward_end = time.perf_counter()
    stamps, backward_s = stamped_backward(model, loss.backward)
    sync.synchronize()
    synced = time.perf_counter()
    parts.update()
    end = time.perf_counter()
    return ProbeStep(
        probe=probe,
        outside_s=(forward_end - start) + (end - synced),
        backward_s=backward_s,
        stamps=tuple(stamps),
        groups=tuple(sync.timings),
        step_s=end - start,
    )


def in_step_costs(calibration: Calibration, compressors: Mapping[str, CompressorCost]) -> CostModel:
    """The all-reduce cost model of a calibrated run: `compressors` (timed alone; must price
    the calibrated compressor), compute the backward inside a step, and the link fitted in two
    stages. 1: on the probe steps' totals of the groups timed on the communication thread
    (`fit_link_totals`). 2: from there, alpha and beta moved (Newton steps on the two
    equations, both >= 0) until `predict_step` gives each probe's median measured step: what
    the thread's own timings miss (handing a group to the thread, waking the training thread
    when the last is done) is then priced too, per collective or per byte as the two probes
    tell apart."""
    own = compressors.get(calibration.compressor)
    if own is None:
        raise ValueError(
            f"in_step_costs: no cost for the calibrated compressor {calibration.compressor!r}"
        )
    codec = parse_spec(calibration.compressor)
    totals = []
    for step in calibration.steps:
        if not step.groups:
            raise ValueError(f"in_step_costs: a {step.probe} step timed no group")
        nbytes = sum(codec.wire_bytes(numel) for numel, _ in step.groups)
        link_s = sum(seconds - own.seconds(numel) for numel, seconds in step.groups)
        totals.append((len(step.groups), nbytes, max(0.0, link_s)))
    first = CostModel(
        dict(compressors),
        fit_link_totals(totals),
        calibration.compute_s,
        mode="allreduce",
        contention=calibration.contention,
    )
    return _match_probes(calibration, first)


MATCH_ITERATIONS = 12  # Newton steps at most: the predictions are piecewise linear in alpha, beta
MATCH_TOLERANCE = 1e-3  # relative: close enough to the probes' measured steps


def _match_probes(calibration: Calibration, costs: CostModel) -> CostModel:
    """`costs` with the link moved so predict_step meets both probes' median steps (stage 2 of
    `in_step_costs`); the closest reached if they cannot both be met (alpha, beta >= 0)."""
    names = [t.name for t in calibration.tensors]
    plans = [probe_plan(names, calibration.compressor, probe) for probe in PROBES]
    target = np.array([calibration.probe_step_s(probe) for probe in PROBES])
    _, wire = costs.costs_of(calibration.compressor)
    total_bytes = max(1.0, wire.bytes(sum(t.numel for t in calibration.tensors)))
    delta = np.array([1e-4, 1e-4 / total_bytes])  # each moves the single probe by 0.1 ms

    def with_link(x: np.ndarray) -> CostModel:
        link = LinkCost(float(x[0]), float(x[1]))
        return CostModel(
            costs.compressors, link, costs.compute_s, mode="allreduce", contention=costs.contention
        )

    def predicted(x: np.ndarray) -> np.ndarray:
        model = with_link(x)
        return np.array([predict_step(calibration, plan, model) for plan in plans])

    x = np.array([costs.link.latency_s, costs.link.seconds_per_byte])
    best = (float(np.abs(predicted(x) - target).max()), x)
    for _ in range(MATCH_ITERATIONS):
        error = predicted(x) - target
        if np.abs(error).max() <= MATCH_TOLERANCE * target.min():
            break
        jacobian = np.stack(
            [(predicted(x + np.eye(2)[k] * delta) - predicted(x)) / delta[k] for k in range(2)],
            axis=1,
        )
        step, *_ = np.linalg.lstsq(jacobian, -error, rcond=None)
        x = np.maximum(x + step, 0.0)
        miss = float(np.abs(predicted(x) - target).max())
        if miss < best[0]:
            best = (miss, x)
    return with_link(best[1])


def predict_step(
    calibration: Calibration, groups: Sequence[TensorGroup], costs: CostModel
) -> float:
    """Seconds of a whole step under `groups`: the rest of the step plus predict_iteration's
    backward and communication on the calibrated tensors."""
    return calibration.outside_s + predict_iteration(calibration.tensors, groups, costs)


def calibrated_plan(planner: str, calibration: Calibration, communicator: Communicator) -> Plan:
    """`planner`'s plan on the in-step cost model of `calibration` (every compressor it may
    choose timed alone here), predicted with `predict_step`; rank 0's plan, agreed by all."""
    specs = plan_specs(planner, calibration.compressor)

    def costs() -> CostModel:
        return in_step_costs(calibration, {spec: compressor_cost(spec) for spec in specs})

    def predict(groups: Sequence[TensorGroup], model: CostModel) -> float:
        return predict_step(calibration, groups, model)

    tensors = list(calibration.tensors)
    return agree_plan(planner, tensors, calibration.compressor, communicator, costs, predict)
