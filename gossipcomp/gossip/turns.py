"""Peers that share one process take turns computing.

Peers in one interpreter share its lock: when every training thread of a simulate run is
runnable at once, each hand-off of the interpreter lock wakes threads that mostly wait for it
again, across both cores (measured, docs/benchmarks.md "Engine, one process": a ring of 8
peers spent 2.3x the CPU of the same work done one peer at a time). With turns, a training
thread computes only while it holds one of a few slots and gives its slot up while it waits
for its neighbours (Neighbourhood.exchange), so the lock passes between a handful of threads
and the event loop instead of between all of them.

A thread that never takes a turn (a user's own loop, a test) is not held back: `waiting()`
only gives up a slot the calling thread holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ComputeTurns:
    """At most `slots` threads compute at once; a thread gives its slot up while it waits."""

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"compute turns: expected at least 1 slot, got {slots}")
        self.slots = slots
        self._free = threading.Semaphore(slots)
        self._held = threading.local()

    def holding(self) -> bool:
        """Whether the calling thread holds a slot."""
        return bool(getattr(self._held, "slot", False))

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold a slot for the calling thread (nothing more when it already holds one)."""
        if self.holding():
            yield
            return
        self._free.acquire()
        self._held.slot = True
        try:
            yield
        finally:
            self._held.slot = False
            self._free.release()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Give the calling thread's slot up while it blocks (nothing when it holds none), and
        take one back before it computes again."""
        if not self.holding():
            yield
            return
        self._held.slot = False
        self._free.release()
        try:
            yield
        finally:
            self._free.acquire()
            self._held.slot = True
