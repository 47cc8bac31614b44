"""Merged compression for gossip: groups of parameters fused into one buffer, one compressor each.

A `Grouping` splits a model's parameters into groups (each a list of parameter names, with a
compressor spec); every group travels as one wire tensor: its parameters packed into one flat
float32 buffer (compress/flat.py), compressed once. Compressing 120 small tensors one by one
costs 3-7x the same work on one buffer (docs/design.md), which is what merging saves.

Per-edge state that algorithms keep (Choco's public copies, DEF-ATC's references) lives in one
flat buffer per group, with a view per parameter, so regrouping (a new schedule) and checkpoints
go through the per-parameter views and never depend on the grouping. Each group has its own
compressor instance, so an error-feedback memory belongs to its group (key: receiver -1, the
group's index) and is saved per parameter as well.

A compressor whose decoded values hang on a statistic of its input (sign's mean |x|, QSGD's
norm, ...) keeps that statistic per parameter inside a merged group (compress/segmented.py,
`per_segment`): one scale over tensors of different magnitudes cost 2 to 3 accuracy points on
a 102-tensor model; per tensor it costs 4 bytes per extra tensor and no extra call.

The randomness of a compressed payload is derived from (seed, sender, round key, group index):
both ends agree on it without sending it, as for single tensors before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from gossipcomp.compress import ErrorFeedback, parse_spec, per_segment
from gossipcomp.compress.base import Compressed, Compressor
from gossipcomp.compress.flat import FlatLayout
from gossipcomp.gossip.base import NamedParams
from gossipcomp.inputs.text import quoted
from gossipcomp.schedule.groups import TensorGroup, check_cover
from gossipcomp.transport.base import PayloadSpec, TensorSpec, WireTensor

BROADCAST = -1  # CompressionContext.receiver when one payload goes to every neighbour


@dataclass(frozen=True)
class Group:
    """A group of a `Grouping`: parameter positions, their layout and the group's compressor."""

    name: str  # wire tensor name: the parameter's name, or "first+N more" for a merged group
    members: tuple[int, ...]  # positions in the model's parameter list, in model order
    layout: FlatLayout
    compressor: Compressor


class Grouping:
    """The groups of one schedule over a model's parameters (one group per parameter when no
    groups are given), each with its own compressor instance."""

    def __init__(
        self,
        params: NamedParams,
        default: Compressor,
        groups: Sequence[TensorGroup] | None = None,
    ) -> None:
        names = [name for name, _ in params]
        position = {name: i for i, name in enumerate(names)}
        if groups is None:
            members: list[tuple[int, ...]] = [(i,) for i in range(len(params))]
            specs = [default.spec] * len(params)
        else:
            check_cover(groups, names, contiguous=False)
            members = [tuple(sorted(position[n] for n in group.names)) for group in groups]
            specs = [group.compressor for group in groups]
        self.groups: list[Group] = []
        for indices, spec in zip(members, specs, strict=True):
            layout = FlatLayout.of([params[i][1] for i in indices])
            self.groups.append(
                Group(
                    name=group_name([names[i] for i in indices]),
                    members=indices,
                    layout=layout,
                    compressor=per_segment(parse_spec(spec), layout.numels),
                )
            )

    def __len__(self) -> int:
        return len(self.groups)

    def flats(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One packed float32 buffer per group, from one tensor per parameter."""
        return [g.layout.pack([tensors[i] for i in g.members]) for g in self.groups]

    def views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One tensor per parameter (model order), each a view into its group's buffer."""
        per_param: dict[int, torch.Tensor] = {}
        for group, flat in zip(self.groups, flats, strict=True):
            per_param.update(zip(group.members, group.layout.views(flat), strict=True))
        return [per_param[i] for i in range(len(per_param))]

    def add_into(
        self, params: NamedParams, flats: Sequence[torch.Tensor], alpha: float = 1.0
    ) -> None:
        """params += alpha * the per-group buffers, parameter by parameter (any float dtype)."""
        for group, flat in zip(self.groups, flats, strict=True):
            for i, view in zip(group.members, group.layout.views(flat), strict=True):
                params[i][1].add_(view.to(params[i][1].dtype), alpha=alpha)

    def copy_into(self, params: NamedParams, flats: Sequence[torch.Tensor]) -> None:
        """params = the per-group buffers."""
        for group, flat in zip(self.groups, flats, strict=True):
            group.layout.unpack(flat, [params[i][1] for i in group.members])

    def spec(self, decoder: Callable[[int, memoryview, int, int], torch.Tensor]) -> PayloadSpec:
        """What a neighbour's envelope holds: one compressed wire tensor per group, decoded at
        receipt by `decoder(group, data, sender, round)` (which validates the payload)."""
        return tuple(
            TensorSpec(
                name=g.name,
                dtype="float32",
                shape=(g.layout.numel,),
                codec=g.compressor.codec,
                nbytes=g.compressor.wire_bytes(g.layout.numel),
                require_finite=False,  # the decoder checks scales and values
                decode=partial(decoder, index),
            )
            for index, g in enumerate(self.groups)
        )

    def feedback_memories(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Error-feedback memories of every group that has one, as copies per parameter name."""
        saved: dict[str, torch.Tensor] = {}
        for index, group in enumerate(self.groups):
            if isinstance(group.compressor, ErrorFeedback):
                memory = group.compressor.memory(BROADCAST, index)
                if memory is not None:
                    for i, view in zip(group.members, group.layout.views(memory), strict=True):
                        saved[names[i]] = view.clone()
        return saved

    def load_feedback_memories(
        self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], saved: Mapping[str, object]
    ) -> None:
        """Restore memories saved by `feedback_memories` (possibly under another grouping): a
        group gets a memory when all its parameters have one. Raises ValueError, changing
        nothing, when a saved memory is not a finite float tensor of its parameter's shape."""
        position = {name: i for i, name in enumerate(names)}
        for name, memory in saved.items():
            if name not in position:
                raise ValueError(f"feedback memory for unknown parameter {quoted(name)}")
            shape = shapes[position[name]]
            if (
                not isinstance(memory, torch.Tensor)
                or tuple(memory.shape) != shape
                or not memory.is_floating_point()
                or not bool(torch.isfinite(memory).all())
            ):
                raise ValueError(
                    f"feedback memory of {quoted(name)}: expected a finite float tensor of "
                    f"shape {shape}"
                )
        for index, group in enumerate(self.groups):
            compressor = group.compressor
            if not isinstance(compressor, ErrorFeedback):
                continue
            compressor.reset()
            parts = [saved.get(names[i]) for i in group.members]
            if all(isinstance(part, torch.Tensor) for part in parts):
                flat = group.layout.pack([p for p in parts if isinstance(p, torch.Tensor)])
                compressor.set_memory(BROADCAST, index, flat)


def group_name(names: Sequence[str]) -> str:
    """A group's wire tensor name: its only parameter's, or "first+N more"."""
    return names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1} more"


def to_wire(name: str, compressed: Compressed) -> WireTensor:
    return WireTensor(name, "float32", compressed.shape, compressed.codec, compressed.data)
