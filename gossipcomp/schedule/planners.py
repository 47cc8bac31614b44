"""Planners: from tensors and a cost model to a plan (contiguous groups, a compressor each).

Every planner implements `Planner.plan(tensors, costs, compressor)`; `PLANNERS` maps names to
classes and `make_planner("strategy:candidates=identity|fp16|user")` builds one from a spec.

- per-tensor / single: one group per tensor / one group of all (the two extremes).
- mergecomp: MergeComp's goal, the contiguous partition with the smallest iteration time, in
  two modes. Modelled (the default): exact dynamic programming over the last cut against
  `predict_iteration`'s equations, every candidate cut of a prefix evaluated at once with numpy.
  Measured (`MergeComp(measure=...)`, as MergeComp's reference does it): a callback times a
  candidate plan (e.g. mean step time over a few real rounds); a memoised local search over
  group boundaries, starting from the modelled optimum and equal-size splits, moves, removes
  and adds boundaries while the measured time drops, within a budget of measurements.
- mgwfbp: MG-WFBP's analytic merge rule against the backward timeline.
- strategy: a compressor per group (ByteComp/Espresso's decision: exact, fp16 or a compressor),
  see `Strategy`.

Tensors are processed in the order they become ready: model order for gossip (all ready at 0),
reverse model order for all-reduce, where ready_at must not increase along the model (backward
runs from the last layer to the first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from gossipcomp.compress import parse_spec
from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.schedule.catalog import PLANNER_NAMES
from gossipcomp.schedule.costs import CostModel, overlapped_finish
from gossipcomp.schedule.groups import TensorGroup, TensorInfo, groups_from_cuts

USER = "user"  # in strategy candidates: the user's own compressor
MAX_PLAN_TENSORS = 20_000  # the dynamic programmes are quadratic in the number of tensors
DEFAULT_CANDIDATES = ("identity", "fp16", USER)


class Planner(Protocol):
    """Decides a plan: contiguous groups covering `tensors` in model order, a compressor each."""

    name: ClassVar[str]

    def plan(
        self, tensors: Sequence[TensorInfo], costs: CostModel, compressor: str
    ) -> tuple[TensorGroup, ...]:
        """Groups for `tensors` (model order) given the costs and the user's compressor spec."""
        ...


@dataclass(frozen=True)
class _Timeline:
    """The tensors in processing order, with prefix sums of sizes and the backward ready times."""

    prefix_numel: np.ndarray  # elements of the first k processed tensors, k = 0..n
    ready: np.ndarray  # ready_at of each processed tensor (non-decreasing in allreduce mode)
    backward: bool  # processed in reverse model order (all-reduce)

    @classmethod
    def of(cls, tensors: Sequence[TensorInfo], costs: CostModel) -> _Timeline:
        if not tensors:
            raise ValueError("nothing to plan: expected at least one tensor")
        n = len(tensors)
        if n > MAX_PLAN_TENSORS:
            raise ValueError(f"{n} tensors to plan; expected at most {MAX_PLAN_TENSORS}")
        if len({t.name for t in tensors}) != n:
            raise ValueError("tensor names repeat; expected one name per tensor")
        backward = costs.mode == "allreduce"
        order = np.arange(n - 1, -1, -1) if backward else np.arange(n)
        numel = np.array([tensors[i].numel for i in order], dtype=float)
        ready = np.array([tensors[i].ready_at for i in order], dtype=float)
        if costs.mode == "allreduce" and np.any(np.diff(ready) < 0):
            raise ValueError(
                "all-reduce planning expects ready_at not to increase along the "
                "model's parameter order (backward readies the last layer first)"
            )
        return cls(np.concatenate([[0.0], np.cumsum(numel)]), ready, backward)

    def groups(
        self, tensors: Sequence[TensorInfo], cuts: Sequence[int], specs: Sequence[str]
    ) -> tuple[TensorGroup, ...]:
        """Groups in model order from cuts (and a spec per group) in processing order."""
        n = len(tensors)
        if not self.backward:
            return groups_from_cuts(tensors, cuts, specs)
        model_cuts = [n - c for c in reversed(cuts)]
        return groups_from_cuts(tensors, model_cuts, list(reversed(specs)))


