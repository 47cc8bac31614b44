"""The cost model a planner optimises: alpha-beta links, compressor costs, and a plan's time.

Everything is affine and measured. A link moves n bytes in alpha + beta * n seconds
(`LinkCost`, fitted by `fit_link` from transfers that happened, or on demand from the last
transfers of each link kept in a bounded `TransferLog`); a compressor compresses and
decompresses a buffer of m elements in fixed + per_element * m seconds (`CompressorCost`, timed
by `measure_compressor` on this machine) and puts `WireSize.of(spec)` bytes on the wire; a
local step takes `measure_seconds(step)`. Every sample is range-checked: it may come from the
network.
`predict_iteration` turns a plan into seconds under a `CostModel`; its docstring states the two
modes' equations.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from gossipcomp.compress import CompressionContext, parse_spec
from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.schedule.groups import TensorGroup, TensorInfo, check_cover

Mode = Literal["gossip", "allreduce"]
MODES: tuple[Mode, ...] = ("gossip", "allreduce")
_OUTLIER_MADS = 3.0  # samples further than this many robust deviations from the fit are dropped
_OUTLIER_PASSES = 3  # refits after dropping outliers, at most
_WIRE_PROBE = 1 << 24  # element counts used to read a compressor's bytes per element


def _non_negative(owner: str, **values: float) -> None:
    for key, value in values.items():
        checked_number(f"{owner}: {key}", value, 0.0)


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta link: a transfer of n bytes takes latency_s + seconds_per_byte * n."""

    latency_s: float
    seconds_per_byte: float

    def __post_init__(self) -> None:
        _non_negative("LinkCost", latency_s=self.latency_s, seconds_per_byte=self.seconds_per_byte)

    def seconds(self, nbytes: float) -> float:
        """Predicted seconds to move `nbytes` bytes."""
        return self.latency_s + self.seconds_per_byte * nbytes


@dataclass(frozen=True)
class CompressorCost:
    """Compress + decompress of one buffer of n elements: fixed_s + per_element_s * n."""

    fixed_s: float
    per_element_s: float

    def __post_init__(self) -> None:
        _non_negative("CompressorCost", fixed_s=self.fixed_s, per_element_s=self.per_element_s)

    def seconds(self, numel: float) -> float:
        """Predicted seconds to compress and decompress a buffer of `numel` elements."""
        return self.fixed_s + self.per_element_s * numel


@dataclass(frozen=True)
class WireSize:
    """A compressor's payload size as fixed_bytes + bytes_per_element * n.

    Read from the compressor's exact `wire_bytes`: exact for dense codecs, within one element's
    bytes for sparse ones (top-k rounds k up) and within a byte per bit plane for packed ones.
    Affine, so planners can evaluate every candidate group at once with numpy.
    """

    fixed_bytes: float
    bytes_per_element: float

    @classmethod
    def of(cls, spec: str) -> WireSize:
        """The affine wire size of the compressor `spec` (see the class docstring)."""
        compressor = parse_spec(spec)
        low, high = compressor.wire_bytes(_WIRE_PROBE), compressor.wire_bytes(2 * _WIRE_PROBE)
        per_element = (high - low) / _WIRE_PROBE
        return cls(max(0.0, low - per_element * _WIRE_PROBE), per_element)

    def bytes(self, numel: float) -> float:
        return self.fixed_bytes + self.bytes_per_element * numel


