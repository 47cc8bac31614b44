"""What every compressor promises: the context both ends share, the payload, and the protocol.

A compressor turns one tensor into a `Compressed` payload of exactly `wire_bytes(numel)` bytes
(known before compressing, so a scheduler can plan) and back. It knows nothing of peers or
networks: who sends to whom, and when, arrives as a `CompressionContext`, from which both ends
derive the same randomness without sending it.

Payloads are little-endian (torch's and numpy's native order on every platform torch supports).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Protocol

import torch

_SEED_DOMAIN = b"gossipcomp.compress.v1"


class PayloadError(ValueError):
    """A received payload is malformed; the message names what, what was expected and what came."""


@dataclass(frozen=True)
class CompressionContext:
    """Who compresses what, for whom, when: both ends derive the same shared randomness from it."""

    seed: int  # the run's global seed
    sender: int  # rank that compresses
    receiver: int  # rank the payload is for, or -1 when the same payload goes to every neighbour
    round: int
    tensor_index: int  # position of the tensor in the model's parameter list

    def shared_seed(self) -> int:
        """A 63-bit seed from a sha256 of the whole tuple (fields hashed as fixed-width integers,
        never as concatenated digits, so (1, 23) and (12, 3) cannot collide)."""
        fields = (self.seed, self.sender, self.receiver, self.round, self.tensor_index)
        digest = hashlib.sha256(_SEED_DOMAIN + struct.pack("<5q", *fields)).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh torch.Generator on `device` seeded with `shared_seed()`.

        A CUDA generator draws a different stream than a CPU one from the same seed: randomness
        that both ends must agree on is drawn on the CPU (see randomk).
        """
        generator = torch.Generator(device=device)
        generator.manual_seed(self.shared_seed())
        return generator


@dataclass(frozen=True)
class Compressed:
    """One compressed tensor as it travels: codec id, decoded shape, and the payload bytes."""

    codec: str  # wire codec id, e.g. "topk"
    shape: tuple[int, ...]  # shape of the decoded tensor
    data: bytes | bytearray | memoryview  # exactly wire_bytes(numel) bytes, little-endian, CPU

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes if isinstance(self.data, memoryview) else len(self.data)


class Compressor(Protocol):
    """Tensor -> payload -> tensor, with an exact size known in advance.

    `compress` accepts any floating dtype on any device and computes in float32 on the tensor's
    device; the payload bytes are on the CPU and never alias the input. `decompress` returns a
    fresh float32 tensor of `compressed.shape` on `device` (CPU when None) after validating the
    payload: byte count, indices in range and unique, counts consistent, scales and values
    finite; anything else raises PayloadError.
    """

    @property
    def name(self) -> str:
        """Registry name, e.g. "topk"."""
        ...

    @property
    def codec(self) -> str:
        """Wire codec id (the registry name for every built-in compressor)."""
        ...

    @property
    def unbiased(self) -> bool:
        """True when E[D(C(x))] == x."""
        ...

    @property
    def contractive(self) -> bool:
        """True when E||D(C(x)) - x||^2 <= (1 - delta) ||x||^2 for some delta > 0 (what Choco
        and error feedback need); an unbiased compressor becomes one when scaled by
        1 / (1 + variance_bound)."""
        ...

    @property
    def summable(self) -> bool:
        """True when the element-wise sum of payloads decodes to the sum of the decoded tensors
        (fp16, random-k with shared indices): such payloads can go through all-reduce."""
        ...

    @property
    def sparsifying(self) -> bool:
        """True when most entries are dropped each time (top-k, random-k, DGC): algorithms that
        feed back the error damp their steps for these."""
        ...

    @property
    def consensus_step(self) -> float:
        """The suggested gossip step in (0, 1] for compressed gossip (Choco's gamma), measured on
        an 8-ring (docs/benchmarks.md)."""
        ...

    def variance_bound(self, numel: int) -> float:
        """beta with E||D(C(x)) - x||^2 <= beta ||x||^2 for an unbiased compressor of `numel`
        elements; 0 for a biased one (its error is bounded by contraction instead)."""
        ...

    @property
    def spec(self) -> str:
        """Canonical spec string: parse_spec(c.spec) builds an equal compressor."""
        ...

    def wire_bytes(self, numel: int) -> int:
        """Exact payload size for a tensor of `numel` elements."""
        ...

    def compress(self, tensor: torch.Tensor, ctx: CompressionContext) -> Compressed: ...

    def decompress(
        self,
        compressed: Compressed,
        ctx: CompressionContext,
        device: torch.device | str | None = None,
    ) -> torch.Tensor: ...