def _coefficients(costs: CostModel, specs: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) per spec: a group of m elements with that spec adds A + B * m seconds to its
    stretch of the timeline, compression plus its bytes on the link, and (all-reduce: one
    collective per group) the link's latency too."""
    fixed, slope = [], []
    link = costs.link
    for spec in specs:
        compression, wire = costs.costs_of(spec)
        fixed.append(compression.fixed_s + link.seconds_per_byte * wire.fixed_bytes)
        slope.append(compression.per_element_s + link.seconds_per_byte * wire.bytes_per_element)
    a = np.array(fixed)
    if costs.mode == "allreduce":
        a = a + link.latency_s
    return a, np.array(slope)


def optimal_plan(
    timeline: _Timeline, costs: CostModel, specs: Sequence[str]
) -> tuple[list[int], list[int]]:
    """Cuts (processing order) and a spec index per group of the plan minimising the predicted
    time when each group may take any of `specs`. With d_c(s, e) the duration of tensors
    [s, e) under spec c, f[e] = best finish of the first e tensors: gossip
    f[e] = min_{s,c} f[s] + d_c(s, e); all-reduce f[e] = min_{s,c} F(max(ready[e-1], f[s]),
    d_c(s, e)), F `overlapped_finish` (the sum when the model has no contention). Both are
    exact: the final time grows with f, and each step is non-decreasing in f[s]. Ties go to
    the earlier spec, then the earlier cut."""
    n = timeline.ready.size
    fixed, slope = _coefficients(costs, specs)
    fixed, slope = fixed[:, None], slope[:, None]
    best = np.zeros(n + 1)
    back = np.zeros(n + 1, dtype=int)
    pick = np.zeros(n + 1, dtype=int)
    prefix = timeline.prefix_numel
    allreduce = costs.mode == "allreduce"
    for end in range(1, n + 1):
        starts = best[:end]
        if allreduce:
            starts = np.maximum(starts, timeline.ready[end - 1])
        duration = fixed + slope * (prefix[end] - prefix[:end])  # [spec, start]
        finish = overlapped_finish(starts, duration, costs.compute_s, costs.contention)
        spec, start = divmod(int(np.argmin(finish)), end)
        back[end], pick[end], best[end] = start, spec, finish[spec, start]
    cuts, chosen = [n], []
    while cuts[-1] > 0:
        chosen.append(int(pick[cuts[-1]]))
        cuts.append(int(back[cuts[-1]]))
    return cuts[::-1], chosen[::-1]


class PerTensor:
    """One group per tensor, all with the user's compressor: no merging at all."""

    name: ClassVar[str] = "per-tensor"

    def plan(
        self, tensors: Sequence[TensorInfo], costs: CostModel, compressor: str
    ) -> tuple[TensorGroup, ...]:
        _Timeline.of(tensors, costs)  # the same input checks as every planner
        return tuple(TensorGroup((t.name,), compressor) for t in tensors)


class Single:
    """One group of every tensor with the user's compressor: merge everything."""

    name: ClassVar[str] = "single"

    def plan(
        self, tensors: Sequence[TensorInfo], costs: CostModel, compressor: str
    ) -> tuple[TensorGroup, ...]:
        _Timeline.of(tensors, costs)
        return (TensorGroup(tuple(t.name for t in tensors), compressor),)


Measure = Callable[[tuple[TensorGroup, ...]], float]
DEFAULT_MEASUREMENTS = 40  # candidate plans a measured search times at most


@dataclass(frozen=True)
class MergeComp:
    """The contiguous partition with the smallest iteration time for the user's compressor.

    Without `measure`: the modelled optimum (`optimal_plan` with one spec). With `measure`
    (seconds of one iteration under a plan, timed for real): a memoised local search over
    group boundaries of at most `budget` measurements (see `measured_search`).
    """

    measure: Measure | None = None
    budget: int = DEFAULT_MEASUREMENTS
    name: ClassVar[str] = "mergecomp"

    def __post_init__(self) -> None:
        checked_integer("mergecomp: budget (measurements)", self.budget, 1, 100_000)

    def plan(
        self, tensors: Sequence[TensorInfo], costs: CostModel, compressor: str
    ) -> tuple[TensorGroup, ...]:
        timeline = _Timeline.of(tensors, costs)
        cuts, _ = optimal_plan(timeline, costs, [compressor])
        if self.measure is None:
            return timeline.groups(tensors, cuts, [compressor] * (len(cuts) - 1))
        measure = self.measure

        def timed(candidate: tuple[int, ...]) -> float:
            groups = timeline.groups(tensors, candidate, [compressor] * (len(candidate) - 1))
            return measure(groups)

        starts = [tuple(cuts), *_equal_splits(timeline.prefix_numel, (1, 2, 4))]
        best, _ = measured_search(len(tensors), timed, starts, self.budget)
        return timeline.groups(tensors, best, [compressor] * (len(best) - 1))


