"""Sparsifying codecs: a few (index, value) pairs travel, the rest decode to zero.

k = max(1, ceil(ratio * d)) clamped to d (0 for an empty tensor), with ratio * d rounded to 9
significant digits first so that float noise cannot add an element. Indices are int32 (d < 2**31)
and always strictly increasing on the wire; decoders refuse anything else.

Wire formats (little-endian):
- topk:ratio=r: k float32 values, then k int32 indices: 8k bytes. Exactly the k entries of
  largest |x|; among equal magnitudes at the cut, the lowest indices win.
- randomk:ratio=r,unbiased=b: k float32 values only, 4k bytes: both ends draw the same k
  indices without replacement from ctx (on the CPU, whatever the tensor's device). With
  unbiased=true the values are scaled by d / k, making E[decoded] = x.
- dgc:ratio=r: int32 count n, then k value slots (float32), then k index slots (int32):
  4 + 8k bytes. The |x| threshold is estimated from a random sample (1% of the entries, at
  least 1000, all of them for small tensors): the entries at or above it are sent, the k largest
  if more than k pass, and unused slots (n < k) are zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy
import torch

from gossipcomp.compress import kernels
from gossipcomp.compress.base import CompressionContext, PayloadError
from gossipcomp.compress.codec import (
    Codec,
    PayloadReader,
    PayloadWriter,
    check_finite,
    float_ratio_count,
)

# topk: sample enough entries that ~256 of them are expected above the cut, and aim the
# sampled threshold at 1.5k candidates (about 10 standard deviations of margin above k).
TOPK_SAMPLE_HITS = 256
TOPK_MIN_SAMPLE = 8192
TOPK_MARGIN = 1.5
DGC_SAMPLE_FRACTION = 0.01
DGC_MIN_SAMPLE = 1000


def largest(
    flat: torch.Tensor,
    k: int,
    candidates: torch.Tensor | None = None,
    use_numpy: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending int64 indices and float32 values of the k entries of largest |x|.

    `candidates` (ascending indices) must contain every entry whose |x| reaches the k-th largest;
    None means all entries. Ties at the cut go to the lowest indices, and NaN counts as largest,
    so exactly k entries come back.
    """
    if kernels.use_numpy_for(flat, use_numpy):
        chosen = numpy.arange(flat.numel()) if candidates is None else candidates.numpy()
        values = kernels.take(flat, chosen)
        if chosen.size > k:
            magnitude = numpy.abs(values)
            magnitude[numpy.isnan(magnitude)] = numpy.inf
            cut = numpy.partition(magnitude, chosen.size - k)[chosen.size - k]
            above, at_cut = magnitude > cut, magnitude == cut
            keep = above | (at_cut & (numpy.cumsum(at_cut) <= k - numpy.count_nonzero(above)))
            chosen, values = chosen[keep], values[keep]
        return torch.from_numpy(chosen), torch.from_numpy(values)
    if candidates is None:
        candidates = torch.arange(flat.numel(), device=flat.device)
    values = flat[candidates].to(torch.float32)
    if candidates.numel() == k:
        return candidates, values
    magnitude = values.abs().nan_to_num_(nan=math.inf)
    cut = torch.topk(magnitude, k, sorted=False).values.min()
    above, at_cut = magnitude > cut, magnitude == cut
    keep = above | (at_cut & (torch.cumsum(at_cut, 0) <= k - above.sum()))
    return candidates[keep], values[keep]


def gather(
    flat: torch.Tensor, indices: torch.Tensor, use_numpy: bool | None = None
) -> torch.Tensor:
    """float32 values of flat at `indices` (on flat's device)."""
    if kernels.use_numpy_for(flat, use_numpy):
        return torch.from_numpy(kernels.take(flat, indices.numpy()))
    return flat[indices.to(flat.device)].to(torch.float32)


def _sample_threshold(
    flat: torch.Tensor, sample_size: int, rank: int, generator: torch.Generator
) -> float:
    """The rank-th largest |x| among `sample_size` entries drawn at random (with replacement)."""
    positions = torch.randint(
        0, flat.numel(), (sample_size,), generator=generator, device=flat.device
    )
    sample = gather(flat, positions)
    if kernels.use_numpy_for(flat):
        magnitude = numpy.abs(sample.numpy())
        return float(numpy.partition(magnitude, sample_size - rank)[sample_size - rank])
    return float(torch.topk(sample.abs(), rank, sorted=False).values.min())


