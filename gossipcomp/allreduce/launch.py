"""Starting ranks: from torchrun's environment, or N local processes from one call.

`init_from_env` joins the job described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (what
torchrun sets): NCCL when CUDA is available, gloo otherwise, every collective bounded by
`timeout_s`, and a `Liveness` watch that names a rank that dies. The rendezvous store is hosted
by whoever launched the ranks (torchrun's agent says so with TORCHELASTIC_USE_AGENT_STORE, our
`spawn` with GOSSIPCOMP_STORE_HOSTED); otherwise rank 0 hosts it.

`spawn(fn, nproc, ...)` runs fn(session, *args) in `nproc` fresh processes on this machine (the
launching process hosts the store, so a dead rank cannot take it down) and returns each rank's
result; a rank that fails or runs past the deadline ends all of them with `LaunchError`, whose
message has every rank's error. The launcher reads the ranks' heartbeats too: a rank that stops
(SIGSTOP, a hang) is ended and named, so a job never waits for it until the deadline (`_Watch`).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gossipcomp.allreduce.liveness import Heartbeats, Liveness, RankFailure
from gossipcomp.inputs.numbers import checked_integer

HOSTED_ENV = "GOSSIPCOMP_STORE_HOSTED"
AGENT_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LOCALHOST = "127.0.0.1"
POLL_S = 0.2  # how often the launcher looks at its ranks
GRACE_S = 5.0  # beyond twice the timeout, for the ranks left when one has failed
EXIT_S = 2.0  # for the ranks to exit by themselves once every rank's outcome is known


class LaunchError(RuntimeError):
    """Some rank failed; the message gathers each failed rank's error."""


@dataclass
class Session:
    """This rank's place in the job, and the watch that names dead ranks."""

    rank: int
    world: int
    backend: str
    device: torch.device
    liveness: Liveness

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective failure caused by a dead rank into a RankFailure naming it."""
        try:
            yield
        except RankFailure:
            raise
        except (RuntimeError, OSError) as error:
            failure = self.liveness.explain(error)
            if failure is None:
                raise
            raise failure from error

    def close(self) -> None:
        self.liveness.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _env_int(name: str, low: int) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"{name} is not set; start ranks with torchrun or gossipcomp allreduce")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value[:40]!r}") from None
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number


def init_from_env(timeout_s: float = 60.0, backend: str | None = None) -> Session:
    """Join the job of RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (module docstring)."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if rank >= world:
        raise ValueError(f"RANK {rank} must be below WORLD_SIZE {world}")
    address = os.environ.get("MASTER_ADDR", LOCALHOST)
    port = _env_int("MASTER_PORT", 1)
    if not timeout_s > 0:
        raise ValueError(f"collective timeout: expected seconds > 0, got {timeout_s}")
    hosted = os.environ.get(HOSTED_ENV) == "1" or os.environ.get(AGENT_ENV, "").lower() in (
        "1",
        "true",
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        address,
        port,
        world,
        is_master=rank == 0 and not hosted,
        timeout=timeout,
        wait_for_workers=False,
    )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # beating before the process group forms: a rank that stops while the others wait for it
    # there is named like one that stops later
    liveness_store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
    session = Session(
        rank, world, backend, device, Liveness(liveness_store, rank, world, timeout_s)
    )
    session.liveness.start()
    try:
        with session.guard():
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg", store),
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
    except BaseException:
        session.close()
        raise
    return session


def _child(
    rank: int,
    nproc: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    backend: str,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        MASTER_ADDR=LOCALHOST,
        MASTER_PORT=str(port),
        **{HOSTED_ENV: "1"},
    )
    torch.set_num_threads(1)  # several ranks share the cores
    session = None
    try:
        session = init_from_env(timeout_s, backend=backend)
        with session.guard():
            value = fn(session, *args)
        # plain pickle bytes: torch's queue reducers would share memory this process frees on exit
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as error:  # reported to the launcher, which decides what to raise
        detail = (
            str(error)
            if isinstance(error, RankFailure | ValueError)
            else (traceback.format_exc(limit=8))
        )
        results.put((rank, False, f"{type(error).__name__}: {detail}"))
    finally:
        if session is not None:
            session.liveness.stop()


