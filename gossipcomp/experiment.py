"""One peer's training run on digits: configuration, the local-step/gossip loop, and its outcome.

Shared by `gossipcomp simulate` (every peer in one process) and `gossipcomp peer` (one peer per
process), so both train exactly the same way.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gossipcomp.checkpoint import CheckpointStore
from gossipcomp.compress import parse_spec
from gossipcomp.data import DigitsSplit, parse_partition, partition_indices
from gossipcomp.gossip import (
    ALGORITHMS,
    DEFATC,
    DPSGD,
    Byzantine,
    Choco,
    GossipAlgorithm,
    PowerGossip,
    make_attack,
    parse_clip,
)
from gossipcomp.gossip.byzantine import DEFAULT_SCALE
from gossipcomp.gossip.clipping import AdaptiveRadius, ClipRadius
from gossipcomp.peer import Peer, PeerStats
from gossipcomp.topology import Topology
from gossipcomp.training import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LR,
    DEFAULT_MOMENTUM,
    BatchStream,
    evaluate_accuracy,
    local_step,
    make_optimizer,
)
from gossipcomp.transport.codec import all_finite

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (the same on every peer)."""

    algorithm: str = "powergossip"  # a name from gossipcomp.gossip.ALGORITHMS
    rounds: int = 600  # local steps, each followed by one gossip round
    lr: float = DEFAULT_LR  # SGD learning rate
    momentum: float = DEFAULT_MOMENTUM  # SGD momentum (each peer keeps its own buffer)
    batch_size: int = DEFAULT_BATCH_SIZE  # examples per local step
    partition: str = "iid"  # iid | by-label | dirichlet:ALPHA
    seed: int = 0  # data split, model init (identical on all peers) and batch order
    consensus_step: float | str | None = None  # gossip step; "auto"; None: the algorithm's default
    compressor: str | None = None  # compressor spec for choco and def, e.g. "topk:ratio=0.01"
    rank: int = 1  # powergossip: rank of the power iteration
    gossip_steps: int = 1  # exchanges per round: powergossip's power steps, choco's steps
    zeta: float | None = None  # def: damping of the differential update (None: per compressor)
    gamma: float | None = None  # def: mixing weight of the combine step (None: per compressor)
    eval_every: int = 50  # rounds between test-accuracy checkpoints (0: only at the end)
    round_timeout: float = 30.0  # seconds a round may wait for its neighbours
    clip: str | None = None  # clipped gossip: "adaptive", "adaptive:B", a radius; None: plain
    byzantine: tuple[int, ...] = ()  # ranks that lie (robustness experiments)
    attack: str = "sign_flip"  # what they send: a name from gossipcomp.gossip.ATTACKS
    attack_scale: float = DEFAULT_SCALE  # sign_flip sends -scale x, scale sends scale x

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; known: {sorted(ALGORITHMS)}")
        if isinstance(self.consensus_step, str) and self.consensus_step != "auto":
            raise ValueError(
                f"consensus_step must be a number or 'auto', got {self.consensus_step!r}"
            )
        parse_partition(self.partition)
        if self.compressor is not None:
            parse_spec(self.compressor)  # fail early on a bad spec, naming what exists
        if self.clip is not None:
            parse_clip(self.clip)
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.byzantine):
            raise ValueError(f"byzantine ranks must be integers >= 0, got {self.byzantine!r}")
        object.__setattr__(self, "byzantine", tuple(sorted(self.byzantine)))  # a list is welcome
        if len(set(self.byzantine)) != len(self.byzantine):
            raise ValueError(f"byzantine ranks must differ, got {self.byzantine!r}")
        make_attack(self.attack, self.attack_scale)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_algorithm(config: TrainConfig, topology: Topology, rank: int) -> GossipAlgorithm:
    """The configured gossip algorithm of peer `rank`, with step sizes resolved against the
    topology, clipped gossip when configured, and wrapped as a liar when `rank` is Byzantine."""
    outside = [r for r in config.byzantine if r >= topology.n]
    if outside:
        raise ValueError(
            f"byzantine rank {outside[0]} out of range for topology {topology.name} "
            f"(ranks 0 to {topology.n - 1})"
        )
    clipping = None if config.clip is None else parse_clip(config.clip)
    degree = len(topology.neighbors(rank))
    if isinstance(clipping, AdaptiveRadius) and clipping.b >= degree:
        log.warning(
            "peer %d has %d neighbours and --clip %s assumes up to %d of them lie: it will "
            "never mix (a fixed radius, or a smaller B, lets it)",
            rank,
            degree,
            config.clip,
            clipping.b,
        )
    algorithm = _honest_algorithm(config, topology, clipping)
    if rank in config.byzantine:
        return Byzantine(algorithm, make_attack(config.attack, config.attack_scale))
    return algorithm


