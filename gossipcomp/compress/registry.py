"""Compressors by name, and spec strings: NAME[:key=value,...], optionally prefixed "ef+".

Values are parsed to each parameter's declared type: float, int, or bool written true/false.
`parse_spec(c.spec)` rebuilds a compressor equal to c.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

from gossipcomp.compress.base import Compressor
from gossipcomp.compress.codec import Codec, format_value
from gossipcomp.compress.dense import BFloat16, Float16, Identity
from gossipcomp.compress.feedback import ErrorFeedback
from gossipcomp.compress.quantize import QSGD, TernGrad
from gossipcomp.compress.sign import OneBit, Sign
from gossipcomp.compress.sparse import DGC, RandomK, TopK

EF_PREFIX = "ef+"

_BUILT_IN = (Identity, Float16, BFloat16, TopK, RandomK, DGC, QSGD, TernGrad, Sign, OneBit)
COMPRESSORS: dict[str, type[Codec]] = {cls.name: cls for cls in _BUILT_IN}
if len(COMPRESSORS) != len(_BUILT_IN) or "" in COMPRESSORS:
    raise ImportError("every built-in compressor needs its own non-empty name")


def parameters(cls: type[Codec]) -> dict[str, tuple[type, object]]:
    """Each parameter of a compressor class: its declared type and default."""
    return dict(_declared(cls))


@functools.cache
def _declared(cls: type[Codec]) -> tuple[tuple[str, tuple[type, object]], ...]:
    """`parameters`, worked out once per class: typing.get_type_hints evaluates every
    annotation anew on each call, and the coordinator parses each report's compressor spec
    (a fifth of its work on a ring4 reporting every round, 2026-11-29)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, (hints[f.name], f.default)) for f in dataclasses.fields(cls))


def parse_spec(spec: str) -> Compressor:
    """Build a compressor from a spec such as "topk:ratio=0.01" or "ef+sign"."""
    text = spec.strip()
    if text.startswith(EF_PREFIX):
        inner = text[len(EF_PREFIX) :]
        if inner.startswith(EF_PREFIX):
            raise ValueError(f"spec {spec!r}: error feedback cannot wrap error feedback")
        return ErrorFeedback(parse_spec(inner))
    name, _, arguments = text.partition(":")
    name = name.strip()
    cls = COMPRESSORS.get(name)
    if cls is None:
        known = ", ".join(sorted(COMPRESSORS))
        raise ValueError(
            f"unknown compressor {name!r} in spec {spec!r}; known: {known} "
            f"(any of them may be prefixed {EF_PREFIX!r} for error feedback)"
        )
    declared = parameters(cls)
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, equals, raw = (piece.strip() for piece in item.partition("="))
        if not equals:
            raise ValueError(f"spec {spec!r}: expected key=value, got {item!r}")
        if key not in declared:
            raise ValueError(
                f"compressor {name!r} has no parameter {key!r}; its parameters: "
                f"{_describe(declared)}"
            )
        if key in values:
            raise ValueError(f"spec {spec!r}: parameter {key!r} given twice")
        values[key] = _convert(declared[key][0], raw, name, key)
    return cls(**values)  # type: ignore[arg-type]


def _describe(declared: dict[str, tuple[type, object]]) -> str:
    if not declared:
        return "none"
    return ", ".join(f"{key}={format_value(default)}" for key, (_, default) in declared.items())


def _convert(kind: type, raw: str, name: str, key: str) -> object:
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false"):
                raise ValueError
            return lowered == "true"
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"{name} parameter {key}: expected {kind.__name__}, got {raw!r}") from None
    raise TypeError(f"{name} parameter {key} has unsupported type {kind!r}")
