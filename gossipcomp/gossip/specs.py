"""Gossip algorithms from spec strings, NAME[:key=value,...], as compressors are built.

    dpsgd:gamma=auto
    powergossip:rank=2,steps=4
    choco:compressor=sign,steps=4,gamma=0.7
    def:compressor=topk:ratio=0.01,zeta=0.5,gamma=0.2

A compressor spec with options of its own separated by commas goes in parentheses:
`choco:compressor=(randomk:ratio=0.01,unbiased=false)`. Each algorithm class declares its
options (`OPTIONS`: type, default, whether "auto" is allowed, and the TrainConfig field its flag
fills) and builds itself from them (`from_options`); `gamma=auto` is the topology's spectral
step gamma* = 2 / (2 - lambda_2 - lambda_min). Unknown names and keys, values of the wrong type
and specs over MAX_SPEC_CHARS are refused naming what is wrong and what exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gossipcomp.gossip.base import GossipAlgorithm
from gossipcomp.gossip.catalog import MAX_GOSSIP_STEPS
from gossipcomp.gossip.clipping import ClipRadius
from gossipcomp.inputs.text import quoted, split_top_level

AUTO = "auto"
MAX_SPEC_CHARS = 1000


@dataclass(frozen=True)
class Option:
    """One option of an algorithm's spec."""

    kind: type  # int, float or str
    default: Any = None  # None: the algorithm's own default (or required, see `required`)
    required: bool = False
    auto: bool = False  # "auto" accepted: the topology's spectral step
    flag: str | None = None  # the TrainConfig field (and command-line flag) that fills it


@dataclass(frozen=True)
class BuildContext:
    """What a spec leaves to the run: the seed, the topology's spectral step, clipping."""

    seed: int
    spectral_step: float
    clipping: ClipRadius | None = None

    def step(self, value: Any) -> float:
        """A consensus step option: a number, or "auto" / unset for the spectral step."""
        return self.spectral_step if value in (None, AUTO) else float(value)


class SpecBuilt(Protocol):
    """An algorithm class that can be built from a spec."""

    name: str
    OPTIONS: Mapping[str, Option]

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> GossipAlgorithm:
        """Build from parsed options (every declared key present, defaults filled in)."""
        ...


def parse_options(spec: str, registry: Mapping[str, SpecBuilt]) -> tuple[str, dict[str, Any]]:
    """(name, every declared option with its value or default); ValueError naming the problem."""
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"algorithm spec: {len(spec)} characters, at most {MAX_SPEC_CHARS}")
    name, _, arguments = spec.strip().partition(":")
    cls = registry.get(name.strip())
    if cls is None:
        raise ValueError(f"unknown algorithm {quoted(name)}; known: {', '.join(sorted(registry))}")
    declared = cls.OPTIONS
    values: dict[str, Any] = {}
    for item in split_top_level(arguments, f"algorithm spec {quoted(spec)}"):
        key, equals, raw = (piece.strip() for piece in item.partition("="))
        if not equals:
            raise ValueError(
                f"algorithm spec {quoted(spec)}: expected key=value, got {quoted(item)}"
            )
        if key not in declared:
            known = ", ".join(declared) or "none"
            raise ValueError(
                f"algorithm {cls.name} has no option {quoted(key)}; its options: {known}"
            )
        if key in values:
            raise ValueError(f"algorithm spec {quoted(spec)}: option {key!r} given twice")
        if raw.startswith("(") and raw.endswith(")"):
            raw = raw[1:-1].strip()
        values[key] = _convert(cls.name, key, declared[key], raw)
    for key, option in declared.items():
        if key not in values:
            if option.required:
                raise ValueError(f"algorithm {cls.name} needs option {key!r} (e.g. {key}=sign)")
            values[key] = option.default
    return cls.name, values


def _convert(name: str, key: str, option: Option, raw: str) -> Any:
    if option.auto and raw == AUTO:
        return AUTO
    try:
        if option.kind is int:
            return int(raw)
        if option.kind is float:
            return float(raw)
    except ValueError:
        wanted = option.kind.__name__ + (" or 'auto'" if option.auto else "")
        raise ValueError(f"{name} option {key}: expected {wanted}, got {quoted(raw)}") from None
    if not raw:
        raise ValueError(f"{name} option {key}: expected a value")
    return raw


def canonical_spec(name: str, options: Mapping[str, Any]) -> str:
    """The spec of `name` with the options that are set, in declaration order."""
    parts = []
    for key, value in options.items():
        if value is None:
            continue
        text = str(value)
        parts.append(f"{key}=({text})" if "," in text else f"{key}={text}")
    return f"{name}:{','.join(parts)}" if parts else name


def check_steps(steps: int) -> int:
    if not 1 <= steps <= MAX_GOSSIP_STEPS:
        raise ValueError(f"steps must be in [1, {MAX_GOSSIP_STEPS}], got {steps}")
    return steps
