"""Run a whole gossip network, or one peer of it, on digits over real gRPC.

`run_simulation` puts every peer of a topology in this process (each with its own gRPC server on
a loopback port, each training in its own thread); `run_peer` runs one peer of a network whose
other peers live in other processes or machines. Both train with experiment.PeerTrainer and
return the same Report. Either may run over mutual TLS: `run_peer` with the peer's own files,
`run_simulation` with a throwaway CA and certificates that exist only while it runs; and with
TLS, peers may also sign every message (`run_peer` with its key and the topology's public keys,
`run_simulation` with throwaway keys).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gossipcomp.checkpoint import CheckpointStore
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator_client import CoordinatorClient
from gossipcomp.data import DigitsSplit
from gossipcomp.experiment import (
    PeerOutcome,
    PeerTrainer,
    TrainConfig,
    TrainingAborted,
    build_algorithm,
    build_config_model,
    load_data,
)
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.models import gossiped_tensors
from gossipcomp.peer import Peer
from gossipcomp.report import Report, flat, merge_history, peer_reports
from gossipcomp.security import TlsFiles, throwaway_certificates
from gossipcomp.security.signing_keys import PeerKeys, load_signing_key
from gossipcomp.topology import Topology
from gossipcomp.training import evaluate_accuracy
from gossipcomp.transport.grpc_transport import WHY_AUTHENTICATION_NEEDS_TLS, GrpcOptions
from gossipcomp.transport.throttled import LinkRates

ProgressCallback = Callable[[int, int], None]  # (rank, round just finished)


@dataclass(frozen=True)
class PeerLevels:
    """Levels the peers set themselves, without a coordinator (Peer.adapt_levels): the
    lower-ranked end of each edge decides a link's level (PowerGossip), each peer the level
    it broadcasts at (Choco, DEF-ATC), from its own sends, and announces it."""

    round_budget: float | None = None  # seconds per round and link; None: each peer's compute


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often peers checkpoint; each peer restores its newest valid file at start."""

    directory: Path
    every: int = 50  # rounds between checkpoints
    keep: int = 3  # newest files kept per peer

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint every must be >= 1 round, got {self.every}")

    def trainer(self, peer: Peer, data: DigitsSplit, config: TrainConfig) -> PeerTrainer:
        store = CheckpointStore(self.directory, peer.rank, keep=self.keep)
        trainer = PeerTrainer(peer, data, config, store, self.every)
        trainer.restore()
        peer.ready()  # handshakes are answered from the restored round only
        return trainer


def _trainer(
    peer: Peer,
    data: DigitsSplit,
    config: TrainConfig,
    checkpoints: CheckpointPolicy | None,
    coordinator: CoordinatorClient | None = None,
) -> PeerTrainer:
    if checkpoints is None:
        return PeerTrainer(peer, data, config, coordinator=coordinator)
    trainer = checkpoints.trainer(peer, data, config)
    trainer.coordinator = coordinator
    return trainer


def _average_model_accuracy(
    average: Sequence[torch.Tensor], config: TrainConfig, data: DigitsSplit
) -> float:
    """Test accuracy of a model holding `average`, the network average of the gossiped
    tensors (models.gossiped_tensors, in that order)."""
    model = build_config_model(config, data)
    with torch.no_grad():
        for (_, p), value in zip(
            gossiped_tensors(model, config.gossip_buffers), average, strict=True
        ):
            p.copy_(value)
    return evaluate_accuracy(model, data.x_test, data.y_test)


