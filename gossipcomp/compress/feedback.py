"""Error feedback: compress what was meant plus what earlier rounds failed to send.

For each (ctx.receiver, ctx.tensor_index) the wrapper keeps a memory e (zero at first), sends
C(x + e) and sets e <- (x + e) - D(C(x + e)). Summed over rounds, what was sent equals what was
meant minus the final memory, so a biased compressor's error does not accumulate. The payload is
the inner compressor's: same codec, wire size and decoder.

The memory is state: use one ErrorFeedback per sending peer.
"""

from __future__ import annotations

import torch

from gossipcomp.compress import kernels
from gossipcomp.compress.base import Compressed, CompressionContext, Compressor
from gossipcomp.compress.wrapper import Wrapper

MemoryKey = tuple[int, int]  # (receiver, tensor_index)


class ErrorFeedback(Wrapper):
    """Wraps any compressor in error feedback (spec "ef+SPEC"); biased whatever the inner one.
    Its codec, payloads and other traits are the inner compressor's."""

    unbiased = False
    contractive = True  # what was not sent is sent later: no error accumulates

    def __init__(self, inner: Compressor) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("error feedback cannot wrap error feedback (ef+ef+...)")
        super().__init__(inner)
        self._memory: dict[MemoryKey, torch.Tensor] = {}

    @property
    def name(self) -> str:
        return f"ef+{self.inner.name}"

    @property
    def spec(self) -> str:
        return f"ef+{self.inner.spec}"

    def variance_bound(self, numel: int) -> float:
        return 0.0

    def wire_bytes(self, numel: int) -> int:
        return self.inner.wire_bytes(numel)

    def compress(self, tensor: torch.Tensor, ctx: CompressionContext) -> Compressed:
        """Send C(x + e) and keep e <- (x + e) - D(C(x + e)) for (ctx.receiver, ctx.tensor_index).

        The memory is updated in place (no 64 MiB temporaries for big tensors); should the inner
        compressor raise, that one memory is left undefined: reset() it.
        """
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} compresses floating-point tensors, got {tensor.dtype}")
        key = (ctx.receiver, ctx.tensor_index)
        memory = self._memory.get(key)
        if memory is None:
            memory = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
            memory.copy_(tensor.detach())
        elif memory.shape != tensor.shape or memory.device != tensor.device:
            raise ValueError(
                f"error feedback memory for receiver {key[0]}, tensor {key[1]} holds "
                f"{tuple(memory.shape)} on {memory.device}, got {tuple(tensor.shape)} "
                f"on {tensor.device}"
            )
        else:
            kernels.add_into(memory, tensor.detach())  # memory now holds x + e
        self._memory[key] = memory
        compressed = self.inner.compress(memory, ctx)
        kernels.add_into(memory, self.inner.decompress(compressed, ctx, memory.device), -1.0)
        return compressed

    def decompress(
        self,
        compressed: Compressed,
        ctx: CompressionContext,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        return self.inner.decompress(compressed, ctx, device)

    def memory(self, receiver: int, tensor_index: int) -> torch.Tensor | None:
        """A copy of the error memory for (receiver, tensor_index), None before its first use."""
        memory = self._memory.get((receiver, tensor_index))
        return None if memory is None else memory.clone()

    def memories(self) -> dict[MemoryKey, torch.Tensor]:
        """Copies of every memory, keyed by (receiver, tensor_index): for checkpoints."""
        return {key: memory.clone() for key, memory in self._memory.items()}

    def set_memory(self, receiver: int, tensor_index: int, memory: torch.Tensor) -> None:
        """Restore one memory (from a checkpoint); it is copied, as float32."""
        self._memory[(receiver, tensor_index)] = memory.detach().to(torch.float32, copy=True)

    def reset(self) -> None:
        """Forget every memory."""
        self._memory.clear()