class _Watch:
    """The launcher's view of its ranks' heartbeats: which running ranks to end, and why.

    A rank that has beaten and then falls silent is ended once another rank has failed (those
    fail within about the timeout when a rank stops, every collective being bounded) and its
    silence passed half the timeout, as the ranks themselves judge; with no failure, after
    twice the timeout. Once a rank has failed, a rank that never beat is ended at once, and
    every rank still running after twice the timeout (and a margin) too: nothing keeps the
    launcher waiting for a job that failed.
    """

    def __init__(self, heartbeats: Heartbeats, processes: list[Any], timeout_s: float) -> None:
        self.heartbeats, self.processes, self.timeout_s = heartbeats, processes, timeout_s
        self.failed: tuple[int, float] | None = None  # first failed rank and when it was seen

    def to_end(self, outcomes: dict[int, tuple[bool, Any]]) -> dict[int, str]:
        """Running ranks to end now, with the reason for each."""
        self.heartbeats.poll()
        now = time.monotonic()
        if self.failed is None:
            failures = [rank for rank, (ok, _) in sorted(outcomes.items()) if not ok]
            if failures:
                self.failed = (failures[0], now)
        silent_after = self.timeout_s / 2 if self.failed else 2 * self.timeout_s
        ending = {}
        for rank, process in enumerate(self.processes):
            if rank in outcomes:
                continue
            started = self.heartbeats.started(rank)
            silent = self.heartbeats.silent_for(rank)
            if started and silent > silent_after:
                ending[rank] = (
                    f"no heartbeat for {silent:.1f} s (stopped or hung; pid {process.pid}): "
                    "ended by the launcher"
                )
            elif self.failed and not started:
                ending[rank] = (
                    f"never beat (not started, or stopped while starting; pid {process.pid}): "
                    f"ended by the launcher after rank {self.failed[0]} failed"
                )
            elif self.failed and now - self.failed[1] > 2 * self.timeout_s + GRACE_S:
                ending[rank] = (
                    f"still running {now - self.failed[1]:.1f} s after rank {self.failed[0]} "
                    f"failed (pid {process.pid}): ended by the launcher"
                )
        return ending


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = 30.0,
    deadline_s: float = 300.0,
    backend: str = "gloo",
) -> list[Any]:
    """fn(session, *args) on ranks 0..nproc-1 in fresh processes; their results in rank order.

    `timeout_s` bounds each collective (and how long a dead rank goes unnamed); `deadline_s`
    the whole run; `backend` "gloo" (CPU) or "nccl" (one GPU per rank). fn must be importable (a module-level function) and its result picklable.
    """
    checked_integer("nproc", nproc, 1)
    store = dist.TCPStore(
        LOCALHOST,
        0,
        nproc,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=_child,
            args=(rank, nproc, store.port, timeout_s, fn, args, results, backend),
            name=f"gossipcomp-rank{rank}",
            daemon=True,
        )
        for rank in range(nproc)
    ]
    for process in processes:
        process.start()
    watch = _Watch(Heartbeats(store, range(nproc)), processes, timeout_s)
    outcomes: dict[int, tuple[bool, Any]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(outcomes) < nproc:
            try:
                rank, ok, value = results.get(timeout=POLL_S)
                value = pickle.loads(value) if ok else value
                outcomes[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            for rank, process in enumerate(processes):
                if rank not in outcomes and process.exitcode is not None:
                    time.sleep(0.2)  # a result put just before exiting may still be in flight
                    if rank not in outcomes and results.empty():
                        outcomes[rank] = (False, f"exited with status {process.exitcode}")
            for rank, reason in watch.to_end(outcomes).items():
                processes[rank].kill()  # SIGKILL: a stopped process ignores anything milder
                outcomes[rank] = (False, reason)
            if time.monotonic() > end:
                for rank in range(nproc):
                    outcomes.setdefault(rank, (False, f"still running after {deadline_s:g} s"))
    finally:
        leave = time.monotonic() + EXIT_S  # for all of them together, not each
        for process in processes:
            process.join(timeout=max(0.0, leave - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        del store
    failed = {rank: value for rank, (ok, value) in sorted(outcomes.items()) if not ok}
    if failed:
        text = "; ".join(f"rank {rank}: {value}" for rank, value in failed.items())
        raise LaunchError(text)
    return [outcomes[rank][1] for rank in range(nproc)]