def _report(
    mode: str,
    config: TrainConfig,
    topology: Topology,
    outcomes: Sequence[PeerOutcome],
    distances: Sequence[float],
    average: Sequence[torch.Tensor],
    data: DigitsSplit,
    wall_seconds: float,
) -> Report:
    accuracies = [o.test_accuracy for o in outcomes]
    per_peer = peer_reports(outcomes, distances, config.byzantine)
    return Report(
        mode=mode,
        algorithm=config.algorithm,
        topology=topology.name,
        rounds=config.rounds,
        final_test_accuracy=sum(accuracies) / len(accuracies),
        min_test_accuracy=min(accuracies),
        consensus_distance=sum(distances) / len(distances),
        average_model_test_accuracy=_average_model_accuracy(average, config, data),
        average_model_norm=float(flat(average).norm()),
        bytes_sent_total=sum(o.stats.bytes_sent_total for o in outcomes),
        wall_seconds=wall_seconds,
        per_peer=per_peer,
        history=merge_history(outcomes),
        config={**config.to_dict(), "topology_file": topology.source},
        local_steps=config.local_steps,
        gossip_rounds=max(o.stats.rounds for o in outcomes),
    )


def run_simulation(
    config: TrainConfig,
    topology: Topology,
    *,
    progress: ProgressCallback | None = None,
    startup_timeout: float = 30.0,
    checkpoints: CheckpointPolicy | None = None,
    tls: bool = False,
    authenticate: bool = False,
    coordinator: Coordinator | None = None,
    report_every: int = 10,
    link_rates: LinkRates | None = None,
    workers: int = 1,
    peer_levels: PeerLevels | None = None,
) -> Report:
    """Train every peer of `topology` in this process over gRPC on loopback (each link
        throttled to `link_rates` when given); with `tls`, over
        mutual TLS with a throwaway CA and per-peer certificates (deleted when training ends); with
        `authenticate` as well, every message signed by a throwaway per-peer key. With
        `coordinator`, it is served on loopback too (over the same TLS) and every peer reports to
        it every `report_every` rounds and takes the schedules it publishes; with `peer_levels`
        instead, the peers set their links' levels themselves. With `workers` > 1 the
    peers are spread over that many worker processes (contiguous blocks of ranks), which talk gRPC
    to each other on loopback as peers of different machines would: several interpreters, so
    several cores, instead of one interpreter lock for every peer."""
    if authenticate and not tls:
        raise ValueError(f"--authenticate needs --tls: {WHY_AUTHENTICATION_NEEDS_TLS}")
    _check_one_level_source(coordinator is not None, peer_levels)
    if workers != 1:
        _check_workers(workers, topology, authenticate)
    start = time.perf_counter()
    data = load_data(config)
    peers: list[Peer] = []
    keys = _throwaway_keys(topology.n) if authenticate else [None] * topology.n
    with _simulation_tls(topology.n, tls) as (tls_files, coordinator_tls):
        server = None
        clients: list[CoordinatorClient] = []
        try:
            if coordinator is not None:
                server = CoordinatorServer(coordinator, "127.0.0.1:0", coordinator_tls)
            setup = _Setup(
                config,
                topology,
                tls_files,
                None if server is None else server.address,
                report_every,
                link_rates,
                checkpoints,
                startup_timeout,
                peer_levels,
            )
            if workers != 1:
                outcomes, params = _train_in_workers(setup, workers, progress)
            else:
                setup.build_peers(range(topology.n), data, keys, peers, usable_cores())
                clients = setup.clients(peers)
                trainers = setup.trainers(peers, clients, data)
                addresses = {p.rank: p.address for p in peers}
                for peer in peers:
                    peer.start(startup_timeout, addresses)
                outcomes = _train_all(trainers, progress)
                params = [[p.detach() for _, p in peer.gossiped] for peer in peers]
            average = [torch.stack(group).mean(dim=0) for group in zip(*params, strict=True)]
            mean_vector = flat(average)
            distances = [float((flat(ps) - mean_vector).pow(2).sum()) for ps in params]
            return _report(
                "simulate",
                config,
                topology,
                outcomes,
                distances,
                average,
                data,
                time.perf_counter() - start,
            )
        finally:
            for client in clients:
                client.close()
            for peer in peers:
                peer.close()
            if server is not None:
                server.stop()


def _check_one_level_source(coordinator: bool, peer_levels: PeerLevels | None) -> None:
    if coordinator and peer_levels is not None:
        raise ValueError(
            "link levels come from a coordinator or from the peers, not both: expected "
            "peer levels (--adaptive --no-coordinator) without a coordinator"
        )


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
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers: expected an integer in [1, {MAX_WORKERS}], got {workers!r}")
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


