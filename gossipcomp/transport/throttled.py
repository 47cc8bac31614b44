"""A transport whose links move bytes no faster than a set rate: bandwidth limits in one process.

`ThrottledTransport` wraps another transport (in-memory or gRPC). Before an exchange it waits as
long as the slowest of its links needs to carry what it sends (bytes / rate, the links sending in
parallel), so neighbours receive the payload when a link of that rate would have delivered it,
and reports each link's own transfer time in `send_seconds` (what the rate controller measures).
It wraps only the sending: its `inbox` is the wrapped transport's, the one object receiving.
`LinkRates` holds every link's rate per round: a starting rate and changes that take effect at a
round, the same at both ends (`simulate --link-rate/--link-change`; tests). Real shaped links
(network namespaces and tc) are benchmarks/shaped_links.py; this is for tests and demos.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from gossipcomp.inputs.text import quoted
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.transport.base import ExchangeResult, Outgoing
from gossipcomp.transport.protocol import Transport
from gossipcomp.transport.schedules import ScheduleSource, SharesSchedules

MAX_MBIT = 1e6  # a terabit link: beyond, the throttle is pointless
MAX_CHANGES = 1024


@dataclass(frozen=True)
class RateChange:
    """From `round` on, the link between `a` and `b` carries `mbit` megabits per second."""

    a: int
    b: int
    mbit: float
    round: int

    def __post_init__(self) -> None:
        _check_mbit(self.mbit, f"link {self.a}-{self.b}")
        for what, value in (("a", self.a), ("b", self.b), ("round", self.round)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"rate change {what}: expected an integer >= 0, got {value!r}")
        if self.a == self.b:
            raise ValueError(f"rate change: link {self.a}-{self.b} joins a peer to itself")

    @classmethod
    def parse(cls, text: str) -> RateChange:
        """`I-J:MBIT@ROUND`, e.g. `0-1:10@30` (link 0-1 at 10 Mbit/s from round 30)."""
        try:
            edge, rest = text.split(":")
            a, b = edge.split("-")
            mbit, round = rest.split("@")
            return cls(int(a), int(b), float(mbit), int(round))
        except ValueError as error:
            raise ValueError(
                f"link change {quoted(text)}: expected I-J:MBIT@ROUND such as 0-1:10@30 ({error})"
            ) from None


def _check_mbit(mbit: float, what: str) -> None:
    if not (isinstance(mbit, int | float) and math.isfinite(mbit) and 0 < mbit <= MAX_MBIT):
        raise ValueError(f"{what}: expected a rate in (0, {MAX_MBIT:g}] Mbit/s, got {mbit!r}")


class LinkRates:
    """Every link's rate by round: `mbit` everywhere, then `changes` (applied in round order)."""

    def __init__(self, mbit: float, changes: Sequence[RateChange] = ()) -> None:
        _check_mbit(mbit, "link rate")
        if len(changes) > MAX_CHANGES:
            raise ValueError(f"link changes: {len(changes)}, at most {MAX_CHANGES}")
        self.mbit = float(mbit)
        self.changes = tuple(sorted(changes, key=lambda c: c.round))

    def bytes_per_second(self, a: int, b: int, round: int) -> float:
        """The rate of link a-b at `round`, in bytes per second."""
        mbit = self.mbit
        for change in self.changes:
            if change.round <= round and {change.a, change.b} == {a, b}:
                mbit = change.mbit
        return mbit * 1e6 / 8


class ThrottledTransport:
    """`inner` with every link limited to its rate in `rates` (module docstring)."""

    def __init__(self, inner: Transport, rates: LinkRates) -> None:
        self._inner = inner
        self.rates = rates
        self.rank = inner.rank
        # the throttle slows sending only: receiving and handshakes are the inner's
        self.inbox = inner.inbox
        self.connect = inner.connect
        self.set_hello_handler = inner.set_hello_handler
        self.probe = inner.probe
        self.close = inner.close

    @property
    def schedule_epoch(self) -> int:
        return self._inner.schedule_epoch

    @schedule_epoch.setter
    def schedule_epoch(self, epoch: int) -> None:
        self._inner.schedule_epoch = epoch

    @property
    def address(self) -> str | None:
        return getattr(self._inner, "address", None)

    def exchange(
        self, round: int, phase: str, outgoing: Outgoing, timeout: float, schedule_epoch: int = 0
    ) -> ExchangeResult:
        transfer = {
            j: sum(wire.nbytes for wire in payload)
            / self.rates.bytes_per_second(self.rank, j, round)
            for j, payload in outgoing.items()
        }
        wait = min(max(transfer.values(), default=0.0), timeout)
        time.sleep(wait)
        result = self._inner.exchange(round, phase, outgoing, timeout - wait, schedule_epoch)
        for j, seconds in result.send_seconds.items():
            result.send_seconds[j] = transfer[j] + seconds
        return result

    def set_schedule_source(self, source: ScheduleSource) -> None:
        """Neighbours' schedules (transport/schedules.py) pass unthrottled, like handshakes."""
        if isinstance(self._inner, SharesSchedules):
            self._inner.set_schedule_source(source)

    def fetch_schedules(self, neighbour: int) -> Future[list[cpb.Schedule]]:
        if isinstance(self._inner, SharesSchedules):
            return self._inner.fetch_schedules(neighbour)
        unanswered: Future[list[cpb.Schedule]] = Future()  # the peer logs it and trains on
        unanswered.set_exception(RuntimeError("the inner transport shares no schedules"))
        return unanswered
