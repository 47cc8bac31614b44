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
class Sign(Codec):
    """Scaled sign: ||x||_1 / d * sign(x), 1 bit per element and one float (biased)."""

    name: ClassVar[str] = "sign"
    unbiased: ClassVar[bool] = False
    segment_scalars: ClassVar[int] = 1

    @property
    def consensus_step(self) -> float:
        return SIGN_CONSENSUS_STEP

    def wire_bytes(self, numel: int) -> int:
        return 4 + bitpack.plane_bytes(numel)

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        scale = out.section(torch.float32, 1)
        sums = kernels.sign_pass(flat, out.section(torch.uint8, bitpack.plane_bytes(flat.numel())))
        scale.fill_(self._scale(sums, flat.numel()))

    @staticmethod
    def _scale(sums: kernels.SignSums, numel: int) -> float:
        return as_float32(sums.abs_sum / max(1, numel))

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        (scale,) = payload.scalars(1)
        check_scale(scale, self.codec, "scale")
        plane = _read_sign_plane(payload, numel, self.codec)
        return kernels.expand_plane(plane, numel, scale, -scale, device)

    def _encode_segments(
        self,
        flat: torch.Tensor,
        segments: kernels.Segments,
        ctx: CompressionContext,
        out: PayloadWriter,
    ) -> None:
        scales = out.section(torch.float32, len(segments))
        kernels.sign_pass(flat, out.section(torch.uint8, bitpack.plane_bytes(flat.numel())))
        # each segment's scale as `_encode` takes it of that tensor alone, bit for bit
        values = [self._scale(kernels.sign_pass(v, None), v.numel()) for v in segments.views(flat)]
        scales.copy_(torch.tensor(values, dtype=torch.float32))

    def _decode_segments(
        self,
        payload: PayloadReader,
        segments: kernels.Segments,
        ctx: CompressionContext,
        device: torch.device,
    ) -> torch.Tensor:
        scales = payload.section(torch.float32, len(segments)).numpy().copy()
        check_scales(scales, segmented_codec(self.codec), "scale")
        plane = _read_sign_plane(payload, segments.numel, segmented_codec(self.codec))
        return kernels.expand_plane_segments(plane, segments, scales, -scales, device)


@dataclass(frozen=True)
class OneBit(Codec):
    """Two means: each entry becomes the mean of the non-negative or of the negative entries."""

    name: ClassVar[str] = "onebit"
    unbiased: ClassVar[bool] = False
    segment_scalars: ClassVar[int] = 2

    @property
    def consensus_step(self) -> float:
        return SIGN_CONSENSUS_STEP

    def wire_bytes(self, numel: int) -> int:
        return 8 + bitpack.plane_bytes(numel)

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        means = out.section(torch.float32, 2)
        numel = flat.numel()
        sums = kernels.sign_pass(flat, out.section(torch.uint8, bitpack.plane_bytes(numel)))
        means.copy_(torch.tensor(self._means(sums, numel), dtype=torch.float32))

    @staticmethod
    def _means(sums: kernels.SignSums, numel: int) -> tuple[float, float]:
        positives = numel - sums.negatives  # zeros count here: they add nothing to the sum
        return (
            as_float32(sums.positive_sum / positives if positives else 0.0),
            as_float32(sums.negative_sum / sums.negatives if sums.negatives else 0.0),
        )

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        positive, negative = payload.scalars(2)
        check_scale(positive, self.codec, "mean of the non-negative entries")
        check_scale(-negative, self.codec, "negated mean of the negative entries")
        plane = _read_sign_plane(payload, numel, self.codec)
        return kernels.expand_plane(plane, numel, positive, negative, device)

    def _encode_segments(
        self,
        flat: torch.Tensor,
        segments: kernels.Segments,
        ctx: CompressionContext,
        out: PayloadWriter,
    ) -> None:
        means = out.section(torch.float32, 2 * len(segments))
        kernels.sign_pass(flat, out.section(torch.uint8, bitpack.plane_bytes(flat.numel())))
        # each segment's means as `_encode` takes them of that tensor alone, bit for bit
        values = [self._means(kernels.sign_pass(v, None), v.numel()) for v in segments.views(flat)]
        means.copy_(torch.tensor(values, dtype=torch.float32).view(-1))

    def _decode_segments(
        self,
        payload: PayloadReader,
        segments: kernels.Segments,
        ctx: CompressionContext,
        device: torch.device,
    ) -> torch.Tensor:
        codec = segmented_codec(self.codec)
        means = payload.section(torch.float32, 2 * len(segments)).numpy().reshape(-1, 2).copy()
        check_scales(means[:, 0], codec, "mean of the non-negative entries")
        check_scales(-means[:, 1], codec, "negated mean of the negative entries")
        plane = _read_sign_plane(payload, segments.numel, codec)
        return kernels.expand_plane_segments(plane, segments, means[:, 0], means[:, 1], device)
