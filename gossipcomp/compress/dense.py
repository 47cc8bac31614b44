"""Dense codecs: every element travels, as float32 (identity) or cast to a 16-bit float.

Wire formats (d elements, little-endian):
- identity: d float32, 4d bytes.
- fp16: d IEEE binary16, 2d bytes. Finite values beyond +-65504 saturate to +-65504 instead of
  becoming Inf (round to nearest even otherwise: relative error <= 2**-11 in the normal range,
  absolute error <= 2**-25 among subnormals).
- bf16: d bfloat16, 2d bytes, saturating at +-3.3895e38 (relative error <= 2**-8).
Inf and NaN inputs travel as they are, and every decoder here refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from gossipcomp.compress import kernels
from gossipcomp.compress.base import CompressionContext
from gossipcomp.compress.codec import Codec, PayloadReader, PayloadWriter, check_finite


@dataclass(frozen=True)
class Identity(Codec):
    """No compression: float32 on the wire (the baseline every other codec is measured against)."""

    name: ClassVar[str] = "identity"
    unbiased: ClassVar[bool] = True
    summable: ClassVar[bool] = True

    @property
    def consensus_step(self) -> float:
        return 1.0

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        out.section(torch.float32, flat.numel()).copy_(flat)

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        values = payload.section(torch.float32, numel)
        check_finite(values, self.codec, "values")
        return payload.private(values, device)


@dataclass(frozen=True)
class _HalfCast(Codec):
    """A 16-bit float cast, saturating at the format's largest finite value."""

    unbiased: ClassVar[bool] = False
    summable: ClassVar[bool] = True  # summed in float32 (an fp16 sum could overflow)
    dtype: ClassVar[torch.dtype] = torch.float16

    @property
    def consensus_step(self) -> float:
        return 1.0

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def _encode(self, flat: torch.Tensor, ctx: CompressionContext, out: PayloadWriter) -> None:
        target = out.section(self.dtype, flat.numel())
        limit = torch.finfo(self.dtype).max
        if flat.numel() and kernels.abs_max(flat) > limit:  # would overflow: saturate first
            wide = flat.to(torch.float32)
            flat = torch.where(wide.isinf(), wide, wide.clamp(-limit, limit))
        target.copy_(flat)

    def _decode(
        self, payload: PayloadReader, numel: int, ctx: CompressionContext, device: torch.device
    ) -> torch.Tensor:
        values = payload.section(self.dtype, numel).to(device=device, dtype=torch.float32)
        check_finite(values, self.codec, "values")
        return values


@dataclass(frozen=True)
class Float16(_HalfCast):
    """IEEE half precision: 2 bytes per element."""

    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class BFloat16(_HalfCast):
    """bfloat16: float32's range with an 8-bit significand, 2 bytes per element."""

    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16
