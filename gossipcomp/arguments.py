"""Argument types for the command lines (`gossipcomp ...` and `gossipcomp allreduce`).

Each returns an argparse type that turns a flag's text into a checked number, or raises
ArgumentTypeError naming the flag's meaning, what was expected and (shortened) what was given,
so every command line words its errors alike.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from gossipcomp.text import quoted


def integer(what: str, low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper limit when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be an integer, got {quoted(text)}"
            ) from None
        if value < low or (high is not None and value > high):
            expected = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{what} must be {expected}, got {value}")
        return value

    return parse


def number(
    what: str,
    low: float,
    high: float = math.inf,
    *,
    low_closed: bool = False,
    high_closed: bool = True,
) -> Callable[[str], float]:
    """An argparse type: a finite number between `low` and `high`, each end excluded or
    included as told. NaN and infinities are refused: float() accepts them, and a NaN round
    deadline failed every exchange while an infinite one crashed."""
    if math.isfinite(high):
        expected = f"in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
    else:
        expected = f"{'>=' if low_closed else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # refused below, with the same message
        above = value >= low if low_closed else value > low
        below = value <= high if high_closed else value < high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(
                f"{what} must be a finite number {expected}, got {quoted(text)}"
            )
        return value

    return parse
