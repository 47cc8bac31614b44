"""Level ladders: a compressor family's settings from most compressed to none.

Bandwidth-adaptive gossip (levels/rate.py) moves a sender up and down a ladder: level 1 is the
cheapest setting, each level above sends more bytes, and the top sends the model uncompressed
(`identity`), so a fast link is never held back by compression. A level is a position on the
ladder (1-based), so schedules carry small integers whatever the family.

Rungs per family (a registry by compressor name, `RUNGS`):
- topk, randomk, dgc: the ratio, on a 1-2-5 series from 1e-4 to 1 (randomk keeps its
  `unbiased` flag);
- qsgd: levels s = 2^b - 1 for b = 1..7 bits (each the most levels b bits carry);
- any other compressor: itself, fp16, identity.
The configured compressor is always on its ladder (its level is the default, what a peer uses
before any schedule sets one). The rungs are then ordered by the bytes they send for the
model's tensors; of rungs sending the same bytes only one stays (the configured one, else the
highest fidelity); every rung sending at least as many bytes as no compression is dropped
below the top, `identity`. A compressor wrapped in error feedback ("ef+...") keeps the wrapper
on every rung, so its memory carries over from one level to the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gossipcomp.compress.base import Compressor
from gossipcomp.compress.dense import Float16, Identity
from gossipcomp.compress.feedback import ErrorFeedback
from gossipcomp.compress.quantize import MAX_LEVELS, QSGD
from gossipcomp.compress.registry import EF_PREFIX, parse_spec
from gossipcomp.inputs.numbers import checked_integer

RATIO_SERIES = tuple(m * 10.0**e for e in range(-4, 0) for m in (1, 2, 5)) + (1.0,)
QSGD_SERIES = tuple(2**bits - 1 for bits in range(1, 8) if 2**bits - 1 <= MAX_LEVELS)


def _ratio_rungs(compressor: Compressor) -> list[Compressor]:
    """The same sparsifier (its other parameters kept) at every ratio of the series."""
    return [
        dataclasses.replace(compressor, ratio=float(f"{r:.6g}"))  # type: ignore[type-var]
        for r in RATIO_SERIES
    ]


def _qsgd_rungs(compressor: Compressor) -> list[Compressor]:
    """QSGD at the most levels each bit width carries."""
    return [QSGD(levels=s) for s in QSGD_SERIES]


def _default_rungs(compressor: Compressor) -> list[Compressor]:
    """Half precision between the compressor and none."""
    return [Float16()]


# compressor name -> the rungs of its family besides itself and identity (at the top)
RUNGS: dict[str, Callable[[Compressor], list[Compressor]]] = {
    "topk": _ratio_rungs,
    "randomk": _ratio_rungs,
    "dgc": _ratio_rungs,
    "qsgd": _qsgd_rungs,
}


@dataclass(frozen=True)
class Ladder:
    """A compressor's ladder for one model: specs from most compressed to none, the bytes
    each sends for the model's tensors (one payload per tensor), and the configured one's level."""

    specs: tuple[str, ...]  # level L is specs[L - 1]
    nbytes: tuple[int, ...]  # strictly increasing
    default: int  # the configured compressor's level

    @property
    def top(self) -> int:
        return len(self.specs)

    def spec(self, level: int) -> str:
        """The compressor spec of `level`; ValueError naming the ladder when it is not on it."""
        self.check(level, "level")
        return self.specs[level - 1]

    def check(self, level: object, what: str) -> int:
        """`level` when it is an integer on this ladder; ValueError naming `what` otherwise."""
        ladder = f"the ladder {self.specs[0]} ... {self.specs[-1]}"
        return checked_integer(f"{what} ({ladder})", level, 1, self.top)


def ladder_for(spec: str, numels: Sequence[int]) -> Ladder:
    """The ladder of compressor `spec` for a model of tensors of `numels` elements (module
    docstring); ValueError for an unknown spec."""
    configured = parse_spec(spec)
    feedback = isinstance(configured, ErrorFeedback)
    inner = configured.inner if isinstance(configured, ErrorFeedback) else configured
    rungs = RUNGS.get(inner.name, _default_rungs)(inner)
    prefix = EF_PREFIX if feedback else ""

    def size(compressor: Compressor) -> int:
        return sum(compressor.wire_bytes(n) for n in numels)

    plain = size(Identity())
    chosen: dict[int, str] = {}  # bytes -> spec, keeping the highest fidelity of equal bytes
    for rung in rungs:  # in ascending fidelity
        nbytes = size(rung)
        if nbytes < plain:
            chosen[nbytes] = prefix + rung.spec
    own = size(inner)
    chosen = {n: s for n, s in chosen.items() if n != own}
    chosen[own] = configured.spec
    if own < plain:
        chosen[plain] = prefix + Identity().spec
    order = sorted(chosen)
    specs = tuple(chosen[n] for n in order)
    return Ladder(specs, tuple(order), specs.index(configured.spec) + 1)
