"""A peer's compressed payloads under a grouping: compress, wire, decode, per-group state.

Shared by the algorithms that broadcast one compressed payload per step (Choco-SGD, DEF-ATC).
Each group of the current grouping (gossip/grouping.py) travels as one wire tensor whose codec
and byte count the receiver knows in advance, so the transport checks them before anything is
decoded; the transport then decodes the payload once, at receipt (which validates it), and
the algorithm uses that decoded buffer (`decoded`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from gossipcomp.compress.base import Compressed, CompressionContext, Compressor
from gossipcomp.gossip.base import NamedParams
from gossipcomp.gossip.grouping import BROADCAST, Grouping, to_wire
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec


class MergedCodec:
    """Compresses a peer's groups for all neighbours at once and decodes what they sent."""

    def __init__(self, params: NamedParams, default: Compressor, seed: int, rank: int) -> None:
        self.default = default
        self.seed = seed
        self.rank = rank
        self.names = [name for name, _ in params]
        self.shapes = [tuple(p.shape) for _, p in params]
        self.grouping = Grouping(params, default)

    def regrouped(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> Grouping:
        """A grouping of the same parameters by `groups` (None or empty: one per parameter;
        ValueError when they do not cover every parameter exactly once or name an unknown
        compressor)."""
        return Grouping(params, self.default, groups or None)

    def use(self, grouping: Grouping) -> None:
        self.grouping = grouping

    def context(self, sender: int, key: int, group: int) -> CompressionContext:
        return CompressionContext(self.seed, sender, BROADCAST, key, group)

    # --- buffers ---------------------------------------------------------------------------

    def flats(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.grouping.flats(tensors)

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros(g.layout.numel) for g in self.grouping.groups]

    def per_parameter(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.grouping.views(flats)

    def add_into(self, params: NamedParams, flats: Sequence[torch.Tensor]) -> None:
        self.grouping.add_into(params, flats)

    def copy_into(self, params: NamedParams, flats: Sequence[torch.Tensor]) -> None:
        self.grouping.copy_into(params, flats)

    # --- the wire --------------------------------------------------------------------------

    def compress(self, flat: torch.Tensor, key: int, group: int) -> Compressed:
        compressor = self.grouping.groups[group].compressor
        return compressor.compress(flat, self.context(self.rank, key, group))

    def decompress_own(self, compressed: Compressed, key: int, group: int) -> torch.Tensor:
        """What every neighbour decodes from this peer's payload, bit for bit."""
        compressor = self.grouping.groups[group].compressor
        return compressor.decompress(compressed, self.context(self.rank, key, group))

    def payload(self, sent: Sequence[Compressed]) -> Payload:
        return tuple(
            to_wire(group.name, compressed)
            for group, compressed in zip(self.grouping.groups, sent, strict=True)
        )

    def spec(
        self, key_of_round: Callable[[int], int], grouping: Grouping | None = None
    ) -> PayloadSpec:
        """What a neighbour's envelope holds under `grouping` (the current one by default);
        each payload is decoded at receipt with the randomness of (sender,
        key_of_round(round), group)."""
        grouping = self.grouping if grouping is None else grouping
        return decoding_spec(grouping, self.seed, BROADCAST, key_of_round)

    def decoded(self, envelope: Envelope, group: int) -> torch.Tensor:
        """A neighbour's buffer for `group`, as the transport decoded it at receipt."""
        return decoded_group(envelope, group)

    # --- error feedback ----------------------------------------------------------------------

    def feedback_memories(self) -> dict[str, torch.Tensor]:
        return self.grouping.feedback_memories(self.names)

    def load_feedback_memories(self, saved: Mapping[str, object]) -> None:
        if not isinstance(saved, Mapping):
            raise ValueError(f"feedback memories: expected a dict, got {type(saved).__name__}")
        self.grouping.load_feedback_memories(self.names, self.shapes, saved)


def decoding_spec(
    grouping: Grouping, seed: int, receiver: int, key_of_round: Callable[[int], int]
) -> PayloadSpec:
    """What a neighbour's envelope holds under `grouping`: each group decoded at receipt with
    the randomness of (sender, `receiver`, key_of_round(round), group)."""

    def decode(group: int, data: memoryview, sender: int, round: int) -> torch.Tensor:
        wanted = grouping.groups[group]
        compressed = Compressed(wanted.compressor.codec, (wanted.layout.numel,), data)
        context = CompressionContext(seed, sender, receiver, key_of_round(round), group)
        return wanted.compressor.decompress(compressed, context)

    return grouping.spec(decode)


def decoded_group(envelope: Envelope, group: int) -> torch.Tensor:
    """A neighbour's buffer for `group`, as the transport decoded it at receipt."""
    value = envelope.decoded[group] if len(envelope.decoded) > group else None
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"envelope from peer {envelope.sender} was not decoded at receipt (group "
            f"{group}): the transport must check it against the spec first"
        )
    return value