def fit_line(xs: Sequence[float], ys: Sequence[float], what: str) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y ~ intercept + slope * x by least squares, robust to outliers.

    One least-squares fit, then up to _OUTLIER_PASSES times: samples whose residual lies further
    than _OUTLIER_MADS robust deviations (1.4826 * median absolute deviation of the kept
    residuals) from the kept residuals' median are dropped and the line refitted. A negative coefficient is
    clamped to 0 and the other refitted alone. Needs at least two distinct x.

    Plain Python: the rate controller fits 2-16 points per link direction at every decision
    (every round at `--report-every 1`), and numpy's per-call overhead made one fit 0.2-0.3 ms,
    a third of a coordinator's CPU on the shaped adaptive benchmark (py-spy, stop 46).
    """
    x = [float(v) for v in xs]
    y = [float(v) for v in ys]
    if len(x) != len(y):
        raise ValueError(f"{what}: expected as many sizes as times, got {len(x)} and {len(y)}")
    if not all(math.isfinite(v) for v in (*x, *y)):
        raise ValueError(f"{what}: samples must be finite numbers")
    if len(set(x)) < 2:
        raise ValueError(
            f"{what}: got {len(set(x))} distinct size(s); expected at least 2 "
            "to separate the fixed cost from the per-unit cost"
        )
    keep = list(range(len(x)))
    intercept, slope = _clamped_fit(x, y)
    for _ in range(_OUTLIER_PASSES):
        residual = [b - (intercept + slope * a) for a, b in zip(x, y, strict=True)]
        centre = statistics.median(residual[i] for i in keep)
        spread = 1.4826 * statistics.median(abs(residual[i] - centre) for i in keep)
        inside = [i for i, r in enumerate(residual) if abs(r - centre) <= _OUTLIER_MADS * spread]
        if spread == 0 or inside == keep or len({x[i] for i in inside}) < 2:
            break
        keep = inside
        intercept, slope = _clamped_fit([x[i] for i in keep], [y[i] for i in keep])
    return intercept, slope


def _clamped_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least squares with both coefficients >= 0 (two coefficients: check the two faces)."""
    n = len(x)
    x_mean, y_mean = math.fsum(x) / n, math.fsum(y) / n
    spread_x = math.fsum((a - x_mean) ** 2 for a in x)
    slope = math.fsum((a - x_mean) * (b - y_mean) for a, b in zip(x, y, strict=True)) / spread_x
    intercept = y_mean - slope * x_mean
    if intercept >= 0 and slope >= 0:
        return intercept, slope
    xx = math.fsum(a * a for a in x)
    through_origin = (
        max(0.0, math.fsum(a * b for a, b in zip(x, y, strict=True)) / xx) if xx else 0.0
    )
    candidates = [(0.0, through_origin), (max(0.0, y_mean), 0.0)]
    return min(
        candidates,
        key=lambda c: math.fsum((b - c[0] - c[1] * a) ** 2 for a, b in zip(x, y, strict=True)),
    )


MAX_SAMPLE_BYTES = 1 << 40  # a transfer claiming more bytes than this is refused (1 TiB)
MAX_SAMPLE_SECONDS = 86_400.0  # and one claiming to have lasted more than a day


def check_sample(nbytes: object, seconds: object, what: str) -> tuple[int, float]:
    """(bytes, seconds) of one transfer, range-checked: an int in [0, MAX_SAMPLE_BYTES] and a
    finite float in [0, MAX_SAMPLE_SECONDS]. Samples may come from the network: they are
    checked before any arithmetic, and errors quote them shortened."""
    if (
        isinstance(nbytes, bool)
        or not isinstance(nbytes, int | np.integer)
        or not (0 <= nbytes <= MAX_SAMPLE_BYTES)
    ):
        raise ValueError(
            f"{what}: bytes is {quoted(nbytes)}; expected an int in [0, {MAX_SAMPLE_BYTES}]"
        )
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float | np.floating)
        or not (math.isfinite(seconds) and 0 <= seconds <= MAX_SAMPLE_SECONDS)
    ):
        raise ValueError(
            f"{what}: seconds is {quoted(seconds)}; expected a finite number in "
            f"[0, {MAX_SAMPLE_SECONDS:g}]"
        )
    return int(nbytes), float(seconds)


def fit_link(samples: Sequence[tuple[int, float]]) -> LinkCost:
    """Fit alpha (latency) and beta (seconds per byte) to (bytes, seconds) of real transfers.

    Every sample is range-checked (`check_sample`); at least two distinct sizes are needed."""
    if len(samples) < 2:
        raise ValueError(
            f"fit_link: got {len(samples)} sample(s); expected (bytes, seconds) "
            "pairs of at least 2 distinct sizes"
        )
    checked = [check_sample(*_pair(sample), "fit_link") for sample in samples]
    sizes, seconds = zip(*checked, strict=True)
    latency, per_byte = fit_line(sizes, seconds, "fit_link")
    return LinkCost(latency, per_byte)


MAX_STEP_COLLECTIVES = 1 << 20  # collectives of one step at most


