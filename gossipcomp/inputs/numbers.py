"""Range checks for numbers that came from outside (a file, a checkpoint, the network, a spec).

One check per kind, so every door refuses the same things in the same words: a bool is never a
number (True would pass as 1), NaN and infinities are never finite, an integer has no fraction,
and an error names the field, the range expected and a bounded quote of what came.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gossipcomp.inputs.text import quoted


def interval(low: float, high: float, *, closed_low: bool = True, closed_high: bool = True) -> str:
    """How a range reads in an error: "[0, 1)", "(0, inf)" (an infinite end is never in it)."""
    opening = "[" if closed_low and math.isfinite(low) else "("
    closing = "]" if closed_high and math.isfinite(high) else ")"
    return f"{opening}{low:g}, {high:g}{closing}"


def checked_number(
    what: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    closed_low: bool = True,
    closed_high: bool = True,
    error: Callable[[str], ValueError] = ValueError,
) -> float:
    """`value` as a float when it is a finite int or float (not a bool) in the range from `low`
    to `high` (each end closed unless told otherwise); otherwise `error` (a ValueError: the
    door's own kind, or a function making one from the message) naming `what`."""
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        above = low <= value if closed_low else low < value
        below = value <= high if closed_high else value < high
        ok = above and below and math.isfinite(value)  # NaN fails every comparison too
    if not ok:
        bounds = interval(low, high, closed_low=closed_low, closed_high=closed_high)
        raise error(f"{what}: expected a finite number in {bounds}, got {quoted(value)}")
    return float(value)


def checked_integer(
    what: str,
    value: Any,
    low: int,
    high: int | None = None,
    error: Callable[[str], ValueError] = ValueError,
) -> int:
    """`value` when it is an int (not a bool) in [low, high] (no upper end when `high` is
    None); otherwise `error` naming `what`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise error(f"{what}: expected an integer {bounds}, got {quoted(value)}")
    return value
