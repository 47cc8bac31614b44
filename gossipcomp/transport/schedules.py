"""Schedules between neighbours: what a transport offers so that a peer that missed a schedule
gets it from a neighbour that holds it.

A handshake tells each end the newest schedule epoch the other holds. The end that is behind asks
the other for the schedules it holds past its own epoch (`Gossip.Schedules`), at that
neighbour's own address, so a forged handshake costs one question to the real neighbour and
changes nothing; it stages what comes back after the same checks as a coordinator's schedule.
The transport moves them as coordinator.proto `Schedule` messages and knows nothing of what
they mean; it only bounds how many one answer may carry, and how many answers one caller may
have in flight. The peer hands its answer over already serialised (built when its schedules
change, never per request), so a caller repeating the question costs the server no
serialisation of schedules that may hold 65,536 groups and 2^20 links.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from gossipcomp.proto.v1 import coordinator_pb2 as cpb

MAX_SHARED_SCHEDULES = 8  # in one answer: a peer holds one in force and at most a few staged
SCHEDULE_CALLS_PER_CALLER = 1  # answers in flight to one caller (a peer asks one at a time)

# (the asking neighbour, the newest epoch it holds) -> the serialised gossip.proto ScheduleList
# of the schedules held that are newer (at most MAX_SHARED_SCHEDULES)
ScheduleSource = Callable[[int, int], bytes]


@runtime_checkable
class SharesSchedules(Protocol):
    """A transport that serves this peer's schedules to its neighbours and fetches theirs."""

    def set_schedule_source(self, source: ScheduleSource) -> None:
        """Answer neighbours' `Schedules` requests from `source`."""
        ...

    def fetch_schedules(self, neighbour: int) -> Future[list[cpb.Schedule]]:
        """Ask `neighbour`, without blocking, for the schedules it holds past this peer's
        newest epoch (the transport's `schedule_epoch`); the future fails when it does not
        answer within the handshake deadline or sends more than MAX_SHARED_SCHEDULES."""
        ...