def fit_link_totals(steps: Sequence[tuple[int, int, float]]) -> LinkCost:
    """Alpha and beta from whole steps: (collectives, bytes, seconds) of each, where seconds is
    the step's communication time summed over its collectives, fitted as
    seconds = alpha * collectives + beta * bytes (least squares, both >= 0).

    Why: a collective issued inside a training step costs more than one of an idle link timed
    back to back (a thread wake-up, cores shared with the backward, ...); summing over a
    step prices that overhead per collective. Steps of at least two plans whose
    collectives-to-bytes ratios differ are needed (e.g. one group per tensor and one group of
    all); every field is range-checked (`check_sample`, collectives in [1, 2^20])."""
    if len(steps) < 2:
        raise ValueError(
            f"fit_link_totals: got {len(steps)} step(s); expected (collectives, bytes, "
            "seconds) of at least 2 steps"
        )
    rows = []
    for step in steps:
        if not isinstance(step, tuple | list) or len(step) != 3:
            raise ValueError(
                f"fit_link_totals: step {quoted(step)} is not (collectives, bytes, seconds)"
            )
        count = step[0]
        if (
            isinstance(count, bool)
            or not isinstance(count, int | np.integer)
            or not 1 <= count <= MAX_STEP_COLLECTIVES
        ):
            raise ValueError(
                f"fit_link_totals: collectives is {quoted(count)}; expected an int in "
                f"[1, {MAX_STEP_COLLECTIVES}]"
            )
        rows.append((int(count), *check_sample(step[1], step[2], "fit_link_totals")))
    design = np.array([(c, b) for c, b, _ in rows], dtype=float)
    seconds = np.array([s for _, _, s in rows])
    if np.linalg.matrix_rank(design / design.max(axis=0).clip(min=1.0)) < 2:
        raise ValueError(
            "fit_link_totals: every step has the same ratio of collectives to bytes; expected "
            "steps of plans with different numbers of groups to separate alpha from beta"
        )
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if alpha < 0 or beta < 0:  # one coefficient alone, the better of the two faces
        faces = []
        for column in range(2):
            x = design[:, column]
            coefficient = max(0.0, float(x @ seconds) / float(x @ x)) if x @ x > 0 else 0.0
            pair = (coefficient, 0.0) if column == 0 else (0.0, coefficient)
            faces.append((float(np.sum((seconds - design @ np.array(pair)) ** 2)), pair))
        alpha, beta = min(faces)[1]
    return LinkCost(float(alpha), float(beta))


def _pair(sample: object) -> tuple[object, object]:
    if not isinstance(sample, tuple | list) or len(sample) != 2:
        raise ValueError(f"fit_link: sample {quoted(sample)} is not a (bytes, seconds) pair")
    return sample[0], sample[1]


class TransferLog:
    """The last `per_link` (bytes, seconds) transfers of each link, fitted on demand.

    A peer records every transfer as it happens (`record`) and asks for a link's alpha-beta fit
    when it plans (`fit`). Memory is bounded: a deque of at most `per_link` samples per link and
    at most `max_links` links (a peer's neighbours; one more is refused). Old samples fall out,
    so the fit follows a link whose speed changes. Pure bookkeeping: no clock, no networking.
    """

    def __init__(self, per_link: int = 256, max_links: int = 4096) -> None:
        for key, value, high in (
            ("per_link", per_link, 1 << 20),
            ("max_links", max_links, 1 << 20),
        ):
            checked_integer(f"TransferLog: {key}", value, 2, high)
        self.per_link = per_link
        self.max_links = max_links
        self._samples: dict[Hashable, deque[tuple[int, float]]] = {}

    def record(self, link: Hashable, nbytes: int, seconds: float) -> None:
        """Add one transfer of `nbytes` bytes that took `seconds` on `link` (range-checked)."""
        sample = check_sample(nbytes, seconds, f"transfer on link {quoted(link)}")
        samples = self._samples.get(link)
        if samples is None:
            if len(self._samples) >= self.max_links:
                raise ValueError(
                    f"TransferLog: link {quoted(link)} would be link "
                    f"{len(self._samples) + 1}; expected at most {self.max_links}"
                )
            samples = self._samples[link] = deque(maxlen=self.per_link)
        samples.append(sample)

    def links(self) -> list[Hashable]:
        """The links with at least one sample, in the order they were first seen."""
        return list(self._samples)

    def samples(self, link: Hashable) -> list[tuple[int, float]]:
        """The samples kept for `link`, oldest first (empty if none)."""
        return list(self._samples.get(link, ()))

    def fit(self, link: Hashable, latency_s: float | None = None) -> LinkCost:
        """The alpha-beta fit of `link`'s kept samples.

        With two or more distinct sizes, `fit_link`. A gossip link often carries one size only,
        which cannot separate latency from bandwidth: then `latency_s` (e.g. a fit of another
        link, or a handshake's round trip) is taken as known and the per-byte cost is the mean
        of (seconds - latency_s) / bytes; without it, ValueError.
        """
        samples = self.samples(link)
        if not samples:
            raise ValueError(f"TransferLog: no transfers recorded on link {quoted(link)}")
        sizes = {nbytes for nbytes, _ in samples}
        if len(sizes) >= 2:
            return fit_link(samples)
        if latency_s is None:
            raise ValueError(
                f"TransferLog: link {quoted(link)} carried one size only "
                f"({next(iter(sizes))} bytes); pass latency_s to fit the per-byte "
                "cost, or record transfers of another size"
            )
        _non_negative("TransferLog.fit", latency_s=latency_s)
        nbytes = next(iter(sizes))
        mean_s = statistics.fmean(seconds for _, seconds in samples)
        per_byte = max(0.0, mean_s - latency_s) / nbytes if nbytes > 0 else 0.0
        return LinkCost(min(latency_s, mean_s) if nbytes > 0 else mean_s, per_byte)


