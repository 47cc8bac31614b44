"""What a plan is made of: tensors to send, groups fused into one buffer, and the cover check.

A plan cuts the model's parameters, in model order, into contiguous groups; each group is one
flat buffer compressed once with its own compressor and sent once. Every tensor belongs to
exactly one group. `check_cover` enforces this on plans from anywhere, including the network, so
its messages quote what they echo through `gossipcomp.inputs.text.quoted`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted

SHOWN_NAMES = 5  # offending names listed in one error message at most
MAX_NAME_CHARS = 4096  # characters of one tensor name at most


@dataclass(frozen=True)
class TensorInfo:
    """One parameter as the planner sees it: its name, size and when its gradient is ready."""

    name: str  # parameter name, e.g. "blocks.3.linear.weight"
    numel: int
    # seconds after the iteration starts (same origin as CostModel.compute_s) when this tensor's
    # gradient is ready (all-reduce mode); 0 for gossip, where all are ready at once
    ready_at: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME_CHARS:
            raise ValueError(
                f"tensor name {quoted(self.name)}: expected a string of 1 to "
                f"{MAX_NAME_CHARS} characters"
            )
        checked_integer(f"tensor {quoted(self.name)} numel", self.numel, 0)
        checked_number(f"tensor {quoted(self.name)} ready_at (seconds)", self.ready_at, 0.0)


@dataclass(frozen=True)
class TensorGroup:
    """Parameters fused into one flat buffer (in model order) and the compressor applied to it."""

    names: tuple[str, ...]  # parameter names fused into one flat buffer, in model order
    # compressor spec for the group, parseable by gossipcomp.compress.parse_spec,
    # e.g. "sign", "fp16", "identity", "topk:ratio=0.01"
    compressor: str


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(quoted(n) for n in names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def check_cover(
    groups: Sequence[TensorGroup], names: Sequence[str], *, contiguous: bool = True
) -> None:
    """Raise ValueError unless `groups` are non-empty and cover every name of `names` (the
    model's parameters, in order) exactly once, naming nothing else; with `contiguous` (the
    default: merge plans) they must also be contiguous runs of `names` in order. With
    contiguous=False any sets will do (gossip groupings).

    The message names the problem: an empty group, unknown names, duplicated names, missing
    names, or names out of model order (at most SHOWN_NAMES of each, each quoted).
    """
    position = {name: index for index, name in enumerate(names)}
    if len(position) != len(names):
        raise ValueError("the model's parameter names are not unique; expected one per tensor")
    seen: set[str] = set()
    unknown: list[str] = []
    duplicated: list[str] = []
    for index, group in enumerate(groups):
        if not group.names:
            raise ValueError(f"group {index} is empty; expected at least one tensor name")
        for name in group.names:
            if name not in position:
                unknown.append(name)
            elif name in seen:
                duplicated.append(name)
            seen.add(name)
    if unknown:
        raise ValueError(
            f"plan names {len(unknown)} unknown tensor(s): {_listed(unknown)}; "
            "expected only the model's parameter names"
        )
    if duplicated:
        raise ValueError(
            f"plan names {len(duplicated)} tensor(s) more than once: "
            f"{_listed(duplicated)}; expected each exactly once"
        )
    missing = [name for name in names if name not in seen]
    if missing:
        raise ValueError(
            f"plan leaves out {len(missing)} tensor(s): {_listed(missing)}; "
            "expected every tensor in exactly one group"
        )
    if not contiguous:
        return
    flat = [name for group in groups for name in group.names]
    for expected, (index, got) in zip(names, enumerate(flat), strict=True):
        if got != expected:
            raise ValueError(
                f"plan is out of model order at tensor {index}: got {quoted(got)}, "
                f"expected {quoted(expected)} (groups are contiguous runs in order)"
            )


def groups_from_cuts(
    tensors: Sequence[TensorInfo], cuts: Sequence[int], compressors: Sequence[str]
) -> tuple[TensorGroup, ...]:
    """Groups [cuts[k], cuts[k+1]) of `tensors` with compressors[k]; cuts run 0 < ... < len."""
    increasing = all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
    if (
        len(cuts) != len(compressors) + 1
        or cuts[0] != 0
        or cuts[-1] != len(tensors)
        or not (increasing)
    ):
        raise ValueError(
            f"cuts {quoted(list(cuts))} must rise strictly from 0 to {len(tensors)} with "
            f"one more entry than the {len(compressors)} compressors"
        )
    return tuple(
        TensorGroup(tuple(t.name for t in tensors[start:stop]), spec)
        for start, stop, spec in zip(cuts[:-1], cuts[1:], compressors, strict=True)
    )
