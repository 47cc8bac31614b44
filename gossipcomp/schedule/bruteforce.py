"""The exact optimum of small planning instances, to measure how far a planner lands from it.

`brute_force` tries every contiguous partition of the tensors (2^(n-1)) with every assignment of
a candidate compressor to each group (|candidates|^groups), timing each with the equations of
`predict_iteration` evaluated for all assignments of a partition at once (numpy). It shares no
code with the planners, so a planner's gap to it is a real check. `random_instance` draws
planning instances with sizes, costs and links spread over orders of magnitude.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.schedule.costs import CompressorCost, CostModel, LinkCost, Mode
from gossipcomp.schedule.groups import TensorGroup, TensorInfo

MAX_BRUTE_FORCE_TENSORS = 12
MAX_BRUTE_FORCE_PLANS = 20_000_000  # partitions x assignments tried in one call at most


@dataclass(frozen=True)
class Optimum:
    """The best plan found by exhaustive search, its predicted seconds, and how many were tried."""

    groups: tuple[TensorGroup, ...]
    seconds: float
    plans_tried: int


def _compositions(n: int) -> list[list[int]]:
    """Every contiguous partition of n items as cut positions 0 < ... < n (with 0 and n)."""
    cuts = []
    for mask in range(1 << (n - 1)):
        inner = [k + 1 for k in range(n - 1) if mask >> k & 1]
        cuts.append([0, *inner, n])
    return cuts


@functools.lru_cache(maxsize=64)
def _assignments(choices: int, groups: int) -> np.ndarray:
    """Every assignment of one of `choices` to each of `groups` groups: [choices^groups, groups]
    (read-only; cached, as every partition with this many groups uses the same one)."""
    table = np.indices((choices,) * groups).reshape(groups, -1).T
    table.setflags(write=False)
    return table


def brute_force(
    tensors: Sequence[TensorInfo], costs: CostModel, candidates: Sequence[str]
) -> Optimum:
    """The plan with the smallest predicted iteration time over every contiguous partition of
    `tensors` (model order) and every choice of one of `candidates` per group."""
    n = len(tensors)
    if not 1 <= n <= MAX_BRUTE_FORCE_TENSORS:
        raise ValueError(f"brute_force: {n} tensors; expected 1 to {MAX_BRUTE_FORCE_TENSORS}")
    specs = list(dict.fromkeys(candidates))
    if not specs:
        raise ValueError("brute_force: no candidate compressors; expected at least one spec")
    total = sum(len(specs) ** (len(c) - 1) for c in _compositions(n))
    if total > MAX_BRUTE_FORCE_PLANS:
        raise ValueError(
            f"brute_force: {total} plans for {n} tensors and {len(specs)} "
            f"candidates; expected at most {MAX_BRUTE_FORCE_PLANS}"
        )
    entries = [costs.costs_of(spec) for spec in specs]
    numel = np.array([t.numel for t in tensors], dtype=float)
    ready = np.array([t.ready_at for t in tensors], dtype=float)
    link = costs.link
    best: tuple[float, list[int], tuple[int, ...]] | None = None
    for cuts in _compositions(n):
        groups = len(cuts) - 1
        sizes = np.array([numel[a:b].sum() for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
        group_ready = np.array([ready[a:b].max() for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
        compress = np.stack([c.seconds(sizes) for c, _ in entries])  # [spec, group]
        wire = np.stack([w.bytes(sizes) for _, w in entries])
        choice = _assignments(len(specs), groups)
        columns = np.arange(groups)
        c = compress[choice, columns]  # [assignment, group]
        b = wire[choice, columns]
        if costs.mode == "gossip":
            seconds = costs.compute_s + c.sum(axis=1) + link.latency_s
            seconds = seconds + link.seconds_per_byte * b.sum(axis=1)
        else:
            end = np.zeros(choice.shape[0])
            for g in np.argsort(group_ready, kind="stable"):
                end = np.maximum(group_ready[g], end) + c[:, g] + link.seconds(b[:, g])
            seconds = np.maximum(costs.compute_s, end)
        pick = int(np.argmin(seconds))
        if best is None or seconds[pick] < best[0]:
            best = (float(seconds[pick]), cuts, tuple(int(k) for k in choice[pick]))
    assert best is not None  # n >= 1: at least one partition
    seconds, cuts, picked = best
    plan = tuple(
        TensorGroup(tuple(t.name for t in tensors[a:b]), specs[k])
        for a, b, k in zip(cuts[:-1], cuts[1:], picked, strict=True)
    )
    return Optimum(plan, seconds, total)


def random_instance(
    rng: np.random.Generator, tensors: int, mode: Mode, candidates: Sequence[str]
) -> tuple[list[TensorInfo], CostModel]:
    """A planning instance: `tensors` tensors of 10 to 10^6 elements (log-uniform), compressor
    costs with fixed parts of 5 us to 2 ms and 0.1 to 10 ns per element, a link with 10 us to
    10 ms latency and 0.1 to 10 ns per byte. All-reduce: gradients ready from the last tensor
    backwards, 0.1 to 10 ms apart, compute ending with the last one."""
    checked_integer("random_instance: tensors", tensors, 1, 100_000)

    def log_uniform(low: float, high: float, size: int | None = None) -> np.ndarray:
        return np.exp(rng.uniform(np.log(low), np.log(high), size))

    numel = np.round(log_uniform(10, 1e6, tensors)).astype(int)
    if mode == "allreduce":
        gaps = log_uniform(1e-4, 1e-2, tensors)
        ready = np.cumsum(gaps)[::-1]  # the last tensor is ready first
        compute_s = float(ready.max())
    else:
        ready = np.zeros(tensors)
        compute_s = float(log_uniform(1e-3, 1e-1))
    infos = [TensorInfo(f"t{k}", int(numel[k]), float(ready[k])) for k in range(tensors)]
    compressors = {
        spec: CompressorCost(float(log_uniform(5e-6, 2e-3)), float(log_uniform(1e-10, 1e-8)))
        for spec in dict.fromkeys(candidates)
    }
    link = LinkCost(float(log_uniform(1e-5, 1e-2)), float(log_uniform(1e-10, 1e-8)))
    return infos, CostModel(compressors, link, compute_s, mode)