MAX_MEASURED_NUMEL = 1 << 28  # elements of one timed buffer at most (1 GiB of float32)
MAX_REPEATS = 1000


def _check_repeats(repeats: object, what: str) -> None:
    if (
        isinstance(repeats, bool)
        or not isinstance(repeats, int)
        or not (1 <= repeats <= MAX_REPEATS)
    ):
        raise ValueError(
            f"{what}: repeats is {quoted(repeats)}; expected an int in [1, {MAX_REPEATS}]"
        )


def measure_compressor(
    spec: str, sizes: Sequence[int], repeats: int = 5, seed: int = 0
) -> CompressorCost:
    """Time compress + decompress of the real compressor `spec` on this machine and fit a line.

    For each size (at least two distinct, each in [1, MAX_MEASURED_NUMEL]): one untimed warm-up,
    then the median of `repeats` timed round trips of a standard-normal tensor through
    `parse_spec(spec).compress` and `.decompress`.
    """
    what = f"measure_compressor({quoted(spec)})"
    _check_repeats(repeats, what)
    for size in sizes:
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not (1 <= size <= MAX_MEASURED_NUMEL)
        ):
            raise ValueError(
                f"{what}: size {quoted(size)}; expected ints in [1, {MAX_MEASURED_NUMEL}]"
            )
    compressor = parse_spec(spec)
    generator = torch.Generator().manual_seed(seed)
    timings: list[float] = []
    for index, size in enumerate(sizes):
        tensor = torch.randn(size, generator=generator)
        ctx = CompressionContext(seed=seed, sender=0, receiver=1, round=0, tensor_index=index)
        runs = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            compressor.decompress(compressor.compress(tensor, ctx), ctx)
            runs.append(time.perf_counter() - start)
        timings.append(statistics.median(runs[1:]))
    fixed, per_element = fit_line(sizes, timings, what)
    return CompressorCost(fixed, per_element)