@dataclass(frozen=True)
class _Setup:
    """Everything a process needs to build and train its share of the simulated peers."""

    config: TrainConfig
    topology: Topology
    tls_files: Sequence[TlsFiles | None]
    coordinator: str | None  # the coordinator's address
    report_every: int
    link_rates: LinkRates | None
    checkpoints: CheckpointPolicy | None
    startup_timeout: float
    peer_levels: PeerLevels | None = None

    def build_peers(
        self,
        ranks: Iterable[int],
        data: DigitsSplit,
        keys: Sequence[PeerKeys | None],
        into: list[Peer],
        slots: int,
    ) -> None:
        """A peer per rank on a loopback port, appended to `into` as each is made (so the
        caller closes those made when a later one fails). The peers of one call share this
        process and take turns computing, `slots` at once (gossip/turns.py)."""
        turns = ComputeTurns(slots)
        for rank in ranks:
            into.append(
                Peer.over_grpc(
                    build_config_model(self.config, data),
                    self.topology,
                    rank,
                    build_algorithm(self.config, self.topology, rank),
                    bind="127.0.0.1:0",
                    options=GrpcOptions(tls=self.tls_files[rank], keys=keys[rank]),
                    round_timeout=self.config.round_timeout,
                    ready=self.checkpoints is None,
                    gossip_buffers=self.config.gossip_buffers,
                    link_rates=self.link_rates,
                    max_failed_rounds=_failed_rounds_bound(self.config, rank),
                    turns=turns,
                )
            )
            if self.peer_levels is not None:
                into[-1].adapt_levels(self.peer_levels.round_budget)

    def clients(self, peers: Sequence[Peer]) -> list[CoordinatorClient]:
        if self.coordinator is None:
            return []
        return [
            CoordinatorClient(
                self.coordinator,
                peer,
                self.config.group_compressor,
                report_every=self.report_every,
                tls=self.tls_files[peer.rank],
            )
            for peer in peers
        ]

    def trainers(
        self, peers: Sequence[Peer], clients: Sequence[CoordinatorClient], data: DigitsSplit
    ) -> list[PeerTrainer]:
        return [
            _trainer(peer, data, self.config, self.checkpoints, clients[i] if clients else None)
            for i, peer in enumerate(peers)
        ]


def _failed_rounds_bound(config: TrainConfig, rank: int) -> int:
    """How many rounds in a row `rank` may hear no neighbour before it stops: a Byzantine
    rank never stops, as its honest neighbours cutting it off is the defence at work."""
    return 0 if rank in config.byzantine else config.max_failed_rounds


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


@contextmanager
def _simulation_tls(
    n: int, enabled: bool
) -> Iterator[tuple[list[TlsFiles | None], TlsFiles | None]]:
    """Per rank its TLS files, and the coordinator's (existing while the context lasts), or
    None for plaintext."""
    if not enabled:
        yield [None] * n, None
        return
    names = [f"peer{rank}" for rank in range(n)]
    with throwaway_certificates([*names, "coordinator"]) as files:
        yield [files[name] for name in names], files["coordinator"]


def _throwaway_keys(n: int) -> list[PeerKeys | None]:
    """A fresh signing key per rank, each peer knowing all the public halves."""
    private = [Ed25519PrivateKey.generate() for _ in range(n)]
    public = {rank: key.public_key() for rank, key in enumerate(private)}
    return [PeerKeys(key, public) for key in private]


def peer_keys(topology: Topology, rank: int, signing_key: Path | None) -> PeerKeys | None:
    """A peer's keys from its `--key` file and the topology's public keys; None when the network
    does not authenticate. A topology listing public keys needs the key: a peer that cannot sign
    would be refused by every neighbour, so it is refused at start instead."""
    if signing_key is None:
        listed = [r for r, key in enumerate(topology.public_keys) if key is not None]
        if listed:
            raise ValueError(
                f"{topology.source} lists public keys (peers {listed}), so peers authenticate: "
                f"expected this peer's signing key as --key FILE"
            )
        return None
    return PeerKeys.for_rank(
        rank, load_signing_key(signing_key), topology.public_keys, topology.source
    )


