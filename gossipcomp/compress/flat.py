"""Several tensors as one flat buffer: the layout merged compression fuses a group into.

Compressing many small tensors one by one costs several times the same work on one buffer
(docs/design.md), so a group of tensors is packed into one contiguous float32 buffer, compressed
once, and the decoded buffer is unpacked in place. `FlatLayout` records where each tensor lives
in the buffer; `views` gives tensors that alias a buffer, so unpacking into them costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Shapes of the tensors of one group, in order, and their offsets in the flat buffer."""

    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> FlatLayout:
        return cls(tuple(tuple(t.shape) for t in tensors))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def offsets(self) -> list[int]:
        """Start of each tensor in the buffer (one more entry: the end)."""
        starts = [0]
        for n in self.numels:
            starts.append(starts[-1] + n)
        return starts

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor of the group as a view into the 1-D `buffer` (no copy)."""
        self._check_buffer(buffer)
        starts = self.offsets()
        return [
            buffer[start:end].view(shape)
            for start, end, shape in zip(starts[:-1], starts[1:], self.shapes, strict=True)
        ]

    def pack(
        self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensors concatenated into one 1-D float32 buffer (into `out` when given)."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        for index, (tensor, shape) in enumerate(zip(tensors, self.shapes, strict=True)):
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"tensor {index}: expected shape {shape}, got {tuple(tensor.shape)}"
                )
        if out is None:
            device = tensors[0].device if tensors else torch.device("cpu")
            out = torch.empty(self.numel, dtype=torch.float32, device=device)
        if len(tensors) == 1:
            out.copy_(tensors[0].detach().reshape(-1))
        else:
            torch.cat([t.detach().reshape(-1).to(out.dtype) for t in tensors], out=out)
        return out

    def unpack(self, buffer: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        """Copy the 1-D `buffer` back into the tensors `into` (any float dtype)."""
        for target, view in zip(into, self.views(buffer), strict=True):
            target.copy_(view)

    def _check_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.ndim != 1 or buffer.numel() != self.numel:
            raise ValueError(
                f"flat buffer: expected 1-D with {self.numel} elements, "
                f"got shape {tuple(buffer.shape)}"
            )
