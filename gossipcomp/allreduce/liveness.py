"""Naming the rank that died or hangs: heartbeats through the rendezvous store.

When a rank dies, gloo reports a closed connection (or, for a rank that hangs, a timeout) without
saying which rank is gone, and NCCL waits minutes by default. Every rank therefore writes a
counter (with its process id and host) to the store every `timeout / 10` seconds from a
background thread and watches the others' counters. A rank that is killed or stopped (SIGSTOP, a
debugger, a swapped-out machine) stops beating alike. A collective that fails is explained by
`Liveness.explain`: it waits (at most half the timeout) until some rank's counter has not moved
for half the timeout and returns a `RankFailure` naming it. `Heartbeats` reads the counters on
its own: the launcher of local processes uses it to end a rank that stopped beating (launch.py).
The store must outlive the ranks: `gossipcomp allreduce` hosts it in the launching process,
torchrun in its agent.
"""

from __future__ import annotations

import os
import socket
import string
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

PREFIX = "gossipcomp/heartbeat/"
MIN_INTERVAL_S = 0.05
MAX_BEAT_CHARS = 200  # a heartbeat value longer than this is cut before it is decoded
MAX_PID_DIGITS = 10  # a pid field longer than this is not a pid (Linux pids fit in 7)
MAX_HOST_CHARS = 64
_HOST_CHARS = frozenset(string.ascii_letters + string.digits + ".-_")


class RankFailure(RuntimeError):
    """A collective failed because one or more ranks stopped; `ranks` names them."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass
class _Seen:
    value: str  # the last heartbeat read ("" before the first)
    since: float  # monotonic time it was first read (or the watch started)


class Heartbeats:
    """The heartbeat counters of `ranks` in `store`, and since when each has not moved.

    `poll()` reads them (from one thread); the other methods may be called from any thread.
    """

    def __init__(self, store: dist.Store, ranks: Iterable[int]) -> None:
        self.store = store
        now = time.monotonic()
        self._seen = {rank: _Seen("", now) for rank in ranks}
        self._lock = threading.Lock()

    def poll(self) -> None:
        """Read every watched rank's counter once."""
        now = time.monotonic()
        for rank in list(self._seen):
            key = f"{PREFIX}{rank}"
            if not self.store.check([key]):
                continue
            # torch's Store has no partial read: the value arrives whole, bounded by the store's
            # server (torch's libuv TCPStore refuses values over 8 MiB), and is cut here before
            # it is decoded or kept
            value = self.store.get(key)[:MAX_BEAT_CHARS].decode(errors="replace")
            with self._lock:
                if value != self._seen[rank].value:
                    self._seen[rank] = _Seen(value, now)

    def silent_for(self, rank: int) -> float:
        """Seconds since `rank`'s counter last moved (or since the watch began, if never seen)."""
        with self._lock:
            return time.monotonic() - self._seen[rank].since

    def started(self, rank: int) -> bool:
        """Whether `rank` has beaten at least once."""
        with self._lock:
            return self._seen[rank].value != ""

    def silent(self, after_s: float) -> tuple[int, ...]:
        """Ranks whose counter has not moved for more than `after_s` seconds."""
        return tuple(r for r in sorted(self._seen) if self.silent_for(r) > after_s)

    def where(self, rank: int) -> str:
        """ "pid P on HOST" from `rank`'s last heartbeat, or "" when it has none readable."""
        with self._lock:
            fields = self._seen[rank].value.split()
        if len(fields) != 3 or not _is_pid(fields[1]):
            return ""
        pid, host = int(fields[1]), fields[2][:MAX_HOST_CHARS]
        if not set(host) <= _HOST_CHARS:
            return f"pid {pid}"
        return f"pid {pid} on {host}"


def _is_pid(text: str) -> bool:
    """Whether `text` is a pid as a rank writes it: 1 to MAX_PID_DIGITS ASCII digits (str.isdigit
    also accepts '²' and other digits that int() refuses)."""
    return 0 < len(text) <= MAX_PID_DIGITS and all(c in string.digits for c in text)


class Liveness:
    """Heartbeats of this rank and a watch on every other rank's (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout: expected seconds > 0, got {timeout_s}")
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = timeout_s
        self.interval_s = max(MIN_INTERVAL_S, timeout_s / 10)
        self.stale_after_s = timeout_s / 2
        self.others = Heartbeats(store, (r for r in range(world) if r != rank))
        host = "".join(c for c in socket.gethostname() if c in _HOST_CHARS)[:MAX_HOST_CHARS]
        self._identity = f"{os.getpid()} {host or 'unknown'}"
        self._stop = threading.Event()
        self._store_error: str | None = None
        self._count = 0
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gossipcomp-liveness", daemon=True)

    def start(self) -> Liveness:
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s)

    def stale_ranks(self) -> tuple[int, ...]:
        """Ranks whose heartbeat has not moved for more than half the timeout."""
        return self.others.silent(self.stale_after_s)

    def explain(self, error: BaseException) -> RankFailure | None:
        """The failure naming the stopped ranks, waiting up to half the timeout for their
        heartbeats to go stale; None if every rank still beats (then `error` is something else)."""
        deadline = time.monotonic() + self.stale_after_s + 2 * self.interval_s
        while True:
            stale = self.stale_ranks()
            if stale or time.monotonic() > deadline:
                break
            time.sleep(self.interval_s / 2)
        if not stale:
            if self._store_error is None:
                return None
            return RankFailure(
                f"rank {self.rank}: a collective failed ({first_line(error)}) and the "
                f"rendezvous store is unreachable ({self._store_error}): its host stopped",
                (),
            )
        stopped = [r for r in stale if self.others.started(r)]
        absent = [r for r in stale if not self.others.started(r)]
        said = []
        if stopped:
            where = "; ".join(
                f"rank {r}: {self.others.where(r)}" for r in stopped if self.others.where(r)
            )
            said.append(
                f"{name_ranks(stopped)} stopped (no heartbeat for more than "
                f"{self.stale_after_s:.1f} s: dead or hung{'; ' + where if where else ''})"
            )
        if absent:  # still starting (a slow import) or stopped before its first beat
            since = time.monotonic() - self._started_at
            said.append(
                f"{name_ranks(absent)} never beat in the {since:.1f} s since rank "
                f"{self.rank} started (not started, or stopped while starting)"
            )
        return RankFailure(
            f"{'; '.join(said)}; rank {self.rank} gave up on the collective: {first_line(error)}",
            stale,
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception as error:  # the store is gone: say so when asked
                self._store_error = first_line(error)
                return

    def _beat(self) -> None:
        self._count += 1
        self.store.set(f"{PREFIX}{self.rank}", f"{self._count} {self._identity}")
        self.others.poll()


def name_ranks(ranks: Iterable[int]) -> str:
    """ "rank 2" or "ranks 0, 3": how errors name ranks."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def first_line(error: BaseException) -> str:
    """The first line of an error's message, at most 200 characters."""
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line[:200]
