"""Who is in a live network (topology/members.py), as the coordinator decides it.

Only the coordinator's own clock decides: a member whose last accepted report is older than
`timeout` seconds is removed; a rank of the capacity that reports while not a member (a new
rank, or one removed earlier that came back) is admitted. A report speaks only for its sender:
nothing in it names another peer's departure or arrival, so no peer can remove or admit
another. Admissions are bounded: at most `admit_per_change` ranks come in with one change, and
changes are at least `min_interval` seconds apart, so a flood of joining ranks (each must still
pass the door: a rank of the capacity, the network's protocol, topology and model) grows the
network at a bounded pace, and every change is a schedule epoch the peers apply at its
effective round (planning.py publishes it).

A member that restarted before it was removed and joins (it cannot know whether it was
removed) is a member only by a schedule newer than the one it holds; when it holds the newest
and says it waits, it is admitted again: the same members under a new epoch, paced like any
change, so a member repeating that costs at most one epoch per change interval.

The coordinator keeps no membership state across a restart: it starts from the topology's
initial members, removes those it does not hear from within `timeout`, and admits the others
as they report.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gossipcomp.inputs.numbers import checked_integer, checked_number

DEFAULT_MEMBER_TIMEOUT = 30.0  # seconds of silence after which a member is removed
MAX_MEMBER_TIMEOUT = 86_400.0
DEFAULT_ADMIT_PER_CHANGE = 4  # ranks admitted by one membership change at most


class MemberLiveness:
    """The coordinator's view of which ranks are alive: when each was last heard."""

    def __init__(
        self,
        initial: tuple[int, ...],
        timeout: float = DEFAULT_MEMBER_TIMEOUT,
        *,
        admit_per_change: int = DEFAULT_ADMIT_PER_CHANGE,
        min_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`min_interval`: seconds between two membership changes at least (0: one a
        decision)."""
        checked_number("member timeout", timeout, 0.0, MAX_MEMBER_TIMEOUT, closed_low=False)
        checked_integer("admit_per_change", admit_per_change, 1, 1 << 20)
        checked_number("min_interval", min_interval, 0.0)
        self.initial = initial
        self.timeout = timeout
        self.admit_per_change = admit_per_change
        self.min_interval = min_interval
        self._clock = clock
        self._started = clock()
        self._heard: dict[int, float] = {}  # rank -> when its last accepted report came
        self._rejoining: set[int] = set()  # ranks waiting for a schedule naming them again
        self._changed_at: float | None = None

    def heard(self, rank: int, rejoining: bool = False) -> None:
        """An accepted report from `rank` (checked: a rank of the capacity) just came;
        `rejoining`: it holds the newest schedule and still waits to be admitted."""
        self._heard[rank] = self._clock()
        if rejoining:
            self._rejoining.add(rank)
        else:
            self._rejoining.discard(rank)

    def silent(self, members: tuple[int, ...]) -> list[int]:
        """The members not heard within the timeout (counted from the coordinator's start for
        one never heard)."""
        now = self._clock()
        return [r for r in members if now - self._heard.get(r, self._started) > self.timeout]

    def decide(self, members: tuple[int, ...]) -> tuple[int, ...] | None:
        """The members from now on, or None when no change is due: silent ones out, ranks
        heard within the timeout that are not members in (at most `admit_per_change`, lowest
        first), and the same members again when a member waits to be admitted again. Never
        empties the network (the last members stay while nobody else is heard)."""
        now = self._clock()
        if self._changed_at is not None and now - self._changed_at < self.min_interval:
            return None
        silent = set(self.silent(members))
        waiting = sorted(
            r for r, at in self._heard.items() if r not in members and now - at <= self.timeout
        )
        admitted = waiting[: self.admit_per_change]
        kept = [r for r in members if r not in silent]
        if not kept and not admitted:
            return None
        new = tuple(sorted({*kept, *admitted}))
        if new == members and not self._rejoining.intersection(kept):
            return None
        self._rejoining.clear()  # the new schedule names them; a report holding it says so
        self._changed_at = now
        return new
