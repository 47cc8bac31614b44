"""Naming the rank that died: heartbeats through the rendezvous store.

When a rank dies, gloo reports a closed connection (or, for a rank that hangs, a timeout) without
saying which rank is gone, and NCCL waits minutes by default. Every rank therefore writes a
counter to the store every `timeout / 10` seconds from a background thread and watches the
others' counters. A collective that fails is explained by `Liveness.explain`: it waits (at most
half the timeout) until some rank's counter has not moved for half the timeout and returns a
`RankFailure` naming it. The store must outlive the ranks: `gossipcomp allreduce` hosts it in
the launching process, torchrun in its agent.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

PREFIX = "gossipcomp/heartbeat/"
MIN_INTERVAL_S = 0.05


class RankFailure(RuntimeError):
    """A collective failed because one or more ranks stopped; `ranks` names them."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


class Liveness:
    """Heartbeats of this rank and a watch on every other rank's (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout: expected seconds > 0, got {timeout_s}")
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = timeout_s
        self.interval_s = max(MIN_INTERVAL_S, timeout_s / 10)
        self.stale_after_s = timeout_s / 2
        now = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {r: ("", now) for r in range(world) if r != rank}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store_error: str | None = None
        self._count = 0
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
        now = time.monotonic()
        with self._lock:
            return tuple(
                r
                for r, (_, since) in sorted(self._seen.items())
                if now - since > self.stale_after_s
            )

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
                f"rank {self.rank}: a collective failed ({_first_line(error)}) and the "
                f"rendezvous store is unreachable ({self._store_error}): its host stopped",
                (),
            )
        names = ", ".join(str(r) for r in stale)
        which = "rank" if len(stale) == 1 else "ranks"
        return RankFailure(
            f"{which} {names} stopped (no heartbeat for more than {self.stale_after_s:.1f} s); "
            f"rank {self.rank} gave up on the collective: {_first_line(error)}",
            stale,
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception as error:  # the store is gone: say so when asked
                self._store_error = _first_line(error)
                return

    def _beat(self) -> None:
        self._count += 1
        self.store.set(f"{PREFIX}{self.rank}", str(self._count))
        now = time.monotonic()
        for rank in list(self._seen):
            key = f"{PREFIX}{rank}"
            if not self.store.check([key]):
                continue
            value = self.store.get(key).decode()
            with self._lock:
                if value != self._seen[rank][0]:
                    self._seen[rank] = (value, now)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line[:200]
