"""Merged, overlapped gradient synchronisation without DDP's buckets (MergeComp, MG-WFBP).

The model's parameters are cut into planned groups (contiguous runs in model order, a compressor
each: gossipcomp.schedule's planners, or `threshold_groups`). A gradient-ready hook on every
parameter counts down its group; once a group is complete its synchronisation (pack into one
flat buffer, compress, one collective, decode, average, unpack into .grad) is queued on the
communication thread while backward goes on. Groups are queued strictly in the order backward
completes them under the plan (last group first); a group that completes early waits for the
ones before it, so every rank issues the same collectives in the same order. `synchronize()`
(call it between backward and optimizer.step) waits for all of them; a group whose parameters got
no gradient this step is synchronised with zeros then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gossipcomp.allreduce.agreement import check_model_sync
from gossipcomp.allreduce.comm import Communicator
from gossipcomp.allreduce.hooks import CompressedState
from gossipcomp.compress import ErrorFeedback, parse_spec
from gossipcomp.compress.codec import Codec
from gossipcomp.compress.flat import FlatLayout
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.schedule import (
    CompressorCost,
    CostModel,
    LinkCost,
    TensorGroup,
    TensorInfo,
    check_cover,
    fit_link,
    make_planner,
    measure_compressor,
    predict_iteration,
)
from gossipcomp.schedule.planners import planner_specs

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD_BYTES = 1 << 20  # groups of about 1 MiB of float32 when no planner is used


class _Group:
    def __init__(self, index: int, params: list[nn.Parameter], names: tuple[str, ...]) -> None:
        self.index = index
        self.params = params
        self.names = names
        self.layout = FlatLayout.of(params)
        self.waiting = len(params)


class MergedSync:
    """Per-parameter ready hooks filling planned groups, synchronised as they complete."""

    def __init__(
        self,
        model: nn.Module,
        groups: Sequence[TensorGroup],
        communicator: Communicator,
        *,
        seed: int = 0,
        error_feedback: bool = True,
        momentum: float = 0.0,
        timed: bool = False,
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        check_cover(groups, [n for n, _ in named])
        by_name = dict(named)
        self.order = {name: index for index, (name, _) in enumerate(named)}
        self.communicator = communicator
        self._groups = [
            _Group(i, [by_name[n] for n in g.names], g.names) for i, g in enumerate(groups)
        ]
        self._states: dict[str, CompressedState] = {}
        self._state_of = [self._state(g.compressor, seed, error_feedback, momentum) for g in groups]
        self._group_of = {id(p): group for group in self._groups for p in group.params}
        self._queue = list(reversed(self._groups))  # backward completes the last group first
        self._next = 0
        self._futures: list[concurrent.futures.Future[None]] = []
        self.round = 0
        self.wait_seconds = 0.0  # time synchronize() spent waiting for communication
        # timed: (elements, seconds) of each group's whole synchronisation on the communication
        # thread, in the order run (calibrate.py reads and clears it between steps)
        self.timings: list[tuple[int, float]] | None = [] if timed else None
        check_model_sync(communicator, "MergedSync", model, plan=self.groups, states=self._state_of)
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for _, p in named]

    def _state(
        self, spec: str, seed: int, error_feedback: bool, momentum: float
    ) -> CompressedState:
        state = self._states.get(spec)
        if state is None:
            compressor = parse_spec(spec)
            if isinstance(compressor, ErrorFeedback):
                compressor, error_feedback = compressor.inner, True
            assert isinstance(compressor, Codec)
            state = CompressedState(
                {},
                self.order,
                self.communicator,
                seed,
                momentum=momentum,
                compressor=compressor,
                error_feedback=error_feedback and compressor.name != "identity",
            )
            self._states[spec] = state
        return state

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return tuple(g.names for g in self._groups)

    def _ready(self, param: torch.Tensor) -> None:
        group = self._group_of[id(param)]
        group.waiting -= 1
        while self._next < len(self._queue) and self._queue[self._next].waiting <= 0:
            self._launch(self._queue[self._next])
            self._next += 1

    def _launch(self, group: _Group) -> None:
        state, round_ = self._state_of[group.index], self.round
        self._futures.append(self.communicator.submit(lambda: self._sync(group, state, round_)))

    def _sync(self, group: _Group, state: CompressedState, round_: int) -> None:
        start = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group.params]
        flat = group.layout.pack(grads)
        first = self.order[group.names[0]]
        mean = state.average(flat, group.names, group.layout.numels, first, round_)
        for p, view in zip(group.params, group.layout.views(mean), strict=True):
            if p.grad is None:
                p.grad = view.to(p.dtype).clone()
            else:
                p.grad.copy_(view)
        if self.timings is not None:
            self.timings.append((group.layout.numel, time.perf_counter() - start))

    def synchronize(self) -> None:
        """Wait until every group is averaged into .grad (launching any still incomplete)."""
        start = time.perf_counter()
        while self._next < len(self._queue):
            self._launch(self._queue[self._next])
            self._next += 1
        try:
            for future in self._futures:
                future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start
            self._futures.clear()
            self._next = 0
            for group in self._groups:
                group.waiting = len(group.params)
            self.round += 1

    def state_dict(self) -> dict[str, object]:
        """Error memories and velocities by parameter name (per compressor spec), the round."""
        return {
            "round": self.round,
            "memory": {spec: s.memory.state_dict() for spec, s in self._states.items()},
            "velocity": {spec: s.velocity.state_dict() for spec, s in self._states.items()},
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        round_ = checked_integer("merged sync round", state["round"], 0)  # before anything loads
        for key in ("memory", "velocity"):
            saved = state.get(key, {})
            if not isinstance(saved, Mapping):
                raise ValueError(f"merged sync {key}: expected a mapping of compressor specs")
            unknown = sorted(str(spec)[:60] for spec in saved if spec not in self._states)
            if unknown:
                raise ValueError(
                    f"merged sync {key}: specs {unknown[:3]} are not in this plan "
                    f"({sorted(self._states)})"
                )
            for spec, values in saved.items():
                getattr(self._states[spec], key).load_state_dict(values)
        self.round = round_

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def threshold_groups(
    tensors: Sequence[TensorInfo], compressor: str, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
) -> tuple[TensorGroup, ...]:
    """Groups of about `threshold_bytes` of float32, filled in backward (reverse model) order."""
    groups: list[list[str]] = []
    size = threshold_bytes
    for info in reversed(tensors):
        if size >= threshold_bytes:
            groups.append([])
            size = 0
        groups[-1].append(info.name)
        size += 4 * info.numel
    return tuple(TensorGroup(tuple(reversed(names)), compressor) for names in reversed(groups))


def measure_backward(
    model: nn.Module, run_backward: Callable[[], None], repeats: int = 5
) -> tuple[list[TensorInfo], float]:
    """Each parameter with the seconds into the backward pass when its gradient was ready
    (non-increasing along model order: backward readies the last layer first), and the seconds
    of a whole `run_backward`, each the median of `repeats` passes after one untimed warm-up:
    the first pass of a model pays for allocations and autograd's set-up, which a planner must
    not take for its compute."""
    checked_integer("measure_backward: repeats", repeats, 1, 1000)
    stamped_backward(model, run_backward)
    passes = [stamped_backward(model, run_backward) for _ in range(repeats)]
    stamps = [statistics.median(column) for column in zip(*(p[0] for p in passes), strict=True)]
    return tensor_infos(model, stamps), statistics.median(p[1] for p in passes)


def stamped_backward(
    model: nn.Module, run_backward: Callable[[], None]
) -> tuple[list[float], float]:
    """Seconds from the start of `run_backward` to each parameter's gradient (model order; the
    end of the pass for one that got none), and the seconds of the whole pass."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stamps: dict[str, float] = {}

    def stamp(name: str) -> Callable[[torch.Tensor], None]:
        def record(_param: torch.Tensor) -> None:
            stamps.setdefault(name, time.perf_counter())

        return record

    handles = [p.register_post_accumulate_grad_hook(stamp(name)) for name, p in named]
    start = time.perf_counter()
    try:
        run_backward()
    finally:
        end = time.perf_counter()
        for handle in handles:
            handle.remove()
    return [stamps.get(name, end) - start for name, _ in named], end - start


