"""Stochastic quantisation to a few levels: QSGD and TernGrad (both unbiased).

Both send a float32 scale c and, per element, a sign and a level l in 0..s; the element decodes
to sign * l * c / s. The level is s|x|/c rounded down or up at random, up with probability equal
to the fractional part (l = floor(s|x|/c + u), u uniform in [0, 1)), so E[decoded] = x. The
uniforms are drawn from ctx.shared_seed(): on the CPU one numpy PCG64 stream per 256Ki-element
span (u on a 2**-23 grid; see kernels.stochastic_levels), on other devices torch.rand with
ctx.generator(device). A payload is a deterministic function of (x, ctx, device type).

Wire format (d elements, P = ceil(d / 8), b = ceil(log2(s + 1)) level bits):
float32 scale, then 1 + b bit-planes of P bytes: the sign plane (set bit: x < 0), then the level
bits from least to most significant (see bitpack). 4 + (1 + b) P bytes.
- qsgd:levels=s: c = ||x||_2. E||Q(x) - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2.
- terngrad: c = max |x_i|, s = 1 (values -c, 0, c): 4 + 2P bytes.
The decoder refuses a non-finite or negative scale and levels above s (so a tensor whose scale
exceeds float32's range, or holds NaN/Inf, yields a payload every receiver refuses).

A merged buffer of S tensors (compress/segmented.py, codec "qsgd/segments", "terngrad/segments")
carries one scale per tensor (its own ||x||_2 or max |x|), then the planes over the whole
buffer: 4 S + (1 + b) P bytes; each element is quantised against its own tensor's scale, so
the error bound holds per tensor: E||Q(x) - x||^2 <= max over tensors of beta(d_t) ||x||^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy
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

MAX_LEVELS = 127  # 7 level bits; floor(s|x|/c + 1 + u) is computed in a byte on the CPU


@dataclass(frozen=True)
class _StochasticLevels(Codec):
    """Shared encode/decode of sign + stochastically rounded level codes under one scale."""

    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = False  # unbiased: contractive only once scaled
    segment_scalars: ClassVar[int] = 1

    @property
    def _levels(self) -> int:
        raise NotImplementedError

    def _scale(self, flat: torch.Tensor) -> float:
        raise NotImplementedError

    @property
    def _level_bits(self) -> int:
        return bitpack.bits_for(self._levels + 1)

    def wire_bytes(self, numel: int) -> int:
        return 4 + (1 + self._level_bits) * bitpack.plane_bytes(numel)

    def _sections(
        self, out: PayloadWriter, scales: int, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of `scales` float32 scales, then the 1 + b bit-planes (a row each)."""
        slots = out.section(torch.float32, scales)
        planes = out.section(torch.uint8, (1 + self._level_bits) * bitpack.plane_bytes(numel))
        return slots, planes.view(1 + self._level_bits, -1)

    @staticmethod
    def _uniforms(flat: torch.Tensor, ctx: CompressionContext) -> int | torch.Generator:
        """Where the rounding draws its uniforms: numpy's stream on the CPU, torch's elsewhere."""
        return ctx.shared_seed() if flat.device.type == "cpu" else ctx.generator(flat.device)

    def _read_planes(self, payload: PayloadReader, numel: int, codec: str) -> torch.Tensor:
        """The sign plane and the level planes, their padding bits checked clear."""
        bits = self._level_bits
        packed = payload.section(torch.uint8, (1 + bits) * bitpack.plane_bytes(numel))
        if not bitpack.padding_is_clear(packed, 1 + bits, numel):
            raise PayloadError(f"{codec} payload bit-planes: expected zero padding bits")
        return packed

    def _times_levels(
        self, values: torch.Tensor, packed: torch.Tensor, numel: int, codec: str
    ) -> torch.Tensor:
        """`values` (+-scale / s by the sign plane) times each element's level; a level above
        s is refused."""
        bits, levels = self._level_bits, self._levels
        plane = bitpack.plane_bytes(numel)
        largest = kernels.multiply_levels(values, packed[plane:].view(bits, -1), bits)
        if largest > levels:
            raise PayloadError(f"{codec} payload levels: expected at most {levels}, got {largest}")
        return values

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        levels = self._levels
        scale_slot, planes = self._sections(out, 1, flat.numel())
        scale = as_float32(self._scale(flat))  # the value the receiver will use
        scale_slot.fill_(scale)
        if not (scale > 0 and scale < float("inf")):  # zero, or a non-finite input
            planes.zero_()
            return
        kernels.stochastic_levels(flat, levels / scale, levels, self._uniforms(flat, ctx), planes)

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        levels = self._levels
        (scale,) = payload.scalars(1)
        check_scale(scale, self.codec, "scale")
        packed = self._read_planes(payload, numel, self.codec)
        plane = bitpack.plane_bytes(numel)
        values = kernels.expand_plane(
            packed[:plane], numel, scale / levels, -scale / levels, device
        )
        return self._times_levels(values, packed, numel, self.codec)

    def _encode_segments(
        self,
        flat: torch.Tensor,
        segments: kernels.Segments,
        ctx: CompressionContext,
        out: PayloadWriter,
    ) -> None:
        levels = self._levels
        scale_slots, planes = self._sections(out, len(segments), flat.numel())
        # each segment's scale as `_encode` takes it of that tensor alone: what receivers use
        scales = numpy.array(
            [as_float32(self._scale(view)) for view in segments.views(flat)], dtype=numpy.float32
        )
        scale_slots.copy_(torch.from_numpy(scales))
        if not numpy.isfinite(scales).all():  # a non-finite input: every receiver refuses it
            planes.zero_()
            return
        factors = numpy.divide(
            float(levels), scales, out=numpy.zeros_like(scales), where=scales > 0
        )  # a segment of zeros: factor 0, level 0 everywhere
        kernels.stochastic_levels(
            flat,
            kernels.PerSegment(segments, factors),
            levels,
            self._uniforms(flat, ctx),
            planes,
        )

    def _decode_segments(
        self,
        payload: PayloadReader,
        segments: kernels.Segments,
        ctx: CompressionContext,
        device: torch.device,
    ) -> torch.Tensor:
        codec, numel = segmented_codec(self.codec), segments.numel
        scales = payload.section(torch.float32, len(segments)).numpy().copy()
        check_scales(scales, codec, "scale")
        packed = self._read_planes(payload, numel, codec)
        steps = scales / numpy.float32(self._levels)
        plane = bitpack.plane_bytes(numel)
        values = kernels.expand_plane_segments(packed[:plane], segments, steps, -steps, device)
        return self._times_levels(values, packed, numel, codec)


