"""Run a whole gossip network, or one peer of it, on digits over real gRPC.

`run_simulation` puts every peer of a topology in this process (each with its own gRPC server on
a loopback port, each training in its own thread); `run_peer` runs one peer of a network whose
other peers live in other processes or machines. Both train with experiment.PeerTrainer and
return the same Report. Either may run over mutual TLS: `run_peer` with the peer's own files,
`run_simulation` with a throwaway CA and certificates that exist only while it runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from gossipcomp.checkpoint import CheckpointStore
from gossipcomp.data import DigitsSplit, load_digits_split
from gossipcomp.experiment import (
    PeerOutcome,
    PeerTrainer,
    TrainConfig,
    TrainingAborted,
    build_algorithm,
)
from gossipcomp.models import build_mlp
from gossipcomp.peer import Peer
from gossipcomp.report import Report, flat, merge_history, peer_reports
from gossipcomp.security import TlsFiles, throwaway_certificates
from gossipcomp.topology import Topology
from gossipcomp.training import evaluate_accuracy
from gossipcomp.transport.grpc_transport import GrpcOptions

ProgressCallback = Callable[[int, int], None]  # (rank, round just finished)


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
    peer: Peer, data: DigitsSplit, config: TrainConfig, checkpoints: CheckpointPolicy | None
) -> PeerTrainer:
    if checkpoints is None:
        return PeerTrainer(peer, data, config)
    return checkpoints.trainer(peer, data, config)


def _average_model_accuracy(
    average: Sequence[torch.Tensor], config: TrainConfig, data: DigitsSplit
) -> float:
    model = build_mlp(config.seed)
    with torch.no_grad():
        for p, value in zip(model.parameters(), average, strict=True):
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
        per_peer=peer_reports(outcomes, distances),
        history=merge_history(outcomes),
        config={**config.to_dict(), "topology_file": topology.source},
    )


def run_simulation(
    config: TrainConfig,
    topology: Topology,
    *,
    progress: ProgressCallback | None = None,
    startup_timeout: float = 30.0,
    checkpoints: CheckpointPolicy | None = None,
    tls: bool = False,
) -> Report:
    """Train every peer of `topology` in this process over gRPC on loopback; with `tls`, over
    mutual TLS with a throwaway CA and per-peer certificates (deleted when training ends)."""
    start = time.perf_counter()
    data = load_digits_split(seed=config.seed)
    peers: list[Peer] = []
    with _simulation_tls(topology.n, tls) as tls_files:
        try:
            for rank in range(topology.n):
                peers.append(
                    Peer.over_grpc(
                        build_mlp(config.seed),
                        topology,
                        rank,
                        build_algorithm(config, topology),
                        bind="127.0.0.1:0",
                        options=GrpcOptions(tls=tls_files[rank]),
                        round_timeout=config.round_timeout,
                        ready=checkpoints is None,
                    )
                )
            trainers = [_trainer(peer, data, config, checkpoints) for peer in peers]
            addresses = {p.rank: p.address for p in peers}
            for peer in peers:
                peer.start(startup_timeout, addresses)
            outcomes = _train_all(trainers, progress)
            params = [[p.detach() for p in peer.model.parameters()] for peer in peers]
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
            for peer in peers:
                peer.close()


@contextmanager
def _simulation_tls(n: int, enabled: bool) -> Iterator[list[TlsFiles | None]]:
    """Per rank: its TLS files (existing while the context lasts), or None for plaintext."""
    if not enabled:
        yield [None] * n
        return
    with throwaway_certificates([f"peer{rank}" for rank in range(n)]) as files:
        yield [files[f"peer{rank}"] for rank in range(n)]


def _train_all(
    trainers: Sequence[PeerTrainer], progress: ProgressCallback | None
) -> list[PeerOutcome]:
    """Train every peer in its own thread; the first failure stops the others and is raised."""
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
        first = next((e for e in errors if not isinstance(e, TrainingAborted)), errors[0])
        raise RuntimeError(f"simulation failed: {first}") from first
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
) -> Report:
    """Train one peer of `topology` at its address; its neighbours run elsewhere. With
    `checkpoints`, it continues from its newest valid checkpoint and keeps writing them; with
    `tls`, it talks to its neighbours over mutual TLS only."""
    start = time.perf_counter()
    data = load_digits_split(seed=config.seed)
    with Peer.over_grpc(
        build_mlp(config.seed),
        topology,
        rank,
        build_algorithm(config, topology),
        bind=bind,
        options=GrpcOptions(tls=tls),
        round_timeout=config.round_timeout,
        ready=checkpoints is None,
    ) as peer:
        trainer = _trainer(peer, data, config, checkpoints)
        peer.start(startup_timeout)
        outcome = trainer.run(on_round=(lambda r: progress(rank, r)) if progress else None)
        average = peer.network_average()
        own = [p.detach() for p in peer.model.parameters()]
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
