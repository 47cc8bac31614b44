"""Shared machinery of the built-in compressors: payload writing and reading, the Codec base.

A `Codec` subclass is a frozen dataclass whose fields are its spec parameters. It implements
`wire_bytes`, `_encode` (write exactly that many bytes) and `_decode` (read and validate them);
the base class does the rest: input checks, the float32 view, codec/shape/length checks and
the canonical spec string.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import ClassVar

import numpy
import torch

from gossipcomp.compress import kernels
from gossipcomp.compress.base import Compressed, CompressionContext, PayloadError

Device = torch.device | str | None


class PayloadWriter:
    """Fills one CPU byte buffer of a known size, section after section."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.offset = 0

    def section(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The next `count` elements of `dtype` as a writable CPU tensor (fill it with copy_)."""
        size = count * dtype.itemsize
        view = self.buffer[self.offset : self.offset + size]
        self.offset += size
        return view.view(dtype) if dtype != torch.uint8 else view

    def finish(self) -> memoryview:
        if self.offset != self.buffer.numel():
            raise AssertionError(f"wrote {self.offset} of {self.buffer.numel()} payload bytes")
        if self.offset == 0:
            return memoryview(b"")
        return memoryview(self.buffer.numpy())


class PayloadReader:
    """Reads sections of a received payload as tensors, without copying where it can.

    A read-only buffer (bytes) is copied once into memory the reader owns, since torch only
    wraps writable memory; `owned` says whether the sections are private to this reader.
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.owned = view.readonly or view.nbytes == 0
        if view.nbytes == 0:
            self.buffer = torch.empty(0, dtype=torch.uint8)
        elif view.readonly:
            self.buffer = torch.empty(view.nbytes, dtype=torch.uint8)
            self.buffer.numpy()[:] = numpy.frombuffer(view, dtype=numpy.uint8)
        else:
            self.buffer = torch.frombuffer(view, dtype=torch.uint8)
        self.offset = 0

    def section(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The next `count` elements of `dtype` (aligned: misaligned bytes are copied first)."""
        start, item = self.offset, dtype.itemsize
        view = self.buffer[start : start + count * item]
        self.offset += count * item
        if dtype == torch.uint8:
            return view
        if view.data_ptr() % item or start % item:
            view = view.clone()
        return view.view(dtype)

    def scalars(self, count: int) -> list[float]:
        """The next `count` float32 values as Python floats."""
        return [float(v) for v in self.section(torch.float32, count).tolist()]

    def private(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` on `device`, copied unless it already lives in memory this reader owns."""
        if self.owned and tensor.device == device:
            return tensor
        return tensor.to(device, copy=True)


def all_finite(values: torch.Tensor) -> bool:
    """True when no element is NaN or Inf.

    A float sum is finite exactly when every element is, unless the sum overflows: the cheap sum
    decides and only an overflowing sum pays for the element-wise check. Small CPU arrays go
    through numpy (see kernels: torch's threaded kernels stall on mid-sized CPU tensors here).
    """
    if values.numel() == 0:
        return True
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.numel() < 1 << 22:
        array = values.numpy()
        with numpy.errstate(over="ignore", invalid="ignore"):  # an overflow only means: look closer
            total = array.sum()
        return bool(numpy.isfinite(total)) or bool(numpy.isfinite(array).all())
    if bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(values).all())


def check_finite(values: torch.Tensor, codec: str, what: str) -> None:
    """Raise PayloadError when `values` holds NaN or Inf."""
    if not all_finite(values):
        bad = int((~torch.isfinite(values)).sum())
        raise PayloadError(f"{codec} payload {what}: expected finite, got {bad} NaN/Inf entries")


def check_scale(value: float, codec: str, what: str, nonnegative: bool = True) -> None:
    """Raise PayloadError unless a decoded scale is finite (and >= 0 when `nonnegative`)."""
    if not math.isfinite(value) or (nonnegative and value < 0):
        want = "a finite number >= 0" if nonnegative else "a finite number"
        raise PayloadError(f"{codec} payload {what}: expected {want}, got {value!r}")


def check_scales(values: numpy.ndarray, codec: str, what: str, nonnegative: bool = True) -> None:
    """`check_scale` for an array of scales (one per segment): names the first bad one."""
    bad = ~numpy.isfinite(values)
    if nonnegative:
        bad |= values < 0
    if bad.any():
        index = int(numpy.flatnonzero(bad)[0])
        check_scale(float(values[index]), codec, f"{what} of segment {index}", nonnegative)


# a cautious gossip step for a compressor whose own step was never measured
DEFAULT_CONSENSUS_STEP = 0.1

FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)


def as_float32(value: float) -> float:
    """`value` rounded to float32; beyond float32's range it becomes +-Inf (receivers refuse it)."""
    if math.isfinite(value) and abs(value) > FLOAT32_MAX:
        return math.copysign(math.inf, value)
    return float(numpy.float32(value))


