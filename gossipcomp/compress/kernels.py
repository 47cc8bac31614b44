"""Element-wise passes shared by the codecs: numpy on the CPU, torch on other devices.

On the CPU a big tensor is cut into cache-sized spans (1 MiB of float32) handed out to
torch.get_num_threads() worker threads (numpy releases the GIL in its loops); set torch's thread
count to 1 to keep everything on the calling thread. Measured on the project's 2-core machine:
fresh 64 MiB temporaries cost more in page faults than the arithmetic, torch's CPU comparison
kernels run 4x slower than numpy's, and torch's OpenMP kernels stall for a scheduler tick (~7 ms)
per call when another process holds the second core, so hundreds of small torch calls are ruinous
where numpy's dynamically shared spans just slow down. Other devices take each tensor whole with
torch ops. Both paths compute the same values (tested on the CPU by forcing the torch path); only
the random stream of `stochastic_levels` differs between them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy
import torch

from gossipcomp.compress import bitpack

CPU_SPAN = 1 << 18  # elements: 1 MiB of float32, a multiple of 8 so spans start on whole bytes
MIN_SPANS_PER_THREAD = 2  # below this, threads cost more than they save
T = TypeVar("T")


def use_numpy_for(tensor: torch.Tensor, use_numpy: bool | None = None) -> bool:
    """The numpy path for CPU tensors unless `use_numpy` says otherwise (tests force both)."""
    return tensor.device.type == "cpu" if use_numpy is None else use_numpy


def spans(numel: int) -> Iterator[tuple[int, int]]:
    """[start, end) ranges of CPU_SPAN elements covering 0..numel."""
    for start in range(0, numel, CPU_SPAN):
        yield start, min(numel, start + CPU_SPAN)


def map_spans(numel: int, work: Callable[[int, int], T]) -> list[T]:
    """work(start, end) for every span, on up to torch.get_num_threads() threads; in span order.

    `work` must only write its own part of any shared output.
    """
    ranges = list(spans(numel))
    threads = min(torch.get_num_threads(), len(ranges) // MIN_SPANS_PER_THREAD)
    if threads <= 1:
        return [work(start, end) for start, end in ranges]
    with ThreadPoolExecutor(threads, thread_name_prefix="gossipcomp-compress") as pool:
        return list(pool.map(lambda r: work(*r), ranges))


def as_numpy(chunk: torch.Tensor) -> numpy.ndarray:
    """A CPU float tensor as a float32 or float64 numpy array (half types widened by numpy)."""
    if chunk.dtype in (torch.float32, torch.float64):
        return chunk.contiguous().numpy()
    if chunk.dtype == torch.float16:
        return chunk.contiguous().numpy().astype(numpy.float32)
    if chunk.dtype == torch.bfloat16:  # the upper half of a float32, exactly
        bits = chunk.contiguous().view(torch.int16).numpy().view(numpy.uint16)
        return (bits.astype(numpy.uint32) << numpy.uint32(16)).view(numpy.float32)
    return chunk.to(torch.float32).numpy()


def _sum(array: numpy.ndarray) -> float:
    """Pairwise float32 sum, redone in float64 when float32 overflows."""
    with numpy.errstate(over="ignore", invalid="ignore"):
        total = float(array.sum())
    return total if math.isfinite(total) else float(array.sum(dtype=numpy.float64))


@dataclass(frozen=True)
class SignSums:
    """What one pass over x gathers besides its sign bits."""

    negatives: int  # entries with x < 0
    positive_sum: float  # sum of the entries > 0
    negative_sum: float  # sum of the entries < 0

    @property
    def abs_sum(self) -> float:
        return self.positive_sum - self.negative_sum


def take(flat: torch.Tensor, indices: numpy.ndarray) -> numpy.ndarray:
    """float32 values of the CPU tensor `flat` at `indices`, widening half types after the gather."""
    if flat.dtype == torch.bfloat16:
        bits = flat.contiguous().view(torch.int16).numpy().view(numpy.uint16)[indices]
        return (bits.astype(numpy.uint32) << numpy.uint32(16)).view(numpy.float32)
    if flat.dtype in (torch.float32, torch.float64, torch.float16):
        return flat.contiguous().numpy()[indices].astype(numpy.float32, copy=False)
    return as_numpy(flat)[indices].astype(numpy.float32, copy=False)


def sign_pass(
    flat: torch.Tensor, plane: torch.Tensor | None, use_numpy: bool | None = None
) -> SignSums:
    """Write the x < 0 bits of `flat` into the CPU uint8 `plane` (None: no bits) and sum each
    side, in one pass.

    Span sums are float32 (pairwise; float64 where float32 overflows), accumulated exactly.
    """
    if not use_numpy_for(flat, use_numpy):
        mask = flat < 0
        if plane is not None:
            plane.copy_(bitpack.pack(mask, 1))
        return SignSums(
            int(mask.sum()),
            float(flat.clamp(min=0).sum(dtype=torch.float64)),
            float(flat.clamp(max=0).sum(dtype=torch.float64)),
        )
    target = None if plane is None else plane.numpy()

    def work(start: int, end: int) -> tuple[int, float, float]:
        chunk = as_numpy(flat[start:end])
        mask = numpy.less(chunk, 0)
        if target is not None:
            target[start // 8 : bitpack.plane_bytes(end)] = bitpack.pack_numpy(mask, 1, True)[0]
        side = numpy.maximum(chunk, 0)
        positive = _sum(side)
        negative = _sum(numpy.minimum(chunk, 0, out=side))
        return int(numpy.count_nonzero(mask)), positive, negative

    parts = map_spans(flat.numel(), work)
    return SignSums(
        sum(p[0] for p in parts), math.fsum(p[1] for p in parts), math.fsum(p[2] for p in parts)
    )


def l2_norm(flat: torch.Tensor, use_numpy: bool | None = None) -> float:
    """||x||_2 (span sums of squares accumulated in float64)."""
    if not use_numpy_for(flat, use_numpy):
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64))

    def work(start: int, end: int) -> float:
        chunk = as_numpy(flat[start:end])
        with numpy.errstate(over="ignore", invalid="ignore"):
            total = float(numpy.dot(chunk, chunk))
        if not math.isfinite(total):  # squares beyond float32: redo this span in float64
            wide = chunk.astype(numpy.float64)
            total = float(numpy.dot(wide, wide))
        return total

    return math.sqrt(math.fsum(map_spans(flat.numel(), work)))


def abs_max(flat: torch.Tensor, use_numpy: bool | None = None) -> float:
    """max |x_i| (0 for an empty tensor; NaN when x holds NaN)."""
    if flat.numel() == 0:
        return 0.0
    if not use_numpy_for(flat, use_numpy):
        low, high = torch.aminmax(flat)
        return float(torch.maximum(-low, high))

    def work(start: int, end: int) -> float:
        chunk = as_numpy(flat[start:end])
        return float(numpy.maximum(-chunk.min(), chunk.max()))

    parts = map_spans(flat.numel(), work)
    return math.nan if any(math.isnan(p) for p in parts) else max(parts)


def stochastic_levels(
    flat: torch.Tensor,
    factor: float | PerSegment,
    levels: int,
    seed_source: torch.Generator | int,
    planes: torch.Tensor,
) -> None:
    """Write the sign plane and level planes of l_i = min(levels, floor(factor |x_i| + u_i)).

    u_i uniform in [0, 1), so E[l_i] = factor |x_i| wherever that is <= levels; `factor` is one
    number, or one per segment of a merged buffer (`PerSegment`). `seed_source`
    picks the path: a torch.Generator on flat's device for torch ops, or an int seed for the
    numpy path on a CPU tensor, where each span draws from its own PCG64 stream seeded with
    (seed, span start), so the result does not depend on which thread ran it (numpy's raw bits
    cost a third of torch.rand here); there u_i sits on a 2**-23 grid. `planes` is the CPU uint8 (1 + bits, P)
    destination: the sign plane (set bit: x < 0), then the level bits.
    """
    numel = flat.numel()
    bits = bitpack.bits_for(levels + 1)
    if isinstance(seed_source, torch.Generator):
        uniform = torch.rand(numel, generator=seed_source, device=flat.device)
        scale = factor.expand(flat.device) if isinstance(factor, PerSegment) else factor
        level = flat.abs().to(torch.float32).mul_(scale).add_(uniform).floor_()
        level = level.clamp_(max=levels).to(torch.uint8)
        planes[0].copy_(bitpack.pack(flat < 0, 1))
        planes[1:].copy_(bitpack.pack(level, bits).view(bits, -1))
        return
    target = planes.numpy()

    def work(start: int, end: int) -> None:
        chunk = as_numpy(flat[start:end])
        if isinstance(factor, PerSegment):
            factor32 = factor.segments.repeat(factor.values, start, end)
        else:
            factor32 = numpy.float32(factor)
        scaled = numpy.multiply(numpy.abs(chunk), factor32, dtype=numpy.float32)
        # 1 + u with u uniform on a 2**-23 grid in [0, 1): 23 random bits under a float32 exponent
        raw = numpy.random.PCG64([seed_source, start]).random_raw((end - start + 1) // 2)
        one_plus_u = raw.view(numpy.uint32)[: end - start]
        numpy.right_shift(one_plus_u, numpy.uint32(9), out=one_plus_u)
        numpy.bitwise_or(one_plus_u, numpy.uint32(0x3F800000), out=one_plus_u)
        scaled += one_plus_u.view(numpy.float32)
        level = scaled.astype(numpy.uint8)  # floor(r + 1 + u) >= 1: truncation is the floor
        numpy.subtract(level, numpy.uint8(1), out=level)
        numpy.minimum(level, numpy.uint8(levels), out=level)
        columns = slice(start // 8, bitpack.plane_bytes(end))
        target[:1, columns] = bitpack.pack_numpy(numpy.less(chunk, 0), 1, True)
        target[1:, columns] = bitpack.pack_numpy(level, bits)

    map_spans(numel, work)


def multiply_levels(
    values: torch.Tensor, level_planes: torch.Tensor, bits: int, use_numpy: bool | None = None
) -> int:
    """values *= the codes in `level_planes` (CPU uint8, bits x P); return the largest code."""
    numel = values.numel()
    if not use_numpy_for(values, use_numpy):
        level = bitpack.unpack(level_planes.reshape(-1).to(values.device), bits, numel)
        values.mul_(level)
        return int(level.max()) if numel else 0
    planes, target = level_planes.numpy(), values.numpy()

    def work(start: int, end: int) -> int:
        level = bitpack.unpack_numpy(planes[:, start // 8 : bitpack.plane_bytes(end)], end - start)
        numpy.multiply(target[start:end], level, out=target[start:end])
        return int(level.max())

    return max(map_spans(numel, work), default=0)


def abs_at_least(
    flat: torch.Tensor, threshold: float, use_numpy: bool | None = None
) -> torch.Tensor:
    """Ascending int64 indices i with |x_i| >= threshold (NaN never qualifies)."""
    if not use_numpy_for(flat, use_numpy):
        return torch.nonzero(flat.abs() >= threshold).view(-1)

    def work(start: int, end: int) -> numpy.ndarray:
        return numpy.flatnonzero(numpy.abs(as_numpy(flat[start:end])) >= threshold) + start

    parts = map_spans(flat.numel(), work)
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    return torch.from_numpy(numpy.concatenate(parts))


def expand_plane(
    plane: torch.Tensor,
    numel: int,
    clear: float,
    set_: float,
    device: torch.device,
    use_numpy: bool | None = None,
) -> torch.Tensor:
    """bitpack.decode_plane, with the CPU's table lookups spread over spans and threads."""
    if not (device.type == "cpu" if use_numpy is None else use_numpy):
        return bitpack.decode_plane(plane, numel, clear, set_, device)
    table = bitpack.plane_table(clear, set_).numpy()
    out = torch.empty(bitpack.plane_bytes(numel) * 8, dtype=torch.float32)
    source, target = plane.numpy(), out.numpy().reshape(-1, 8)

    def work(start: int, end: int) -> None:
        rows = slice(start // 8, bitpack.plane_bytes(end))
        numpy.take(table, source[rows], axis=0, out=target[rows], mode="clip")

    map_spans(numel, work)
    return out[:numel].to(device)


def add_into(target: torch.Tensor, source: torch.Tensor, alpha: float = 1.0) -> None:
    """target += alpha * source in place (target float32, same shape and device)."""
    if not (use_numpy_for(target) and target.is_contiguous()):
        target.add_(source.reshape(target.shape), alpha=alpha)
        return
    flat_target, flat_source = target.view(-1), source.reshape(-1)
    factor = numpy.float32(alpha)

    def work(start: int, end: int) -> None:
        out = flat_target[start:end].numpy()
        addend = as_numpy(flat_source[start:end])
        if alpha == 1.0:
            numpy.add(out, addend, out=out, casting="same_kind")
        elif alpha == -1.0:
            numpy.subtract(out, addend, out=out, casting="same_kind")
        else:
            numpy.add(out, numpy.multiply(addend, factor), out=out, casting="same_kind")

    map_spans(flat_target.numel(), work)


# --- merged buffers: statistics and scales per segment ---------------------------------------


class Segments:
    """Consecutive runs of a flat buffer: the tensors of a merged group, in order.

    Codecs that keep a statistic per segment (compress/segmented.py) take it on each segment's
    view with their one-tensor kernel (`views`), and expand per span as the other kernels do:
    `overlapping` says which segments a span touches and how many of its elements each holds,
    so no pass needs a temporary of the whole buffer.
    """

    def __init__(self, numels: Sequence[int]) -> None:
        sizes = numpy.asarray([operator.index(n) for n in numels], dtype=numpy.int64)
        if sizes.size == 0 or (sizes < 0).any():
            raise ValueError(f"segments: expected one or more sizes >= 0, got {list(numels)[:8]}")
        self.numels = sizes
        self.ends = numpy.cumsum(sizes)
        self.starts = self.ends - sizes
        self.numel = int(self.ends[-1])

    def __len__(self) -> int:
        return int(self.numels.size)

    def overlapping(self, start: int, end: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """Indices of the non-empty segments that [start, end) touches, in order, and how many
        of their elements lie in it (together end - start)."""
        first = int(numpy.searchsorted(self.ends, start, side="right"))
        last = int(numpy.searchsorted(self.starts, end, side="left"))
        ids = numpy.arange(first, max(first, last))
        counts = numpy.minimum(self.ends[ids], end) - numpy.maximum(self.starts[ids], start)
        keep = counts > 0
        return ids[keep], counts[keep]

    def repeat(self, values: numpy.ndarray, start: int, end: int) -> numpy.ndarray:
        """values[segment of i] for every element i in [start, end)."""
        ids, counts = self.overlapping(start, end)
        return numpy.repeat(values[ids], counts)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each segment of the 1-D `flat` as a view (no copy)."""
        if flat.numel() != self.numel:
            raise ValueError(f"segments cover {self.numel} elements, got {flat.numel()}")
        return list(torch.split(flat, self.numels.tolist()))

    def ids(self, device: torch.device) -> torch.Tensor:
        """The segment of every element, as an int64 tensor on `device` (torch path)."""
        sizes = torch.from_numpy(self.numels).to(device)
        return torch.repeat_interleave(torch.arange(len(self), device=device), sizes)


@dataclass(frozen=True)
class PerSegment:
    """One float32 value per segment of a merged buffer (a factor, a scale)."""

    segments: Segments
    values: numpy.ndarray  # float32, one per segment

    def expand(self, device: torch.device) -> torch.Tensor:
        """The value of every element's segment, on `device` (torch path)."""
        values = torch.from_numpy(numpy.ascontiguousarray(self.values, numpy.float32))
        return values.to(device)[self.segments.ids(device)]


def expand_plane_segments(
    plane: torch.Tensor,
    segments: Segments,
    clear: numpy.ndarray,
    set_: numpy.ndarray,
    device: torch.device,
    use_numpy: bool | None = None,
) -> torch.Tensor:
    """Like `expand_plane` with a pair of values per segment: element i becomes clear[s] where
    its bit is 0 and set_[s] where it is 1, s its segment (a fresh float32 tensor)."""
    numel = segments.numel
    clear32 = numpy.asarray(clear, dtype=numpy.float32)
    set32 = numpy.asarray(set_, dtype=numpy.float32)
    if not (device.type == "cpu" if use_numpy is None else use_numpy):
        bits = bitpack.unpack(plane.to(device), 1, numel).bool()
        chosen = PerSegment(segments, set32).expand(device)
        return torch.where(bits, chosen, PerSegment(segments, clear32).expand(device))
    # products with 0, 1 or -1 are exact, so each value is exactly its segment's clear or set
    # value (numpy's masked selections are several times slower than this arithmetic)
    opposite = bool(numpy.array_equal(set32, -clear32))
    table = bitpack.plane_table(1.0, -1.0 if opposite else 0.0).numpy()
    out = torch.empty(bitpack.plane_bytes(numel) * 8, dtype=torch.float32)
    source, target = plane.numpy(), out.numpy()

    def work(start: int, end: int) -> None:
        rows = slice(start // 8, bitpack.plane_bytes(end))
        numpy.take(table, source[rows], axis=0, out=target.reshape(-1, 8)[rows], mode="clip")
        values = target[start:end]  # +-1 (opposite) or 1 where the bit is clear, 0 where set
        clear_values = segments.repeat(clear32, start, end)
        if opposite:
            numpy.multiply(values, clear_values, out=values)
            return
        set_part = segments.repeat(set32, start, end)
        numpy.multiply(set_part, numpy.subtract(1, values), out=set_part)
        numpy.multiply(values, clear_values, out=values)
        numpy.add(values, set_part, out=values)

    map_spans(numel, work)
    return out[:numel].to(device)