def _honest_algorithm(
    config: TrainConfig, topology: Topology, clipping: ClipRadius | None
) -> GossipAlgorithm:
    step = config.consensus_step
    if config.algorithm == "dpsgd":
        return DPSGD(consensus_step=_spectral_step(step, topology), clipping=clipping)
    if config.algorithm == "powergossip":
        return PowerGossip(
            rank=config.rank,
            power_steps=config.gossip_steps,
            consensus_step=_spectral_step(step, topology),
            seed=config.seed,
            clipping=clipping,
        )
    if config.algorithm in ("choco", "def"):
        if not config.compressor:
            raise ValueError(f"algorithm {config.algorithm!r} needs a compressor spec, e.g. 'sign'")
        compressor = parse_spec(config.compressor)
        if config.algorithm == "choco":
            # "auto" and None both mean the compressor's documented default for choco
            given = None if step in (None, "auto") else float(step)
            return Choco(
                compressor,
                consensus_step=given,
                seed=config.seed,
                steps=config.gossip_steps,
                clipping=clipping,
            )
        return DEFATC(
            compressor, zeta=config.zeta, gamma=config.gamma, seed=config.seed, clipping=clipping
        )
    raise ValueError(f"unknown algorithm {config.algorithm!r}; known: {sorted(ALGORITHMS)}")


def _spectral_step(step: float | str | None, topology: Topology) -> float:
    """A given step, or (None / "auto") gamma* = 2 / (2 - lambda_2 - lambda_min) of W."""
    return topology.optimal_consensus_step if step in (None, "auto") else float(step)