def measure_seconds(step: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of `repeats` calls of `step` after one untimed warm-up call: a peer's
    local compute per round (one training step), or any other per-round cost."""
    _check_repeats(repeats, "measure_seconds")
    step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


MAX_COMPRESSORS = 64  # compressor specs one cost model prices at most
MAX_CONTENTION = 4.0  # communication beside the backward at a fifth of its speed, at most
MAX_SPEC_CHARS = 200  # characters of one compressor spec at most


def _check_spec(spec: object) -> None:
    """A compressor spec is a short string: checked before parse_spec sees (and echoes) it."""
    if not isinstance(spec, str) or not 0 < len(spec) <= MAX_SPEC_CHARS:
        raise ValueError(
            f"compressor spec {quoted(spec)}: expected a string of 1 to {MAX_SPEC_CHARS} characters"
        )


@dataclass(frozen=True)
class CostModel:
    """What a plan costs on one peer: compressor costs by spec, the link, compute, and the mode.

    `compressors` maps compressor specs to their costs; a plan may only use specs listed here.
    `compute_s` is the forward + backward (gossip: local step) seconds of one iteration.
    `contention` (all-reduce): how much slower communication runs while the backward does,
    sharing its core (`overlapped_finish`); 0 where it has a core of its own.
    """

    compressors: Mapping[str, CompressorCost]
    link: LinkCost
    compute_s: float
    mode: Mode = "gossip"
    contention: float = 0.0
    _by_spec: dict[str, tuple[CompressorCost, WireSize]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _non_negative("CostModel", compute_s=self.compute_s)
        if not 0.0 <= self.contention <= MAX_CONTENTION:  # also refuses NaN
            raise ValueError(
                f"CostModel: contention {quoted(self.contention)}; expected 0 to {MAX_CONTENTION}"
            )
        if self.contention and self.mode != "allreduce":
            raise ValueError(
                f"CostModel: contention {self.contention:g} in {self.mode} mode; expected 0 "
                "(only all-reduce overlaps communication with the backward)"
            )
        if self.mode not in MODES:
            raise ValueError(f"CostModel: mode is {quoted(self.mode)}; expected one of {MODES}")
        if not 1 <= len(self.compressors) <= MAX_COMPRESSORS:
            raise ValueError(
                f"CostModel: {len(self.compressors)} compressor costs; expected 1 "
                f"to {MAX_COMPRESSORS} specs"
            )
        if not isinstance(self.link, LinkCost):
            raise ValueError(f"CostModel: link is {quoted(self.link)}; expected a LinkCost")
        by_spec = {}
        for spec, cost in self.compressors.items():
            _check_spec(spec)
            if not isinstance(cost, CompressorCost):
                raise ValueError(
                    f"CostModel: cost of {quoted(spec)} is {quoted(cost)}; "
                    "expected a CompressorCost"
                )
            entry = (cost, WireSize.of(spec))
            by_spec[spec] = entry
            by_spec[parse_spec(spec).spec] = entry
        object.__setattr__(self, "_by_spec", by_spec)

    def costs_of(self, spec: str) -> tuple[CompressorCost, WireSize]:
        """The compression cost and wire size of `spec`; ValueError if the model lacks it."""
        _check_spec(spec)
        entry = self._by_spec.get(spec)
        if entry is None:
            entry = self._by_spec.get(parse_spec(spec).spec)
        if entry is None:
            known = ", ".join(sorted(map(str, self.compressors)))
            raise ValueError(
                f"cost model has no costs for compressor {quoted(spec)}; measured: {known}"
            )
        return entry


def predict_iteration(
    tensors: Sequence[TensorInfo], groups: Sequence[TensorGroup], costs: CostModel
) -> float:
    """Predicted seconds of one iteration of plan `groups` under `costs`.

    With m_g the elements of group g, c_g its compression cost and b_g its wire bytes:

    gossip:    T = compute_s + sum_g c_g(m_g) + alpha + beta * sum_g b_g(m_g)
               (every group compressed after the local step, then one envelope per neighbour).
    allreduce: groups in the order they become ready (r_g = latest ready_at of its tensors);
               one communication worker runs each group's compression then its collective:
               end_g = F(max(r_g, end_{g-1}), c_g(m_g) + alpha + beta * b_g(m_g)), end_0 = 0;
               T = max(compute_s, end_last), with F `overlapped_finish` (start + duration
               when contention is 0).
    """
    check_cover(groups, [t.name for t in tensors])
    info = {t.name: t for t in tensors}
    parts = []
    for group in groups:
        compression, wire = costs.costs_of(group.compressor)
        numel = sum(info[name].numel for name in group.names)
        ready = max(info[name].ready_at for name in group.names)
        parts.append((ready, compression.seconds(numel), wire.bytes(numel)))
    link = costs.link
    if costs.mode == "gossip":
        total_bytes = sum(nbytes for _, _, nbytes in parts)
        return costs.compute_s + sum(c for _, c, _ in parts) + link.seconds(total_bytes)
    end = 0.0
    for ready, compression_s, nbytes in sorted(parts, key=lambda part: part[0]):
        duration = compression_s + link.seconds(nbytes)
        end = float(overlapped_finish(max(ready, end), duration, costs.compute_s, costs.contention))
    return max(costs.compute_s, end)


def overlapped_finish(
    start: float | np.ndarray,
    duration: float | np.ndarray,
    backward_end: float,
    contention: float,
) -> float | np.ndarray:
    """When communication of `duration` seconds (alone) that starts at `start` ends, if it runs
    1 + `contention` times slower until `backward_end` (sharing the backward's core) and at full
    speed after. Non-decreasing in `start`, so the planners' dynamic programme stays exact.
    Elementwise over arrays."""
    if contention == 0.0:
        return start + duration
    slowed = start + duration * (1.0 + contention)
    crossing = backward_end + duration - (backward_end - start) / (1.0 + contention)
    return np.where(
        start >= backward_end, start + duration, np.where(slowed <= backward_end, slowed, crossing)
    )