def _equal_splits(prefix: np.ndarray, counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Cuts into `count` groups of about equal elements, for each count (duplicates dropped)."""
    n = prefix.size - 1
    total = prefix[-1]
    splits = []
    for count in counts:
        inner = np.searchsorted(prefix, total * np.arange(1, count) / count, side="left")
        cuts = sorted({0, n, *(int(c) for c in inner if 0 < c < n)})
        splits.append(tuple(cuts))
    return list(dict.fromkeys(splits))


def measured_search(
    n: int,
    measure: Callable[[tuple[int, ...]], float],
    starts: Sequence[tuple[int, ...]],
    budget: int,
) -> tuple[tuple[int, ...], float]:
    """Best cuts (0 < ... < n, processing order) found by timing candidates with `measure`.

    Every start is timed; then from the best so far, neighbouring candidates are timed in turn:
    each inner boundary moved by +-step (step from n/4 halving to 1, as MergeComp's search over
    one split point does), removed, and each group split in its middle. A candidate that is
    faster becomes the best and the scan goes on from it; the search ends when no neighbour at
    step 1 is faster or `budget` measurements are spent. Each candidate is timed at most once
    (memoised); a time that is not a finite number >= 0 is refused.
    """
    memo: dict[tuple[int, ...], float] = {}

    def timed(cuts: tuple[int, ...]) -> float | None:
        if cuts in memo:
            return memo[cuts]
        if len(memo) >= budget:
            return None
        memo[cuts] = checked_number("mergecomp: a measurement (seconds)", measure(cuts), 0.0)
        return memo[cuts]

    for start in starts:
        timed(tuple(start))
    best = min(memo, key=lambda c: (memo[c], len(c)))
    step = max(1, n // 4)
    while True:
        improved = False
        for candidate in _neighbours(best, n, step):
            seconds = timed(candidate)
            if seconds is None:
                return best, memo[best]
            if seconds < memo[best]:
                best, improved = candidate, True
                break
        if not improved:
            if step == 1:
                return best, memo[best]
            step //= 2


def _neighbours(cuts: tuple[int, ...], n: int, step: int) -> list[tuple[int, ...]]:
    """Plans one change away from `cuts`: a boundary moved by +-step, removed, or a group
    split in its middle (deterministic order, no duplicates, `cuts` itself left out)."""
    found: dict[tuple[int, ...], None] = {}
    inner = cuts[1:-1]
    for k, cut in enumerate(inner):
        low, high = cuts[k], cuts[k + 2]
        for moved in (cut - step, cut + step):
            if low < moved < high:
                found[(*cuts[: k + 1], moved, *cuts[k + 2 :])] = None
        found[(*cuts[: k + 1], *cuts[k + 2 :])] = None
    for start, stop in zip(cuts[:-1], cuts[1:], strict=True):
        if stop - start >= 2:
            middle = (start + stop) // 2
            found[tuple(sorted((*cuts, middle)))] = None
    found.pop(cuts, None)
    return list(found)


class MGWFBP:
    """MG-WFBP's merge rule, scanning tensors in the order they become ready.

    With tau_c the start of the current group's communication (max of its ready time and the end
    of the previous group's), t_c its compression plus collective, a the link latency and r the
    next tensor's ready time: merge the next tensor into the current group when
    r < tau_c + t_c and (tau_c > r or r - tau_c < a), recomputing tau_c and t_c after a merge;
    otherwise the current group is sent and the next starts a new one.
    """

    name: ClassVar[str] = "mgwfbp"

    def plan(
        self, tensors: Sequence[TensorInfo], costs: CostModel, compressor: str
    ) -> tuple[TensorGroup, ...]:
        timeline = _Timeline.of(tensors, costs)
        latency = costs.link.latency_s
        fixed, slope = (float(v[0]) for v in _coefficients(costs, [compressor]))
        if costs.mode == "gossip":
            fixed += latency  # the rule prices each group as its own transfer
        ready = timeline.ready.tolist()
        prefix = timeline.prefix_numel.tolist()
        cuts = [0]
        link_free = 0.0
        for k in range(1, len(ready)):
            t_c = fixed + slope * (prefix[k] - prefix[cuts[-1]])
            tau_c = max(ready[k - 1], link_free)
            if not (ready[k] < tau_c + t_c and (tau_c > ready[k] or ready[k] - tau_c < latency)):
                cuts.append(k)
                link_free = tau_c + t_c
        cuts.append(len(ready))
        return timeline.groups(tensors, cuts, [compressor] * (len(cuts) - 1))


@dataclass(frozen=True)
class Strategy:
    """A compressor per group from `candidates` ("user": the user's compressor), on the
    predicted timeline; ByteComp/Espresso's decision, searched in two stages.

    1. Time: `optimal_plan` over (cut, candidate) jointly, the exact optimum of the cost
       model's timeline. ByteComp searches greedily because its timeline (accelerator
       contention, several collective kinds) has no exact recursion; ours has one, so the
       greedy's few-percent loss is not needed (brute force confirms the optimum).
    2. Fidelity, ByteComp's first rule: compression whose communication is hidden costs
       accuracy for nothing. Groups, largest first, each take the least compressing candidate
       (most wire bytes per element) that leaves the predicted time unchanged (up to a
       relative 1e-9), judged on the timeline with the other groups as they stand.
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    name: ClassVar[str] = "strategy"

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("strategy: no candidates; expected compressor specs or 'user'")
        if len(self.candidates) > MAX_CANDIDATES:
            raise ValueError(
                f"strategy: {len(self.candidates)} candidates; expected at most {MAX_CANDIDATES}"
            )
        for spec in self.candidates:
            if spec != USER:
                parse_spec(spec)

    def specs(self, compressor: str) -> tuple[str, ...]:
        """The candidates with "user" read as `compressor`, each once, in the given order."""
        return tuple(dict.fromkeys(compressor if c == USER else c for c in self.candidates))

    def plan(
        self, tensors: Sequence[TensorInfo], costs: CostModel, compressor: str
    ) -> tuple[TensorGroup, ...]:
        timeline = _Timeline.of(tensors, costs)
        specs = list(self.specs(compressor))
        # least compression first: most bytes per element (stable, so ties keep the given order)
        specs.sort(key=lambda spec: -costs.costs_of(spec)[1].bytes_per_element)
        cuts, choice = optimal_plan(timeline, costs, specs)
        choice = _relax(timeline, costs, specs, cuts, choice)
        return timeline.groups(tensors, cuts, [specs[c] for c in choice])


_FIDELITY_TIE = 1e-9  # a less compressing choice may cost this much predicted time (relative)
MAX_CANDIDATES = 16
MAX_PLANNER_SPEC = 1000  # characters


def _relax(
    timeline: _Timeline, costs: CostModel, specs: list[str], cuts: list[int], choice: list[int]
) -> list[int]:
    """Stage 2 of `Strategy`: per group, largest first, the least compressing spec (lowest
    index) that keeps the predicted time within _FIDELITY_TIE of the plan's from stage 1.

    Durations d_g in processing order. gossip: T = compute + alpha + sum d. all-reduce: with
    finish_g = ready_g + d_g + ... + d_last, T = max(compute, max_g finish_g); changing d_g by
    delta moves finish_0..finish_g by delta, so each trial costs two maxima. With contention
    (no such closed form) each trial walks the groups' timeline instead."""
    if costs.mode == "allreduce" and costs.contention > 0:
        return _relax_walking(timeline, costs, specs, cuts, choice)
    bounds, numel, options, chosen, durations = _group_options(timeline, costs, specs, cuts, choice)
    if costs.mode == "gossip":
        finish = np.array([costs.link.latency_s + durations.sum()])
    else:
        finish = timeline.ready[bounds[1:] - 1] + np.cumsum(durations[::-1])[::-1]
    limit = max(costs.compute_s, float(finish.max())) * (1 + _FIDELITY_TIE)
    for group in np.argsort(-numel, kind="stable").tolist():
        current = int(chosen[group])
        if current == 0:
            continue
        delta = options[:current, group] - durations[group]
        if costs.mode == "gossip":
            trials = costs.compute_s + finish[0] + delta
            moved = slice(0, 1)
        else:
            moved = slice(0, group + 1)
            after = float(finish[group + 1 :].max()) if group + 1 < finish.size else -np.inf
            trials = np.maximum(costs.compute_s, np.maximum(finish[moved].max() + delta, after))
        allowed = np.flatnonzero(trials <= limit)
        if allowed.size:
            pick = int(allowed[0])
            finish[moved] += delta[pick]
            durations[group] = options[pick, group]
            chosen[group] = pick
    return chosen.tolist()


def _group_options(
    timeline: _Timeline, costs: CostModel, specs: list[str], cuts: list[int], choice: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For `_relax`: the cuts as an array, each group's elements, the duration of every group
    under every spec ([spec, group]), the chosen spec indices and their durations."""
    prefix = timeline.prefix_numel
    bounds = np.asarray(cuts)
    numel = prefix[bounds[1:]] - prefix[bounds[:-1]]
    fixed, slope = _coefficients(costs, specs)
    options = fixed[:, None] + slope[:, None] * numel[None, :]
    chosen = np.asarray(choice)
    return bounds, numel, options, chosen, options[chosen, np.arange(numel.size)]


def _relax_walking(
    timeline: _Timeline, costs: CostModel, specs: list[str], cuts: list[int], choice: list[int]
) -> list[int]:
    """`_relax` for an all-reduce model with contention: every trial's time from the whole
    timeline (`_walk`), the candidates of one group at once."""
    bounds, numel, options, chosen, durations = _group_options(timeline, costs, specs, cuts, choice)
    ready = timeline.ready[bounds[1:] - 1]
    limit = float(_walk(ready, durations[None, :], costs)[0]) * (1 + _FIDELITY_TIE)
    for group in np.argsort(-numel, kind="stable").tolist():
        current = int(chosen[group])
        if current == 0:
            continue
        trials = np.repeat(durations[None, :], current, axis=0)
        trials[:, group] = options[:current, group]
        allowed = np.flatnonzero(_walk(ready, trials, costs) <= limit)
        if allowed.size:
            pick = int(allowed[0])
            durations[group] = options[pick, group]
            chosen[group] = pick
    return chosen.tolist()


def _walk(ready: np.ndarray, durations: np.ndarray, costs: CostModel) -> np.ndarray:
    """Predicted all-reduce time of each row of `durations` ([trial, group], processing
    order), groups ready at `ready`: predict_iteration's recursion, over the trials at once."""
    end = np.zeros(durations.shape[0])
    for g in range(durations.shape[1]):
        start = np.maximum(end, ready[g])
        end = np.asarray(
            overlapped_finish(start, durations[:, g], costs.compute_s, costs.contention)
        )
    return np.maximum(costs.compute_s, end)


PLANNERS: dict[str, Callable[..., Planner]] = dict(
    zip(PLANNER_NAMES, (PerTensor, Single, MergeComp, MGWFBP, Strategy), strict=True)
)


def planner_specs(planner: Planner, compressor: str) -> tuple[str, ...]:
    """Every compressor spec a plan of `planner` for the user's `compressor` may use: the cost
    model it plans on must price each of them."""
    return planner.specs(compressor) if isinstance(planner, Strategy) else (compressor,)


def make_planner(spec: str) -> Planner:
    """A planner from "NAME" or "strategy:candidates=SPEC|SPEC|...", e.g.
    "strategy:candidates=identity|fp16|user|topk:ratio=0.001" ("user": the user's compressor)."""
    if not isinstance(spec, str) or len(spec) > MAX_PLANNER_SPEC:
        raise ValueError(
            f"planner spec {quoted(spec)}: expected a string of at most "
            f"{MAX_PLANNER_SPEC} characters"
        )
    name, _, arguments = spec.strip().partition(":")
    factory = PLANNERS.get(name.strip())
    if factory is None:
        raise ValueError(f"unknown planner {quoted(name)}; known: {', '.join(sorted(PLANNERS))}")
    if not arguments.strip():
        return factory()
    key, equals, value = arguments.partition("=")
    if factory is not Strategy or key.strip() != "candidates" or not equals:
        raise ValueError(
            f"planner spec {quoted(spec)}: only strategy takes an argument, "
            "expected strategy:candidates=SPEC|SPEC|..."
        )
    return Strategy(tuple(part.strip() for part in value.split("|") if part.strip()))
