"""Compressed tensors in envelopes: specs, wire conversion, and decoding a neighbour's payload.

Shared by the algorithms that broadcast one compressed payload per round (Choco-SGD, DEF-ATC):
each parameter travels as one WireTensor whose codec and byte count the receiver knows in advance
from the compressor, so the transport checks them before anything is decompressed.
"""

from __future__ import annotations

from functools import partial

import torch

from gossipcomp.compress.base import Compressed, CompressionContext, Compressor
from gossipcomp.gossip.base import NamedParams
from gossipcomp.transport.base import Envelope, PayloadSpec, TensorSpec, WireTensor

BROADCAST = -1  # CompressionContext.receiver when one payload goes to every neighbour


def compressed_spec(params: NamedParams, compressor: Compressor) -> PayloadSpec:
    """What a neighbour's payload must hold: every parameter compressed by `compressor`, with a
    layout check the receiver runs before storing it (so a malformed payload is refused at the
    door instead of failing inside a gossip step)."""
    return tuple(
        TensorSpec(
            name=name,
            dtype="float32",
            shape=tuple(p.shape),
            codec=compressor.codec,
            nbytes=compressor.wire_bytes(p.numel()),
            require_finite=False,  # the layout check covers scales and values
            check=partial(_check_layout, compressor, tuple(p.shape)),
        )
        for name, p in params
    )


_ANY_CONTEXT = CompressionContext(seed=0, sender=0, receiver=BROADCAST, round=0, tensor_index=0)


def _check_layout(compressor: Compressor, shape: tuple[int, ...], data: memoryview) -> None:
    """Decode once, discarding the result: decoding validates indices, scales, padding and
    values (the context only decides which entries random-k fills, never whether the bytes are
    valid). Raises PayloadError (a ValueError) naming the problem."""
    compressor.decompress(Compressed(compressor.codec, shape, data), _ANY_CONTEXT)


def to_wire(name: str, compressed: Compressed) -> WireTensor:
    return WireTensor(name, "float32", compressed.shape, compressed.codec, compressed.data)


def from_wire(wire: WireTensor) -> Compressed:
    return Compressed(codec=wire.codec, shape=tuple(wire.shape), data=wire.data)


class BroadcastCodec:
    """Compresses a peer's tensors for all neighbours at once and decodes what neighbours sent."""

    def __init__(self, compressor: Compressor, seed: int, rank: int) -> None:
        self.compressor = compressor
        self.seed = seed
        self.rank = rank

    def context(self, sender: int, round: int, index: int) -> CompressionContext:
        return CompressionContext(self.seed, sender, BROADCAST, round, index)

    def compress(self, tensor: torch.Tensor, round: int, index: int) -> Compressed:
        return self.compressor.compress(tensor, self.context(self.rank, round, index))

    def decompress_own(
        self, compressed: Compressed, round: int, index: int, like: torch.Tensor
    ) -> torch.Tensor:
        """What every neighbour decodes from this peer's payload, bit for bit."""
        ctx = self.context(self.rank, round, index)
        return self.compressor.decompress(compressed, ctx, like.device).to(like.dtype)

    def decompress_from(
        self, envelope: Envelope, index: int, like: torch.Tensor, key: int | None = None
    ) -> torch.Tensor:
        """Decode a neighbour's tensor; `key` is the compression round key (default: its round)."""
        ctx = self.context(envelope.sender, envelope.round if key is None else key, index)
        decoded = self.compressor.decompress(from_wire(envelope.tensors[index]), ctx, like.device)
        return decoded.to(like.dtype)
