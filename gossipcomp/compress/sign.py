"""One-bit codecs: a sign bit per element plus one or two float32 scales.

Wire formats (d elements, P = ceil(d / 8) bytes per bit-plane, see bitpack for the bit order;
a set bit marks x_i < 0, so sign(0) = +1 and -0.0 counts as 0):
- sign: float32 scale ||x||_1 / d, then the sign plane: 4 + P bytes. Decodes to
  scale * sign(x); the squared error is exactly ||x||^2 - ||x||_1^2 / d.
- onebit: float32 mean of the non-negative entries, float32 mean of the negative entries (0 when
  there are none), then the sign plane: 8 + P bytes. Decodes each entry to the mean of its side.

A merged buffer of S tensors (compress/segmented.py, codec "sign/segments", "onebit/segments")
carries these statistics once per tensor, segment by segment, then one sign plane over the whole
buffer: 4 S + P bytes for sign, 8 S + P for onebit (the pair of means of each segment together).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from gossipcomp.compress import bitpack, kernels
from gossipcomp.compress.base import CompressionContext, PayloadError
from gossipcomp.compress.codec import (
    Codec,
    PayloadReader,
    PayloadWriter,
    as_float32,
    check_scale,
    check_scales,
    segmented_codec,
)

SIGN_CONSENSUS_STEP = 0.45  # Choco on ring8 digits (docs/benchmarks.md)


def _read_sign_plane(payload: PayloadReader, numel: int, codec: str) -> torch.Tensor:
    plane = payload.section(torch.uint8, bitpack.plane_bytes(numel))
    if not bitpack.padding_is_clear(plane, 1, numel):
        raise PayloadError(f"{codec} payload sign plane: expected zero padding bits, got ones")
    return plane


@dataclass(frozen=True)
class _SignPlane(Codec):
    """Shared wire format of the one-bit codecs: `segment_scalars` float32 statistics (once
    per segment of a merged buffer), then the sign plane; an entry decodes to the value of its
    side, computed from the statistics by `_sides`."""

    unbiased: ClassVar[bool] = False
    # per statistic: what errors call it, and whether it is checked negated (>= 0 either way)
    STATISTICS: ClassVar[tuple[tuple[str, bool], ...]] = ()

    @property
    def consensus_step(self) -> float:
        return SIGN_CONSENSUS_STEP

    def wire_bytes(self, numel: int) -> int:
        return 4 * self.segment_scalars + bitpack.plane_bytes(numel)

    @staticmethod
    def _statistics(sums: kernels.SignSums, numel: int) -> tuple[float, ...]:
        """The statistics of one tensor, each rounded to float32 as the receiver reads it."""
        raise NotImplementedError

    @staticmethod
    def _sides(statistics: Sequence) -> tuple:
        """(value of a clear bit, value of a set bit) from the statistics (floats or arrays)."""
        raise NotImplementedError

    def _checked(self, statistics: Sequence, codec: str, check: Callable) -> None:
        """Every statistic checked (`check_scale` or `check_scales`) before it is used."""
        for value, (what, negated) in zip(statistics, self.STATISTICS, strict=True):
            check(-value if negated else value, codec, what)

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        statistics = out.section(torch.float32, self.segment_scalars)
        numel = flat.numel()
        sums = kernels.sign_pass(flat, out.section(torch.uint8, bitpack.plane_bytes(numel)))
        statistics.copy_(torch.tensor(self._statistics(sums, numel), dtype=torch.float32))

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        statistics = payload.scalars(self.segment_scalars)
        self._checked(statistics, self.codec, check_scale)
        plane = _read_sign_plane(payload, numel, self.codec)
        return kernels.expand_plane(plane, numel, *self._sides(statistics), device)

    def _encode_segments(
        self,
        flat: torch.Tensor,
        segments: kernels.Segments,
        ctx: CompressionContext,
        out: PayloadWriter,
    ) -> None:
        statistics = out.section(torch.float32, self.segment_scalars * len(segments))
        kernels.sign_pass(flat, out.section(torch.uint8, bitpack.plane_bytes(flat.numel())))
        # each segment's statistics as `_encode` takes them of that tensor alone, bit for bit
        values = [
            self._statistics(kernels.sign_pass(v, None), v.numel()) for v in segments.views(flat)
        ]
        statistics.copy_(torch.tensor(values, dtype=torch.float32).view(-1))

    def _decode_segments(
        self,
        payload: PayloadReader,
        segments: kernels.Segments,
        ctx: CompressionContext,
        device: torch.device,
    ) -> torch.Tensor:
        codec, count = segmented_codec(self.codec), self.segment_scalars
        table = payload.section(torch.float32, count * len(segments)).numpy()
        table = table.reshape(-1, count).copy()  # a row per segment
        statistics = [table[:, i] for i in range(count)]
        self._checked(statistics, codec, check_scales)
        plane = _read_sign_plane(payload, segments.numel, codec)
        return kernels.expand_plane_segments(plane, segments, *self._sides(statistics), device)


@dataclass(frozen=True)
class Sign(_SignPlane):
    """Scaled sign: ||x||_1 / d * sign(x), 1 bit per element and one float (biased)."""

    name: ClassVar[str] = "sign"
    segment_scalars: ClassVar[int] = 1
    STATISTICS: ClassVar[tuple[tuple[str, bool], ...]] = (("scale", False),)

    @staticmethod
    def _statistics(sums: kernels.SignSums, numel: int) -> tuple[float, ...]:
        return (as_float32(sums.abs_sum / max(1, numel)),)

    @staticmethod
    def _sides(statistics: Sequence) -> tuple:
        (scale,) = statistics
        return scale, -scale


@dataclass(frozen=True)
class OneBit(_SignPlane):
    """Two means: each entry becomes the mean of the non-negative or of the negative entries."""

    name: ClassVar[str] = "onebit"
    segment_scalars: ClassVar[int] = 2
    STATISTICS: ClassVar[tuple[tuple[str, bool], ...]] = (
        ("mean of the non-negative entries", False),
        ("negated mean of the negative entries", True),
    )

    @staticmethod
    def _statistics(sums: kernels.SignSums, numel: int) -> tuple[float, ...]:
        positives = numel - sums.negatives  # zeros count here: they add nothing to the sum
        return (
            as_float32(sums.positive_sum / positives if positives else 0.0),
            as_float32(sums.negative_sum / sums.negatives if sums.negatives else 0.0),
        )

    @staticmethod
    def _sides(statistics: Sequence) -> tuple:
        positive, negative = statistics
        return positive, negative