def _write_sparse(
    out: PayloadWriter, slots: int, indices: torch.Tensor, values: torch.Tensor
) -> None:
    """k value slots then k index slots; entries past len(indices) stay zero."""
    n = indices.numel()
    value_slots = out.section(torch.float32, slots)
    index_slots = out.section(torch.int32, slots)
    if values.device.type == "cpu" and indices.device.type == "cpu":
        value_slots.numpy()[:n] = values.numpy()
        index_slots.numpy()[:n] = indices.numpy()
    else:
        value_slots[:n].copy_(values)
        index_slots[:n].copy_(indices)
    value_slots.numpy()[n:] = 0
    index_slots.numpy()[n:] = 0


def _check_indices(indices: torch.Tensor, numel: int, codec: str) -> None:
    """Refuse indices outside [0, numel) or not strictly increasing (which rules out duplicates)."""
    array = indices.numpy()
    if array.size == 0:
        return
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= numel:
        bad = low if low < 0 else high
        raise PayloadError(f"{codec} payload index {bad}: expected in [0, {numel})")
    steps = array[1:] > array[:-1]
    if not steps.all():
        values, counts = numpy.unique(array, return_counts=True)
        if values.size < array.size:
            raise PayloadError(
                f"{codec} payload indices: expected unique, got index {int(values[counts > 1][0])} "
                f"{int(counts.max())} times"
            )
        first = int(numpy.flatnonzero(~steps)[0])
        raise PayloadError(
            f"{codec} payload indices: expected strictly increasing, got {int(array[first])} "
            f"before {int(array[first + 1])} at position {first}"
        )


