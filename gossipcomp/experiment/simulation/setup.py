"""What every way of running peers shares: the run's settings (PeerLevels, CheckpointPolicy),
building the peers of one process with their coordinator clients and trainers, and training
them each in its own thread.

Used by run_simulation (all peers in this process), its worker processes (a block of ranks
each) and run_peer (one peer), so a peer is built and trained the same way in all three.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.experiment import (
    PeerOutcome,
    PeerTrainer,
    TrainConfig,
    TrainingAborted,
    build_algorithm,
    build_config_model,
)
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.peer import Peer
from gossipcomp.security import TlsFiles
from gossipcomp.security.signing_keys import PeerKeys
from gossipcomp.topology import Topology
from gossipcomp.transport.grpc_transport import GrpcOptions
from gossipcomp.transport.throttled import LinkRates
from gossipcomp.workload.checkpoint import CheckpointStore
from gossipcomp.workload.data import DigitsSplit

ProgressCallback = Callable[[int, int], None]  # (rank, round just finished)


@dataclass(frozen=True)
class PeerLevels:
    """Levels the peers set themselves, without a coordinator (Peer.adapt_levels): the
    lower-ranked end of each edge decides a link's level (PowerGossip), each peer the level
    it broadcasts at (Choco, DEF-ATC), from its own sends, and announces it."""

    round_budget: float | None = None  # seconds per round and link; None: each peer's compute
    follow_loss: bool = True  # no level above what the fall of the peer's own loss allows


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
    trainer.attach(coordinator)
    return trainer


def _check_one_level_source(coordinator: bool, peer_levels: PeerLevels | None) -> None:
    if coordinator and peer_levels is not None:
        raise ValueError(
            "link levels come from a coordinator or from the peers, not both: expected "
            "peer levels (--adaptive --no-coordinator) without a coordinator"
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
                    local_steps=self.config.local_steps,
                    outer=self.config.outer_optimizer(),
                    drift=self.config.drift_correction(),
                    turns=turns,
                )
            )
            if self.peer_levels is not None:
                into[-1].adapt_levels(self.peer_levels.round_budget, self.peer_levels.follow_loss)

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


#: gen-0 collections' threshold during a run (CPython's own: 700 allocations): the peers' event
#: loop and training threads allocate that many in well under a millisecond, and each
#: collection walks every young object alive at the time (in-flight calls, tensors) again.
RUN_GC_THRESHOLD = 10_000


@contextmanager
def garbage_collection_for_run() -> Iterator[None]:
    """The garbage collector set up for a run until exit, restored then: the objects alive at
    entry (modules, torch's and grpc's internals: ~400,000 of them) left out of its full
    passes (gc.freeze), and young collections every RUN_GC_THRESHOLD allocations. Measured on
    ring32 in one process (100 rounds, 2-core EPYC, three runs each): collections held the
    interpreter lock 16-21 ms a round before (a full pass 0.12-0.2 s), 2.8-3.8 ms after;
    ring8 5-6 ms before, 1.2-1.8 after. Nothing is lost: at exit the frozen objects go back
    to the oldest generation (gc.unfreeze) and garbage among them is collected as before. A
    caller that froze objects itself (or a run already under way in this process) keeps its
    settings: nothing is changed then."""
    if gc.get_freeze_count():
        yield
        return
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], RUN_GC_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _failed_rounds_bound(config: TrainConfig, rank: int) -> int:
    """How many rounds in a row `rank` may hear no neighbour before it stops: a Byzantine
    rank never stops, as its honest neighbours cutting it off is the defence at work."""
    return 0 if rank in config.byzantine else config.max_failed_rounds


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
            if not failed.is_set():
                failed.set()
                # the run is over: every peer stops waiting for envelopes at once (otherwise
                # each waits out its round deadline, up to --round-timeout, for envelopes the
                # failed peer will never send) and stops with TrainingAborted; the transports
                # close afterwards, with nothing in flight
                for other in trainers:
                    other.peer.stop_waiting()

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
