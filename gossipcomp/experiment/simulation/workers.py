"""`--workers`: the simulated peers spread over spawned worker processes, a block of ranks each.

Several interpreters, so several cores, instead of one interpreter lock for every peer. The
workers talk gRPC to each other on loopback as peers of different machines would, and to the
parent over pipes (addresses, progress, outcomes); a worker that goes silent, ends or answers
out of turn raises WorkerFailed, and any failure stops the others.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.experiment import PeerOutcome, load_data
from gossipcomp.experiment.simulation.setup import (
    ProgressCallback,
    _Setup,
    _train_all,
    garbage_collection_for_run,
)
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.peer import Peer
from gossipcomp.topology import Topology

MAX_WORKERS = 64


class WorkerFailed(RuntimeError):
    """A worker process of `--workers` went silent, ended or answered out of turn: a machine too
    busy to start it in time, or a crash in it; the run cannot go on with its peers."""


WORKER_START_SECONDS = 120.0  # a worker process imports torch and builds its peers in this


def usable_cores() -> int:
    """The cores this process may run on: what worker processes, or peers' processes, share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_workers(workers: int, topology: Topology, authenticate: bool) -> None:
    checked_integer("workers", workers, 1, MAX_WORKERS)
    if workers > topology.n:
        raise ValueError(
            f"workers: {workers} worker processes for {topology.n} peers; expected at most one "
            "per peer"
        )
    if authenticate:
        raise ValueError(
            "workers with --authenticate: the throwaway signing keys live in one process; "
            "expected --workers 1 (or real peers with their own --key files)"
        )


def _blocks(n: int, workers: int) -> list[range]:
    """Ranks 0..n-1 in `workers` contiguous blocks of nearly equal size (neighbours on a ring
    mostly share a process)."""
    bounds = [round(i * n / workers) for i in range(workers + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _train_in_workers(
    setup: _Setup, workers: int, progress: ProgressCallback | None
) -> tuple[list[PeerOutcome], list[list[torch.Tensor]]]:
    """Train the peers in `workers` spawned processes; their outcomes and final gossiped
    tensors in rank order. A worker that fails stops the others, and its error is raised."""
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    try:
        slots = max(1, usable_cores() // workers)  # each worker's peers compute this many at once
        for ranks in _blocks(setup.topology.n, workers):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_worker,
                args=(setup, ranks, theirs, slots),
                name=f"gossipcomp-worker-{ranks[0]}",
            )
            process.start()
            theirs.close()
            pipes.append(mine)
            processes.append(process)
        addresses: dict[int, str] = {}
        for pipe, process in zip(pipes, processes, strict=True):
            addresses.update(_expect(pipe, process, "addresses", WORKER_START_SECONDS))
        for pipe in pipes:
            pipe.send(addresses)
        outcomes: dict[int, PeerOutcome] = {}
        params: dict[int, list[torch.Tensor]] = {}
        waiting = dict(zip(pipes, processes, strict=True))
        while waiting:
            for pipe in multiprocessing.connection.wait(list(waiting)):
                process = waiting[pipe]  # type: ignore[index]
                kind, *message = _receive(pipe, process)
                if kind == "progress":
                    if progress is not None:
                        progress(*message)
                elif kind == "done":
                    outcomes.update(message[0])
                    for rank, arrays in message[1].items():
                        params[rank] = [torch.from_numpy(a) for a in arrays]
                    del waiting[pipe]  # type: ignore[arg-type]
                else:
                    raise message[0]
        for process in processes:
            process.join()
        order = range(setup.topology.n)
        return [outcomes[r] for r in order], [params[r] for r in order]
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5)
        for pipe in pipes:
            pipe.close()


def _receive(pipe: Connection, process: BaseProcess) -> tuple[Any, ...]:
    try:
        return pipe.recv()
    except EOFError:
        process.join(5)
        raise WorkerFailed(
            f"{process.name} ended (exit code {process.exitcode}) without reporting"
        ) from None


def _expect(pipe: Connection, process: BaseProcess, kind: str, seconds: float) -> Any:
    """The worker's next message, which must be `kind`; its error raised when it failed."""
    if not pipe.poll(seconds):
        raise WorkerFailed(
            f"{process.name}: nothing heard in {seconds:g} s (a machine this busy cannot start "
            "its worker processes in time: try fewer with --workers, or --workers 1)"
        )
    got, *message = _receive(pipe, process)
    if got == "error":
        raise message[0]
    if got != kind:
        raise WorkerFailed(f"{process.name}: expected {kind!r}, got {got!r}")
    return message[0]


@garbage_collection_for_run()  # full collections skip what was alive before the run
def _worker(setup: _Setup, ranks: range, pipe: Connection, slots: int) -> None:
    """One worker process: build its peers (computing `slots` at once), trade addresses
    through the parent, train, and send back outcomes and final tensors (or the error that
    stopped it)."""
    torch.set_num_threads(1)
    lock = threading.Lock()

    def send(*message: Any) -> None:
        with lock:
            pipe.send(message)

    peers: list[Peer] = []
    clients: list[CoordinatorClient] = []
    try:
        data = load_data(setup.config)
        setup.build_peers(ranks, data, [None] * setup.topology.n, peers, slots)
        send("addresses", {p.rank: p.address for p in peers})
        addresses = pipe.recv()
        clients = setup.clients(peers)
        trainers = setup.trainers(peers, clients, data)
        for peer in peers:
            peer.start(setup.startup_timeout, addresses)
        outcomes = _train_all(trainers, lambda rank, r: send("progress", rank, r))
        # as numpy arrays: torch would share tensors through file descriptors that close with
        # this process
        params = {p.rank: [t.detach().numpy().copy() for _, t in p.gossiped] for p in peers}
        send("done", {o.rank: o for o in outcomes}, params)
    except BaseException as error:  # sent to the parent, which raises it
        try:
            send("error", error)
        except Exception:  # an error that does not pickle: its text does
            send("error", RuntimeError(f"{type(error).__name__}: {error}"))
    finally:
        for client in clients:
            client.close()
        for peer in peers:
            peer.close()
        pipe.close()