def tensor_infos(model: nn.Module, stamps: Sequence[float]) -> list[TensorInfo]:
    """Each trainable parameter (model order) ready at its stamp, made non-increasing."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    times = list(stamps)
    for i in range(len(times) - 2, -1, -1):  # a reading out of order: the later one wins
        times[i] = max(times[i], times[i + 1])
    return [
        TensorInfo(name, p.numel(), max(0.0, t)) for (name, p), t in zip(named, times, strict=True)
    ]


def measure_link(
    communicator: Communicator,
    summable: bool,
    sizes: Sequence[int],
    device: torch.device | str = "cpu",
    repeats: int = 3,
) -> list[tuple[int, float]]:
    """(bytes, seconds) of real collectives of each size (all ranks take part, in step), the
    first of `repeats` of each size left out (a warm-up)."""
    samples = []
    for size in sizes:
        dtype = torch.float32 if summable else torch.uint8
        buffer = torch.zeros(max(1, size // dtype.itemsize), dtype=dtype, device=device)
        for repeat in range(repeats):
            start = time.perf_counter()
            if summable:
                communicator.all_reduce_sum(buffer)
            else:
                communicator.all_gather(buffer)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)
            if repeat:
                samples.append((size, time.perf_counter() - start))
    return samples


def link_sizes(tensors: Sequence[TensorInfo], specs: Sequence[str]) -> list[int]:
    """Collective sizes (bytes) to fit the link on: 1 KiB, and an eighth of and the whole
    model's largest payload under `specs`, the range a plan's groups span (a fit far outside
    the sizes sent extrapolates: on a slow link 256 KiB of a sign payload of 14 KB wastes
    seconds, on a fast one 16 KiB says little about 400 KB)."""
    numel = sum(t.numel for t in tensors)
    whole = max(parse_spec(spec).wire_bytes(numel) for spec in specs)
    return sorted({1 << 10, max(2 << 10, whole // 8), max(4 << 10, whole)})


@dataclass(frozen=True)
class Plan:
    """Groups a planner chose and the step seconds its cost model predicts for them."""

    groups: tuple[TensorGroup, ...]
    predicted_s: float  # predict_iteration of the groups; 0.0 when the planner could not plan
    link: LinkCost | None = None  # the link it was priced on; None when it could not plan
    contention: float = 0.0  # its cost model's slowdown of communication beside the backward


def make_plan(
    planner: str,
    tensors: Sequence[TensorInfo],
    compressor: str,
    communicator: Communicator,
    compute_s: float,
    device: torch.device | str = "cpu",
) -> Plan:
    """Groups from a gossipcomp.schedule planner on costs measured here: the compressor timed on
    this machine, the collective timed between the ranks on an idle link (calibrate.py prices
    collectives inside training steps instead). Every rank must call it (the link is measured
    together); rank 0's plan is broadcast so all ranks agree. Falls back to `threshold_groups`
    (with a warning) when the planner cannot plan."""
    summable = parse_spec(compressor).summable
    specs = plan_specs(planner, compressor)
    link = measure_link(communicator, summable, link_sizes(tensors, specs), device, repeats=5)

    def costs() -> CostModel:
        priced = {spec: compressor_cost(spec) for spec in specs}
        return CostModel(priced, fit_link(link), compute_s, mode="allreduce")

    def predict(groups: Sequence[TensorGroup], model: CostModel) -> float:
        return predict_iteration(tensors, groups, model)

    return agree_plan(planner, tensors, compressor, communicator, costs, predict)


def plan_specs(planner: str, compressor: str) -> tuple[str, ...]:
    """Every compressor spec `planner`'s plan may use (its cost model must price them); the
    user's alone for a planner spec that does not parse (agree_plan says so and falls back)."""
    try:
        return planner_specs(make_planner(planner), compressor)
    except ValueError:
        return (compressor,)


