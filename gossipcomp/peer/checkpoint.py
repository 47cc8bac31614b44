"""A peer's checkpoint: what it holds (`peer_state`, for `Peer.state_dict`), and the checks of
one being restored (`Peer.load_state_dict`) that need nothing but the state and the peer's
model and neighbours: its keys, round, times, model tensors, per-neighbour counters and down
edges. Every field is hostile until checked here; the peer then checks the
schedules, levels and algorithm state against itself before it changes anything."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gossipcomp.gossip.base import GossipAlgorithm, LinkStats
from gossipcomp.gossip.state import checked_tensors
from gossipcomp.inputs.numbers import checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.peer.deadlines import MAX_ROUND_TIMEOUT, MIN_ROUND_SECONDS
from gossipcomp.peer.links import LinkMonitor
from gossipcomp.schedule.schedule import ScheduleBook
from gossipcomp.transport.base import MAX_WIRE_ROUND
from gossipcomp.transport.codec import all_finite

EXPECTED_KEYS = frozenset(
    {"round", "model", "algorithm", "bytes_sent", "bytes_received", "failures", "down"}
)
# absent from older ones; link_levels or broadcast_levels only when peers set levels
OPTIONAL_KEYS = frozenset(
    {"saved_at", "seconds_per_round", "schedules", "link_levels", "broadcast_levels", "outer"}
)
COUNTERS = ("bytes_sent", "bytes_received", "failures")


@dataclass(frozen=True)
class CheckedState:
    """The parts of a peer checkpoint checked by `check_state`, ready to restore."""

    round: int
    saved_at: float | None
    seconds_per_round: float | None
    model: dict[str, torch.Tensor]
    counters: dict[str, dict[int, int]]  # bytes_sent, bytes_received, failures
    down: list[int]


def check_state(
    state: Any,
    current: dict[str, torch.Tensor],
    neighbours: set[int],
    constants: Mapping[str, torch.Tensor],
) -> CheckedState:
    """Check a peer checkpoint against the model's `current` state dict, the peer's
    `neighbours` and the model's `constants` (its constant buffers' values, by state-dict
    key: ModelGuard); ValueError naming what is wrong and what was expected. A constant must
    hold its value; every other floating-point tensor, under each of its names (a tied
    parameter has two), must be finite unless this model's own is not (a causal mask of -inf
    on a model that takes no buffer as constant): a neighbour refuses NaN/Inf, and a NaN
    statistic that is not gossiped would spoil every evaluation."""
    expected, optional = set(EXPECTED_KEYS), set(OPTIONAL_KEYS)
    if not isinstance(state, dict) or not expected <= set(state) <= expected | optional:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"peer checkpoint: expected keys {sorted(expected)} (and optionally "
            f"{sorted(optional)}), got {quoted(keys)}"
        )
    round = state["round"]
    if isinstance(round, bool) or not isinstance(round, int) or not 0 <= round < MAX_WIRE_ROUND:
        raise ValueError(
            f"peer checkpoint: round must be an integer in [0, 2^53), got {quoted(round)}"
        )
    saved_at = _positive_seconds(state.get("saved_at"), "saved_at")
    seconds_per_round = _positive_seconds(
        state.get("seconds_per_round"),
        "seconds_per_round",
        MIN_ROUND_SECONDS,
        MAX_ROUND_TIMEOUT,
    )
    saved = state["model"]
    if not isinstance(saved, dict) or set(saved) != set(current):
        found = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(
            f"peer checkpoint: model has parameters {quoted(found)}, "
            f"this model has {sorted(current)}"
        )
    model = [saved[k] for k in current]
    checked_tensors("peer checkpoint model", list(current.values()), model, finite=False)
    for name, value in saved.items():
        if name in constants:
            if not torch.equal(value.to(constants[name].device), constants[name]):
                raise ValueError(
                    f"peer checkpoint: constant buffer {quoted(name)} differs from this "
                    "model's; expected its own value (a constant never changes in training)"
                )
        elif value.is_floating_point() and not all_finite(value) and all_finite(current[name]):
            raise ValueError(
                f"peer checkpoint: model tensor {quoted(name)} holds NaN/Inf; expected finite "
                "values, as this model's own"
            )
    counters = {key: _neighbour_counts(state[key], neighbours, key) for key in COUNTERS}
    down = state["down"]
    if not isinstance(down, list) or not set(down) <= neighbours:
        raise ValueError(
            f"peer checkpoint: down must list neighbours of {sorted(neighbours)}, got {quoted(down)}"
        )
    return CheckedState(round, saved_at, seconds_per_round, saved, counters, down)


def peer_state(
    round: int,
    model: torch.nn.Module,
    algorithm: GossipAlgorithm,
    stats: LinkStats,
    links: LinkMonitor,
    schedules: ScheduleBook,
    levels: dict[str, Any],
    outer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds of a peer at `round`: its model, algorithm state, counters
    (`stats`), down edges and pace (`links`), `schedules`, and the `levels` rows of levels set
    with the neighbours, and `outer`: the outer optimizer's and drift correction's state
    (outer/phase.py), when the peer uses either."""
    state: dict[str, Any] = {
        "round": round,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "algorithm": algorithm.state_dict(),
        "bytes_sent": dict(stats.bytes_sent),
        "bytes_received": dict(stats.bytes_received),
        "failures": dict(stats.failures),
        "down": links.not_up(),
        "saved_at": time.time(),  # with the pace: how far neighbours can be when restored
        "seconds_per_round": links.pace.seconds_per_round(),
        "schedules": schedules.state_dict(),
    }
    state.update(levels)  # levels set with the neighbours shape it
    if outer is not None:
        state["outer"] = outer
    return state


def _neighbour_counts(value: Any, neighbours: set[int], what: str) -> dict[int, int]:
    """A checkpointed per-neighbour counter, checked: neighbour ranks to integers >= 0."""
    if not isinstance(value, dict) or not all(
        j in neighbours and isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for j, n in value.items()
    ):
        raise ValueError(
            f"peer checkpoint: {what} must map neighbours of {sorted(neighbours)} to counts "
            f">= 0, got {quoted(value)}"
        )
    return dict(value)


def _positive_seconds(
    value: Any, what: str, low: float = 0.0, high: float = math.inf
) -> float | None:
    """An optional checkpointed time in seconds, checked: a finite number in (low, high], or
    None. The pace bounds how far neighbours are believed, so it may not be absurdly small."""
    if value is None:
        return None
    return checked_number(f"peer checkpoint: {what}", value, low, high, closed_low=False)