def _train_all(
    trainers: Sequence[PeerTrainer], progress: ProgressCallback | None
) -> list[PeerOutcome]:
    """Train every peer in its own thread; the first failure stops the others and is raised
    as it was (not wrapped), so a caller can tell a diverged run from a bug."""
    outcomes: dict[int, PeerOutcome] = {}
    errors: list[BaseException] = []
    failed = threading.Event()

    def run(trainer: PeerTrainer) -> None:
        rank = trainer.peer.rank
        try:
            outcomes[rank] = trainer.run(
                on_round=(lambda r: progress(rank, r)) if progress else None,
                should_stop=failed.is_set,
            )
        except BaseException as error:  # reported to the caller below
            errors.append(error)
            failed.set()

    threads = [
        threading.Thread(target=run, args=(t,), name=f"peer-{t.peer.rank}", daemon=True)
        for t in trainers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, TrainingAborted)), errors[0])
    return [outcomes[t.peer.rank] for t in trainers]


def run_peer(
    config: TrainConfig,
    topology: Topology,
    rank: int,
    *,
    bind: str | None = None,
    progress: ProgressCallback | None = None,
    startup_timeout: float = 60.0,
    checkpoints: CheckpointPolicy | None = None,
    tls: TlsFiles | None = None,
    signing_key: Path | None = None,
    insecure: bool = False,
    coordinator: str | None = None,
    report_every: int = 10,
    peer_levels: PeerLevels | None = None,
) -> Report:
    """Train one peer of `topology` at its address; its neighbours run elsewhere. With
    `checkpoints`, it continues from its newest valid checkpoint and keeps writing them; with
    `tls`, it talks to its neighbours over mutual TLS only; with `signing_key` (required when
    the topology lists public keys, and only with `tls`), it signs every message and accepts
    only messages signed by its neighbours' keys. Without `tls` it serves only on loopback
    unless `insecure` (GrpcOptions.insecure: plaintext trusts whoever reaches the port). With
    `coordinator` (HOST:PORT), it reports there every `report_every` rounds (over `tls` when
    given) and takes the schedules published there; with `peer_levels` instead, it sets its
    links' levels with its neighbours (each must do the same)."""
    if signing_key is not None and tls is None:
        raise ValueError(
            "peer authentication (--key) needs mutual TLS (--tls-cert, --tls-key, --tls-ca): "
            + WHY_AUTHENTICATION_NEEDS_TLS
        )
    _check_one_level_source(coordinator is not None, peer_levels)
    keys = peer_keys(topology, rank, signing_key)
    start = time.perf_counter()
    data = load_data(config)
    with Peer.over_grpc(
        build_config_model(config, data),
        topology,
        rank,
        build_algorithm(config, topology, rank),
        bind=bind,
        options=GrpcOptions(tls=tls, keys=keys, insecure=insecure),
        round_timeout=config.round_timeout,
        ready=checkpoints is None,
        gossip_buffers=config.gossip_buffers,
        max_failed_rounds=_failed_rounds_bound(config, rank),
    ) as peer:
        if peer_levels is not None:
            peer.adapt_levels(peer_levels.round_budget)
        client = (
            None
            if coordinator is None
            else CoordinatorClient(
                coordinator, peer, config.group_compressor, report_every=report_every, tls=tls
            )
        )
        try:
            trainer = _trainer(peer, data, config, checkpoints, client)
            peer.start(startup_timeout)
            outcome = trainer.run(on_round=(lambda r: progress(rank, r)) if progress else None)
        finally:
            if client is not None:
                client.close()
        average = peer.network_average()
        own = [p.detach() for _, p in peer.gossiped]
        distance = float((flat(own) - flat(average)).pow(2).sum())
        return _report(
            "peer",
            config,
            topology,
            [outcome],
            [distance],
            average,
            data,
            time.perf_counter() - start,
        )