@dataclass(frozen=True)
class QSGD(_StochasticLevels):
    """QSGD: ||x||_2 * sign(x) * l / s with l stochastically rounded; unbiased."""

    name: ClassVar[str] = "qsgd"
    levels: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= MAX_LEVELS:
            raise ValueError(f"qsgd levels must be in 1..{MAX_LEVELS}, got {self.levels}")

    @property
    def _levels(self) -> int:
        return self.levels

    @property
    def consensus_step(self) -> float:
        return 0.1  # after the 1 / (1 + beta) scaling; consensus sweep on ring8

    def variance_bound(self, numel: int) -> float:
        """min(d / s^2, sqrt(d) / s) (Alistarh et al. 2017)."""
        s = self.levels
        return min(numel / s**2, math.sqrt(numel) / s)

    def _scale(self, flat: torch.Tensor) -> float:
        return kernels.l2_norm(flat)


@dataclass(frozen=True)
class TernGrad(_StochasticLevels):
    """TernGrad: max|x| * sign(x) * Bernoulli(|x| / max|x|); unbiased, 2 bits per element."""

    name: ClassVar[str] = "terngrad"

    @property
    def _levels(self) -> int:
        return 1

    @property
    def consensus_step(self) -> float:
        return 0.3  # after the 1 / (1 + beta) scaling; consensus sweep on ring8

    def variance_bound(self, numel: int) -> float:
        """max|x| ||x||_1 - ||x||^2 <= (sqrt(d) - 1) ||x||^2."""
        return max(0.0, math.sqrt(numel) - 1.0)

    def _scale(self, flat: torch.Tensor) -> float:
        return kernels.abs_max(flat)