def resolve_device(device: Device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def float_ratio_count(ratio: float, numel: int) -> int:
    """k = max(1, ceil(ratio * numel)) clamped to numel (0 for an empty tensor).

    The product is rounded to 9 significant digits before the ceiling, so that float noise such
    as 0.07 * 100 = 7.000000000000001 still gives 7.
    """
    if numel == 0:
        return 0
    product = float(f"{ratio * numel:.9g}")
    return min(numel, max(1, math.ceil(product)))


@dataclasses.dataclass(frozen=True)
class Codec:
    """Base of the built-in compressors: subclasses are frozen dataclasses of their parameters."""

    name: ClassVar[str] = ""
    contractive: ClassVar[bool] = True
    summable: ClassVar[bool] = False
    sparsifying: ClassVar[bool] = False
    # float32 statistics of the values (a scale, two means) the payload carries; a merged buffer
    # carries them once per segment (compress/segmented.py); 0: the codec has none
    segment_scalars: ClassVar[int] = 0

    @property
    def codec(self) -> str:
        return self.name

    @property
    def consensus_step(self) -> float:
        return DEFAULT_CONSENSUS_STEP

    def variance_bound(self, numel: int) -> float:
        return 0.0

    @property
    def spec(self) -> str:
        """Canonical spec: the name, then every parameter in declaration order."""
        params = [
            f"{f.name}={format_value(getattr(self, f.name))}" for f in dataclasses.fields(self)
        ]
        return self.name + (":" + ",".join(params) if params else "")

    def wire_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, ctx: CompressionContext) -> Compressed:
        """Compress `tensor` (any float dtype, any device) into exactly wire_bytes(numel) bytes."""
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} compresses floating-point tensors, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        writer = PayloadWriter(self.wire_bytes(flat.numel()))
        self._encode(flat, ctx, writer)
        return Compressed(self.codec, tuple(tensor.shape), writer.finish())

    def decompress(
        self, compressed: Compressed, ctx: CompressionContext, device: Device = None
    ) -> torch.Tensor:
        """Validate `compressed` and rebuild a fresh float32 tensor of its shape on `device`."""
        if compressed.codec != self.codec:
            raise PayloadError(f"codec: expected {self.codec!r}, got {compressed.codec!r}")
        shape = _checked_shape(compressed.shape, self.codec)
        numel = math.prod(shape)
        want = self.wire_bytes(numel)
        if compressed.nbytes != want:
            raise PayloadError(
                f"{self.codec} payload length for {numel} elements: expected {want} bytes, "
                f"got {compressed.nbytes}"
            )
        reader = PayloadReader(compressed.data)
        flat = self._decode(reader, numel, ctx, resolve_device(device))
        return flat.view(shape)

    # --- merged buffers with statistics per segment (compress/segmented.py) -------------------

    def segmented_wire_bytes(self, segments: kernels.Segments) -> int:
        """Exact payload size for a merged buffer: the statistics once per segment, then the
        element data as for one tensor of the buffer's size."""
        extra = 4 * self.segment_scalars * (len(segments) - 1)
        return self.wire_bytes(segments.numel) + extra

    def compress_segments(
        self, tensor: torch.Tensor, segments: kernels.Segments, ctx: CompressionContext
    ) -> Compressed:
        """Compress a merged buffer whose statistics are taken per segment."""
        self._require_segments()
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} compresses floating-point tensors, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        if flat.numel() != segments.numel:
            raise ValueError(
                f"{self.name} per segment: the segments cover {segments.numel} elements, "
                f"got a tensor of {flat.numel()}"
            )
        writer = PayloadWriter(self.segmented_wire_bytes(segments))
        self._encode_segments(flat, segments, ctx, writer)
        return Compressed(segmented_codec(self.codec), tuple(tensor.shape), writer.finish())

    def decompress_segments(
        self,
        compressed: Compressed,
        segments: kernels.Segments,
        ctx: CompressionContext,
        device: Device = None,
    ) -> torch.Tensor:
        """Validate a merged buffer's payload and rebuild it (see compress_segments)."""
        self._require_segments()
        codec = segmented_codec(self.codec)
        if compressed.codec != codec:
            raise PayloadError(f"codec: expected {codec!r}, got {compressed.codec!r}")
        shape = _checked_shape(compressed.shape, codec)
        if math.prod(shape) != segments.numel:
            raise PayloadError(
                f"{codec} shape: expected {segments.numel} elements, got {math.prod(shape)}"
            )
        want = self.segmented_wire_bytes(segments)
        if compressed.nbytes != want:
            raise PayloadError(
                f"{codec} payload length for {len(segments)} segments of {segments.numel} "
                f"elements: expected {want} bytes, got {compressed.nbytes}"
            )
        reader = PayloadReader(compressed.data)
        flat = self._decode_segments(reader, segments, ctx, resolve_device(device))
        return flat.view(shape)

    def _require_segments(self) -> None:
        if not self.segment_scalars:
            raise TypeError(f"{self.name} keeps no statistics to take per segment")

    def _encode_segments(
        self,
        flat: torch.Tensor,
        segments: kernels.Segments,
        ctx: CompressionContext,
        out: PayloadWriter,
    ) -> None:
        raise NotImplementedError

    def _decode_segments(
        self,
        payload: PayloadReader,
        segments: kernels.Segments,
        ctx: CompressionContext,
        device: torch.device,
    ) -> torch.Tensor:
        raise NotImplementedError

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        """Write the payload of the 1-D tensor `flat` (any float dtype, not yet float32)."""
        raise NotImplementedError

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        """Read and validate a payload of the right length; return the 1-D float32 result."""
        raise NotImplementedError


def _checked_shape(shape: object, codec: str) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(n) for n in shape)  # type: ignore[attr-defined]
    except TypeError:
        dims = ()
        valid = False
    else:
        valid = all(n >= 0 for n in dims)
    if not valid:
        raise PayloadError(f"{codec} shape: expected non-negative integers, got {shape!r}")
    return dims


def segmented_codec(codec: str) -> str:
    """The wire codec id of `codec` with its statistics per segment of a merged buffer."""
    return f"{codec}/segments"


def format_value(value: object) -> str:
    """A parameter value as it appears in a spec string (bools as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)