def peer_examples(
    data: DigitsSplit, topology: Topology, rank: int, config: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training examples that `rank` holds under the configured partition."""
    parts = partition_indices(
        data.y_train.numpy(), topology.n, parse_partition(config.partition), config.seed
    )
    index = torch.as_tensor(parts[rank], dtype=torch.int64)
    return data.x_train[index], data.y_train[index]


@dataclass(frozen=True)
class Evaluation:
    """Test accuracy and cumulative bytes sent at a round."""

    round: int
    test_accuracy: float
    bytes_sent: int


@dataclass
class PeerOutcome:
    """How one peer's run ended."""

    rank: int
    test_accuracy: float
    stats: PeerStats
    history: list[Evaluation] = field(default_factory=list)


class TrainingAborted(RuntimeError):
    """Another peer of the same simulation failed, so this one stopped."""


class TrainingDiverged(RuntimeError):
    """A peer's parameters became NaN or Inf."""


def _check_finite(peer: Peer, round: int, stage: str) -> None:
    for name, p in peer.model.named_parameters():
        if not all_finite(p.detach()):
            raise TrainingDiverged(
                f"peer {peer.rank}: parameter {name!r} became NaN/Inf {stage} at round {round} "
                "(training diverged: try a smaller --lr or consensus step, or other --zeta/--gamma)"
            )


class PeerTrainer:
    """One peer's training run: its data stream, optimizer, accuracy history and checkpoints.

    `restore` (before `peer.start()`) continues from the newest valid checkpoint in `store`;
    `run` trains until the peer reaches `config.rounds`, saving a checkpoint every
    `checkpoint_every` rounds. A checkpoint holds everything that decides what happens next
    (model, optimizer, algorithm state, batch order, round, history), so a restored peer
    continues exactly as it would have.
    """

    def __init__(
        self,
        peer: Peer,
        data: DigitsSplit,
        config: TrainConfig,
        store: CheckpointStore | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if checkpoint_every and store is None:
            raise ValueError("checkpoint_every needs a checkpoint directory")
        self.peer = peer
        self.data = data
        self.config = config
        self.store = store
        self.checkpoint_every = checkpoint_every
        x, y = peer_examples(data, peer.topology, peer.rank, config)
        self.stream = BatchStream(x, y, config.batch_size, config.seed, peer.rank)
        self.optimizer = make_optimizer(peer.model, config.lr, config.momentum)
        self.history: list[Evaluation] = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "peer": self.peer.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "history": [asdict(c) for c in self.history],
            "config": self.config.to_dict(),
        }

    def restore(self) -> int | None:
        """Load the newest valid checkpoint of this peer, if any; return its round."""
        if self.store is None:
            return None
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        state = loaded.state
        saved, mine = _identity(state.get("config", {})), _identity(self.config.to_dict())
        if saved != mine:
            differing = sorted(k for k in mine.keys() | saved.keys() if saved.get(k) != mine.get(k))
            raise ValueError(
                f"{loaded.path}: written by another configuration; differs in "
                + ", ".join(f"{k} (saved {saved.get(k)!r}, now {mine.get(k)!r})" for k in differing)
            )
        # check every part before changing any: the optimizer state on a scratch optimizer, the
        # stream state on a copy of the stream (sharing its examples), the history by building
        # it; the peer checks its own parts before assigning them, so it goes last
        scratch = make_optimizer(self.peer.model, self.config.lr, self.config.momentum)
        scratch.load_state_dict(state["optimizer"])
        stream = copy.copy(self.stream)
        stream.load_state_dict(state["stream"])
        try:
            history = [Evaluation(**c) for c in state["history"]]
        except TypeError as error:
            raise ValueError(f"{loaded.path}: accuracy history: {error}") from error
        self.peer.load_state_dict(state["peer"])
        self.optimizer, self.stream, self.history = scratch, stream, history
        log.warning(
            "peer %d: restored from %s (round %d)", self.peer.rank, loaded.path, loaded.round
        )
        return self.peer.round

    def run(
        self,
        *,
        on_round: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> PeerOutcome:
        """Train from the peer's round to `config.rounds`: one local SGD step, one gossip round
        (a peer that catches up with its neighbours skips rounds, see Peer.gossip)."""
        peer, config = self.peer, self.config
        while peer.round < config.rounds:
            before = peer.round
            if should_stop is not None and should_stop():
                raise TrainingAborted(f"peer {peer.rank} stopped at round {before + 1}")
            local_step(peer.model, self.optimizer, self.stream.next_batch())
            # once a round suffices: received NaN/Inf is refused at the door, and anything gossip
            # itself overflowed to is caught after the next local step
            _check_finite(peer, before + 1, "after the local step")
            peer.gossip()
            r = peer.round  # usually before + 1; more after catching up with the neighbours
            if _crossed(before, r, config.eval_every) or r >= config.rounds:
                accuracy = evaluate_accuracy(peer.model, self.data.x_test, self.data.y_test)
                self.history.append(Evaluation(r, accuracy, peer.stats.bytes_sent_total))
            if self.store is not None and _crossed(before, r, self.checkpoint_every):
                self.store.save(r, self.state_dict())
            if on_round is not None:
                on_round(r)
        if not self.history or self.history[-1].round != peer.round:  # restored at the end
            accuracy = evaluate_accuracy(peer.model, self.data.x_test, self.data.y_test)
            self.history.append(Evaluation(peer.round, accuracy, peer.stats.bytes_sent_total))
        return PeerOutcome(peer.rank, self.history[-1].test_accuracy, peer.stats, self.history)


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (before, after] (never when every is 0)."""
    return every > 0 and after // every > before // every


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint must agree on; the run's length, evaluation interval and
    timeout may change between a run and its restart. A setting missing from an older
    checkpoint ran with its default."""
    full = {**TrainConfig().to_dict(), **config}
    return {k: v for k, v in full.items() if k not in ("rounds", "eval_every", "round_timeout")}