def compressor_cost(spec: str) -> CompressorCost:
    """`spec`'s compress + decompress timed alone on this machine (1 Ki to 128 Ki elements)."""
    return measure_compressor(spec, [1 << 10, 1 << 14, 1 << 17], repeats=3)


def agree_plan(
    planner: str,
    tensors: Sequence[TensorInfo],
    compressor: str,
    communicator: Communicator,
    costs: Callable[[], CostModel],
    predict: Callable[[Sequence[TensorGroup], CostModel], float],
) -> Plan:
    """Rank 0 plans on `costs()` and prices the plan with `predict`; its plan is broadcast so
    every rank (all must call this) takes the same groups. Falls back to `threshold_groups`
    (predicting 0.0, with a warning) when the planner cannot plan."""
    plan: Plan | None = None
    if communicator.rank == 0:
        try:
            model = costs()
            groups = make_planner(planner).plan(tensors, model, compressor)
            check_cover(groups, [t.name for t in tensors])
            plan = Plan(groups, predict(groups, model), model.link, model.contention)
        except (ValueError, TypeError, ArithmeticError) as error:
            log.warning(
                "planner %s could not plan (%s); groups of %d bytes instead",
                planner,
                error,
                DEFAULT_THRESHOLD_BYTES,
            )
            plan = Plan(threshold_groups(tensors, compressor), 0.0)
    box: list[object] = [plan]
    dist.broadcast_object_list(box, src=0, group=communicator.group)
    agreed = box[0]
    assert isinstance(agreed, Plan)
    return agreed