def _scatter(
    numel: int, indices: torch.Tensor, values: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """A fresh float32 tensor of zeros on `device` with values at indices (CPU inputs)."""
    if device.type == "cpu":
        out = numpy.zeros(numel, dtype=numpy.float32)  # calloc: the kernel hands zeroed pages
        out[indices.numpy()] = values.numpy()
        return torch.from_numpy(out)
    result = torch.zeros(numel, dtype=torch.float32, device=device)
    if indices.numel():
        result.index_copy_(0, indices.to(device=device, dtype=torch.int64), values.to(device))
    return result


def largest_first_step(ratio: float) -> float:
    """Choco's step for top-k and DGC: 10 x the fraction kept, at most 0.45.

    The Choco paper's step for top-1% on an 8-ring is 0.0375; on digits it reached 0.9545 after
    600 rounds where 0.1 reached 0.970 (docs/benchmarks.md).
    """
    return min(0.45, 10.0 * ratio)


@dataclass(frozen=True)
class _Sparsifier(Codec):
    """A codec that sends k = max(1, ceil(ratio * d)) entries (clamped to d) of d."""

    ratio: float = 0.01
    sparsifying: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in (0, 1], got {self.ratio}")

    def k(self, numel: int) -> int:
        return float_ratio_count(self.ratio, numel)


@dataclass(frozen=True)
class TopK(_Sparsifier):
    """Exact top-k by magnitude: k values and k indices (biased)."""

    name: ClassVar[str] = "topk"
    unbiased: ClassVar[bool] = False

    @property
    def consensus_step(self) -> float:
        return largest_first_step(self.ratio)

    def wire_bytes(self, numel: int) -> int:
        return 8 * self.k(numel)

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        k = self.k(flat.numel())
        indices, values = self.select(flat, k, ctx)
        _write_sparse(out, k, indices, values)

    def select(
        self, flat: torch.Tensor, k: int, ctx: CompressionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact top-k, found among candidates above a threshold sampled from ctx.

        The sample only decides how much work the exact selection does: the result is the same
        for every sample (if fewer than k entries pass, all entries become candidates).
        """
        numel = flat.numel()
        sample_size = max(TOPK_MIN_SAMPLE, math.ceil(TOPK_SAMPLE_HITS * numel / max(1, k)))
        if k == 0 or 2 * sample_size >= numel:
            return largest(flat, k)
        rank = min(sample_size, math.ceil(TOPK_MARGIN * k * sample_size / numel))
        threshold = _sample_threshold(flat, sample_size, rank, ctx.generator(flat.device))
        candidates = kernels.abs_at_least(flat, threshold)
        if candidates.numel() < k:
            return largest(flat, k)
        return largest(flat, k, candidates)

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        k = self.k(numel)
        values = payload.section(torch.float32, k)
        indices = payload.section(torch.int32, k)
        _check_indices(indices, numel, self.codec)
        check_finite(values, self.codec, "values")
        return _scatter(numel, indices, values, device)


def shared_indices(ctx: CompressionContext, numel: int, k: int) -> torch.Tensor:
    """k distinct indices in [0, numel), ascending, drawn uniformly from ctx on the CPU.

    Rule (both ends run it): a CPU generator seeded from ctx; when 4k > numel, the first k of
    randperm(numel); otherwise batches of k + k/8 + 16 randint draws, keeping each value's first
    occurrence in draw order, until k distinct values have appeared: the first k of them.
    """
    generator = ctx.generator("cpu")
    if k >= numel:
        return torch.arange(numel)
    if 4 * k > numel:
        return torch.randperm(numel, generator=generator)[:k].sort().values
    batch = k + k // 8 + 16
    draws = numpy.empty(0, dtype=numpy.int64)
    while True:
        more = torch.randint(0, numel, (batch,), generator=generator).numpy()
        draws = numpy.concatenate([draws, more])
        distinct, first_seen = numpy.unique(draws, return_index=True)
        if distinct.size >= k:
            cutoff = numpy.partition(first_seen, k - 1)[k - 1]
            return torch.from_numpy(distinct[first_seen <= cutoff])


@dataclass(frozen=True)
class RandomK(_Sparsifier):
    """Random-k: only the values of k shared random indices travel (unbiased when scaled)."""

    name: ClassVar[str] = "randomk"
    unbiased: bool = False  # scale the values by d / k so that E[decoded] = x
    summable: ClassVar[bool] = True  # both ends draw the same indices: values add up

    @property
    def contractive(self) -> bool:  # type: ignore[override]
        return not self.unbiased

    @property
    def consensus_step(self) -> float:
        # random entries carry less of a difference than the largest ones: smaller steps (a
        # consensus sweep diverged above about the ratio); unbiased: after the 1 / (1 + beta)
        # scaling
        return 0.1 if self.unbiased else min(0.3, 2.0 * self.ratio)

    def variance_bound(self, numel: int) -> float:
        """d / k - 1 when unbiased (values scaled by d / k), else 0."""
        k = self.k(numel)
        return numel / k - 1.0 if self.unbiased and k else 0.0

    def wire_bytes(self, numel: int) -> int:
        return 4 * self.k(numel)

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        numel, k = flat.numel(), self.k(flat.numel())
        values = gather(flat, shared_indices(ctx, numel, k))
        slots = out.section(torch.float32, k)
        scale = numel / k if self.unbiased and k else 1.0
        if values.device.type == "cpu":
            numpy.multiply(values.numpy(), numpy.float32(scale), out=slots.numpy())
        else:
            slots.copy_(values.mul_(scale))

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        k = self.k(numel)
        values = payload.section(torch.float32, k)
        check_finite(values, self.codec, "values")
        return _scatter(numel, shared_indices(ctx, numel, k), values, device)


@dataclass(frozen=True)
class DGC(_Sparsifier):
    """Deep Gradient Compression's sampled-threshold sparsification, in k fixed slots."""

    name: ClassVar[str] = "dgc"
    unbiased: ClassVar[bool] = False
    ratio: float = 0.001

    @property
    def consensus_step(self) -> float:
        return largest_first_step(self.ratio)

    def wire_bytes(self, numel: int) -> int:
        return 4 + 8 * self.k(numel)

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        numel, k = flat.numel(), self.k(flat.numel())
        count = out.section(torch.int32, 1)
        if k == 0:
            count.zero_()
            return
        sample_size = min(numel, max(DGC_MIN_SAMPLE, math.ceil(DGC_SAMPLE_FRACTION * numel)))
        rank = min(sample_size, math.ceil(k * sample_size / numel))
        if sample_size == numel:
            indices, values = largest(flat, k)  # the sample is everything: the threshold is exact
        else:
            threshold = _sample_threshold(flat, sample_size, rank, ctx.generator(flat.device))
            candidates = kernels.abs_at_least(flat, threshold)
            if candidates.numel() > k:
                indices, values = largest(flat, k, candidates)
            else:
                indices, values = candidates, gather(flat, candidates)
        count.fill_(indices.numel())
        _write_sparse(out, k, indices, values)

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        k = self.k(numel)
        count = int(payload.section(torch.int32, 1))
        if not 0 <= count <= k:
            raise PayloadError(f"dgc payload count: expected 0..{k} (the slots), got {count}")
        values = payload.section(torch.float32, k)
        indices = payload.section(torch.int32, k)
        if values.numpy()[count:].any() or indices.numpy()[count:].any():
            raise PayloadError(f"dgc payload slots past count {count}: expected zeros")
        _check_indices(indices[:count], numel, self.codec)
        check_finite(values[:count], self.codec, "values")
        return _scatter(numel, indices[:count], values[:count], device)
