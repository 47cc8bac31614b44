"""Saving, restoring and resynchronising an algorithm's state: nothing half-restored.

A checkpoint written by one configuration must not be loaded silently into another: every saved
tensor is checked against the one it replaces (count, shape, dtype) before any is copied. The
same care applies when an edge resumes and a neighbour's copy of some state arrives over the
wire: its shapes were validated by the transport against the resume spec, and it replaces the
tracked copy only as a whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gossipcomp.gossip.base import NamedParams
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec
from gossipcomp.transport.codec import all_finite, decode_raw, encode_raw, tensor_spec


def require_keys(state: Mapping[str, Any], expected: set[str], algorithm: str) -> None:
    """Raise ValueError unless `state` holds exactly the `expected` keys."""
    if not isinstance(state, Mapping) or set(state) != expected:
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{algorithm} state: expected keys {sorted(expected)}, got {found}")


def tensor_mismatch(expected: torch.Tensor, value: object) -> str | None:
    """None when `value` is a tensor of `expected`'s shape and dtype, else what it is instead
    ("(2, 3) torch.float64" or a type name), for an error message to show."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.shape != expected.shape or value.dtype != expected.dtype:
        return f"{tuple(value.shape)} {value.dtype}"
    return None


def checked_tensors(
    what: str,
    current: Sequence[torch.Tensor],
    saved: Sequence[torch.Tensor],
    finite: bool = True,
) -> list[torch.Tensor]:
    """Copies of `saved` on the devices of `current`, after checking they match one for one
    and, with `finite`, hold finite values (a NaN restored into an algorithm's copy shows only
    rounds later). A model's checkpoint passes finite=False: a constant buffer such as a
    causal mask may hold -inf (peer/checkpoint.py checks a model's tensors by its own rule)."""
    if not isinstance(saved, Sequence) or len(saved) != len(current):
        count = len(saved) if isinstance(saved, Sequence) else type(saved).__name__
        raise ValueError(f"{what}: expected {len(current)} tensors, got {count}")
    for index, (now, then) in enumerate(zip(current, saved, strict=True)):
        found = tensor_mismatch(now, then)
        if found is not None:
            raise ValueError(
                f"{what}[{index}]: expected {tuple(now.shape)} {now.dtype}, got {found}"
            )
        if finite and then.is_floating_point() and not all_finite(then):
            raise ValueError(f"{what}[{index}]: holds NaN/Inf")
    return [then.detach().clone().to(now.device) for now, then in zip(current, saved, strict=True)]


def save_edge_tensors(per_edge: Mapping[int, Sequence[torch.Tensor]]) -> dict[int, list]:
    """Per-neighbour tensors (tracked copies, references) as a checkpointable mapping."""
    return {j: [t.clone() for t in tensors] for j, tensors in per_edge.items()}


def load_edge_tensors(
    what: str,
    current: Mapping[int, Sequence[torch.Tensor]],
    saved: Mapping[int, Sequence[torch.Tensor]],
) -> dict[int, list[torch.Tensor]]:
    """Checked copies of saved per-neighbour tensors: the same neighbours, shapes and dtypes."""
    if not isinstance(saved, Mapping) or set(saved) != set(current):
        found = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(
            f"{what}: expected neighbours {sorted(current)}, got {found} "
            "(another topology or rank?)"
        )
    return {j: checked_tensors(f"{what} of {j}", current[j], saved[j]) for j in current}


def raw_copy_spec(params: NamedParams) -> PayloadSpec:
    """What a resuming neighbour sends: one float32 tensor per parameter, exactly."""
    return tuple(tensor_spec(name, p.detach().float()) for name, p in params)


def raw_copy_payload(params: NamedParams, tensors: Sequence[torch.Tensor]) -> Payload:
    """`tensors` (one per parameter) as raw float32 wire tensors named like the parameters."""
    return tuple(
        encode_raw(name, t.detach().float()) for (name, _), t in zip(params, tensors, strict=True)
    )


def restored_tensors(
    current: Sequence[torch.Tensor], envelope: Envelope | None, what: str
) -> list[torch.Tensor]:
    """A neighbour's exact copy of `current` (validated by the transport), checked against it."""
    if envelope is None:
        raise ValueError(f"{what}: needs the neighbour's copy, got nothing")
    return checked_tensors(what, current, [decode_raw(wire) for wire in envelope.tensors])
