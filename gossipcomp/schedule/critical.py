"""Critical learning phases (Accordion, Agarwal et al. 2021): when a layer's gradient changes fast.

Accordion observes that compressing hard while gradients change quickly costs accuracy that
compressing hard later does not, and detects those phases cheaply: the norm of each layer's
gradient, averaged over a window of rounds, changing by `threshold` (50%) or more relative to the
previous window. `CriticalPhase` keeps those running means for one peer; the coordinator raises
the levels of a critical peer's links one step (`--boost`). Pure arithmetic on the norms the
trainer hands in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gossipcomp.inputs.numbers import checked_integer, checked_number

DEFAULT_WINDOW = 10  # rounds per window
DEFAULT_THRESHOLD = 0.5  # relative change of a layer's mean gradient norm that is critical


class CriticalPhase:
    """Per layer, the mean gradient norm of the current and the previous complete window."""

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD) -> None:
        checked_integer("window", window, 1, 10**6)
        checked_number("threshold", threshold, 0.0, closed_low=False)
        self.window = window
        self.threshold = threshold
        self._layers: int | None = None  # fixed by the first round observed
        self._sums: list[float] = []
        self._count = 0
        self._previous: list[float] | None = None
        self.critical = False  # the last complete window changed some layer by >= threshold

    def observe(self, norms: Sequence[float]) -> None:
        """One round's gradient norm per layer (the same layers every round)."""
        if self._layers is None:
            self._layers = len(norms)
        if len(norms) != self._layers:
            raise ValueError(f"expected {self._layers} layer norms, got {len(norms)}")
        if not all(math.isfinite(n) and n >= 0 for n in norms):
            return  # a diverged step says nothing about phases; training catches it
        self._sums = [a + b for a, b in zip(self._sums or [0.0] * len(norms), norms, strict=True)]
        self._count += 1
        if self._count < self.window:
            return
        means = [total / self._count for total in self._sums]
        if self._previous is not None:
            self.critical = any(
                abs(now - before) >= self.threshold * before
                for now, before in zip(means, self._previous, strict=True)
                if before > 0
            )
        self._previous, self._sums, self._count = means, [], 0
