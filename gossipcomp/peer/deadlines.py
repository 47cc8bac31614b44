"""Bounds on a peer's times: its round deadline, and the checkpointed pace it may believe."""

from __future__ import annotations

from gossipcomp.inputs.numbers import checked_number

MIN_ROUND_SECONDS = 1e-6  # a checkpointed pace below this would believe any claimed round
MAX_ROUND_TIMEOUT = 86400.0  # seconds: a round deadline beyond a day is a typing mistake


def check_round_timeout(seconds: float) -> None:
    """ValueError unless `seconds` is a round deadline in (0, MAX_ROUND_TIMEOUT]."""
    checked_number("round_timeout", seconds, 0.0, MAX_ROUND_TIMEOUT, closed_low=False)
