"""One peer's training run on digits: configuration, the local-step/gossip loop, and its outcome.

Shared by `gossipcomp simulate` (every peer in one process) and `gossipcomp peer` (one peer per
process), so both train exactly the same way.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from gossipcomp.checkpoint import CheckpointError, CheckpointStore, LoadedCheckpoint
from gossipcomp.compress import parse_spec
from gossipcomp.coordinator_client import CoordinatorClient
from gossipcomp.data import DATASETS, DigitsSplit, load_split, parse_partition, partition_indices
from gossipcomp.gossip import (
    ALGORITHMS,
    Byzantine,
    GossipAlgorithm,
    NamedParams,
    make_algorithm,
    make_attack,
    parse_clip,
)
from gossipcomp.gossip.byzantine import DEFAULT_SCALE
from gossipcomp.gossip.clipping import AdaptiveRadius, ClipRadius
from gossipcomp.gossip.specs import (
    MAX_GOSSIP_STEPS,
    BuildContext,
    canonical_spec,
    parse_options,
)
from gossipcomp.models import MODELS, build_model
from gossipcomp.peer import DEFAULT_MAX_FAILED_ROUNDS, MAX_ROUND_TIMEOUT, Peer, PeerStats
from gossipcomp.schedule import CompressorCost, CostModel, LinkCost, TensorInfo, make_planner
from gossipcomp.schedule.schedule import Schedule
from gossipcomp.text import quoted
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
from gossipcomp.transport.base import MAX_WIRE_ROUND
from gossipcomp.transport.codec import all_finite

log = logging.getLogger(__name__)

# an SGD rate this large diverges at once (TrainingDiverged, tests/test_simulate.py); far above
# it, torch cannot apply the step to float32 parameters at all (1e308: an overflow error)
MAX_LR = 1e6
MAX_SEED = 2**32 - 1  # the data split's seed (scikit-learn, numpy) must fit 32 bits
MAX_RUN_SECONDS = 10 * 365 * 86400.0  # a history entry claiming a run longer is no run's
MAX_LOCAL_STEPS = 10**6  # local steps between gossip rounds; more is a run without gossip
# what a checkpoint holds besides the model-sized tensors: configuration, accuracy history,
# generator state and the archive's own records (a few kB for a 600-round run)
_PAYLOAD_SLACK = 16 * 2**20
_HISTORY_ENTRY_BYTES = 128  # a pickled Evaluation takes about 40; at most one per round
# Static schedules (--schedule without a coordinator) are planned from one reference cost model,
# the same on every peer, so every peer computes the same plan without a word exchanged: a
# compressor call costs 60 us plus 2 ns an element, a loopback envelope 0.4 ms plus 1 ns a
# byte (the order measured on this project's 2-core machine, docs/benchmarks.md). A
# coordinator plans from what the peers measured instead.
REFERENCE_COMPRESSION = CompressorCost(fixed_s=60e-6, per_element_s=2e-9)
REFERENCE_LINK = LinkCost(latency_s=4e-4, seconds_per_byte=1e-9)
# the algorithms whose payload follows tensor groups (PowerGossip merges its raw payload only)
GROUPED_ALGORITHMS = ("choco", "def", "powergossip")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (the same on every peer)."""

    # a name from gossipcomp.gossip.ALGORITHMS, whose options come from the fields below, or a
    # whole spec such as "choco:compressor=sign,steps=4,gamma=0.7" (gossip/specs.py)
    algorithm: str = "powergossip"
    model: str = "mlp"  # a name from gossipcomp.models.MODELS
    dataset: str = "digits"  # a name from gossipcomp.data.DATASETS
    rounds: int = 600  # local steps; a gossip round follows every `local_steps` of them
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
    # tensor groups for choco and def: "per-tensor", "single" or a planner spec (static plan)
    schedule: str = "per-tensor"
    # floating-point buffers (BatchNorm's running statistics) gossiped with the parameters
    gossip_buffers: bool = True
    local_steps: int = 1  # local optimizer steps between gossip rounds (local SGD)
    # rounds in a row without hearing any neighbour before a peer stops (0: never)
    max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS

    def __post_init__(self) -> None:
        """Refuse any setting that could not train, naming it, before anything runs."""
        _integer("rounds", self.rounds, 1, MAX_WIRE_ROUND - 1)
        _integer("batch_size", self.batch_size, 1)
        _integer("eval_every", self.eval_every, 0)
        _integer("seed", self.seed, 0, MAX_SEED)
        _integer("rank", self.rank, 1)
        _integer("gossip_steps", self.gossip_steps, 1, MAX_GOSSIP_STEPS)
        _integer("local_steps", self.local_steps, 1, MAX_LOCAL_STEPS)
        _integer("max_failed_rounds", self.max_failed_rounds, 0, MAX_WIRE_ROUND - 1)
        _number("lr", self.lr, 0.0, MAX_LR)
        _number("momentum", self.momentum, 0.0, 1.0, closed_low=True, closed_high=False)
        _number("round_timeout", self.round_timeout, 0.0, MAX_ROUND_TIMEOUT)
        if not isinstance(self.gossip_buffers, bool):
            raise ValueError(
                f"gossip_buffers must be True or False, got {quoted(self.gossip_buffers)}"
            )
        for name in ("zeta", "gamma"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name), 0.0, 1.0)
        if isinstance(self.consensus_step, str):
            if self.consensus_step != "auto":
                raise ValueError(
                    f"consensus_step must be a number or 'auto', got {self.consensus_step!r}"
                )
        elif self.consensus_step is not None:  # the algorithm checks its own upper limit
            _number("consensus_step", self.consensus_step, 0.0, math.inf, closed_high=False)
        if ":" in self.algorithm:  # a whole spec: its options are not given twice
            defaults = TrainConfig()
            name = parse_options(self.algorithm, ALGORITHMS)[0]
            for option in ALGORITHMS[name].OPTIONS.values():
                flag = option.flag
                if flag is not None and getattr(self, flag) != getattr(defaults, flag):
                    raise ValueError(
                        f"{flag}: given both in the algorithm spec {quoted(self.algorithm)} "
                        "and on its own; expected one of them"
                    )
        self.algorithm_options()  # a complete, valid spec (a required compressor given)
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
        if self.model not in MODELS:
            raise ValueError(f"unknown model {quoted(self.model)}; known: {sorted(MODELS)}")
        if not isinstance(self.dataset, str) or self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {quoted(self.dataset)}; known: {sorted(DATASETS)}")
        if self.model == "cnn" and self.dataset != "digits":
            raise ValueError(
                f"model cnn reads the 8x8 digits images; dataset {self.dataset} is tabular: "
                "expected model mlp or resmlp"
            )
        make_planner(self.schedule)  # fails naming the planners that exist
        if self.schedule != "per-tensor" and self.algorithm_name not in GROUPED_ALGORITHMS:
            raise ValueError(
                f"schedule {quoted(self.schedule)}: only {', '.join(GROUPED_ALGORITHMS)} "
                f"send tensor groups; {self.algorithm_name} takes schedule 'per-tensor'"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def gossip_rounds(self) -> int:
        """Gossip rounds a peer runs: one after every `local_steps` local steps (the last
        after what is left of `rounds`)."""
        return -(-self.rounds // self.local_steps)

    def steps_at(self, gossip_round: int) -> int:
        """Local steps done when a peer has finished `gossip_round` gossip rounds."""
        return min(gossip_round * self.local_steps, self.rounds)

    @property
    def algorithm_name(self) -> str:
        return self.algorithm.partition(":")[0].strip()

    def algorithm_spec(self) -> str:
        """The algorithm as one spec string: `algorithm` when it is one, else its name with
        the options the fields give (each algorithm option names its field)."""
        if ":" in self.algorithm:
            return self.algorithm
        cls = ALGORITHMS.get(self.algorithm)
        if cls is None:
            parse_options(self.algorithm, ALGORITHMS)  # raises, naming those that exist
            raise AssertionError("unreachable")
        options = {
            key: getattr(self, option.flag) if option.flag else None
            for key, option in cls.OPTIONS.items()
        }
        return canonical_spec(self.algorithm, options)

    def algorithm_options(self) -> dict[str, Any]:
        """Every option of the algorithm, given or defaulted (ValueError when not valid)."""
        return parse_options(self.algorithm_spec(), ALGORITHMS)[1]

    @property
    def group_compressor(self) -> str | None:
        """The compressor spec a schedule's groups get: the algorithm's own, "identity" for
        PowerGossip (whose groups only merge its raw payload), None for algorithms whose
        payload follows no groups."""
        if self.algorithm_name not in GROUPED_ALGORITHMS:
            return None
        return self.algorithm_options().get("compressor", "identity")


def _integer(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ValueError naming `name` unless `value` is an int (not a bool) in [low, high]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        upper = "" if high is None else f" and <= {high}"
        raise ValueError(f"{name} must be >= {low}{upper} (an integer), got {quoted(value)}")


def _number(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    closed_low: bool = False,
    closed_high: bool = True,
) -> None:
    """Raise ValueError naming `name` unless `value` is a finite int or float (not a bool) in
    the interval from `low` to `high`, open at the low end and closed at the high end unless
    told otherwise (NaN fails every comparison, so it is caught by the same test)."""
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        above = low <= value if closed_low else low < value
        below = value <= high if closed_high else value < high
        ok = above and below and (isinstance(value, int) or math.isfinite(value))
    if not ok:
        interval = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {quoted(value)}")


def build_algorithm(config: TrainConfig, topology: Topology, rank: int) -> GossipAlgorithm:
    """The configured gossip algorithm of peer `rank`, with step sizes resolved against the
    topology, clipped gossip when configured, and wrapped as a liar when `rank` is Byzantine."""
    outside = [r for r in config.byzantine if r >= topology.n]
    if outside:
        raise ValueError(
            f"byzantine rank {outside[0]} out of range for topology {topology.name} "
            f"(ranks 0 to {topology.n - 1})"
        )
    if len(config.byzantine) == topology.n:  # distinct ranks, all in range: every one
        raise ValueError(
            f"no honest peer left to measure: --byzantine lists every rank of topology "
            f"{topology.name} (0 to {topology.n - 1})"
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
    context = BuildContext(config.seed, topology.optimal_consensus_step, clipping)
    return make_algorithm(config.algorithm_spec(), context)


def static_schedule(config: TrainConfig, params: NamedParams) -> Schedule | None:
    """The schedule `config.schedule` names, planned from the reference cost model and in
    force from round 1 (None for 'per-tensor', what a peer runs without a schedule)."""
    if config.schedule == "per-tensor":
        return None
    spec = parse_spec(config.group_compressor or "identity").spec
    costs = CostModel(
        {s: REFERENCE_COMPRESSION for s in {spec, "identity", "fp16"}},
        REFERENCE_LINK,
        compute_s=0.0,
    )
    tensors = [TensorInfo(name, p.numel()) for name, p in params]
    groups = make_planner(config.schedule).plan(tensors, costs, spec)
    return Schedule(1, 1, tuple(groups), planner=config.schedule)


def load_data(config: TrainConfig) -> DigitsSplit:
    """The configured data set, split by the configured seed (the same on every peer)."""
    return load_split(config.dataset, seed=config.seed)


def build_config_model(config: TrainConfig, data: DigitsSplit) -> torch.nn.Module:
    """The configured model, sized for `data` and initialised from the configured seed."""
    return build_model(config.model, config.seed, data.num_features, data.num_classes)


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
    """Test accuracy and cumulative bytes sent after `round` local steps and `gossip_round`
    gossip rounds (the same with one local step per round), `seconds` into the run (0 in an
    older checkpoint's entries)."""

    round: int
    test_accuracy: float
    bytes_sent: int
    gossip_round: int
    seconds: float = 0.0


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
        coordinator: CoordinatorClient | None = None,
    ) -> None:
        """`coordinator`: reports after every round and stages the schedules it sends."""
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if checkpoint_every and store is None:
            raise ValueError("checkpoint_every needs a checkpoint directory")
        self.peer = peer
        self.data = data
        self.config = config
        self.store = store
        self.checkpoint_every = checkpoint_every
        self.coordinator = coordinator
        x, y = peer_examples(data, peer.topology, peer.rank, config)
        self.stream = BatchStream(x, y, config.batch_size, config.seed, peer.rank)
        self.optimizer = make_optimizer(peer.model, config.lr, config.momentum)
        self.history: list[Evaluation] = []
        self._started = time.perf_counter()
        schedule = static_schedule(config, peer.gossiped)
        if schedule is not None and peer.round < schedule.effective_round:
            peer.apply(schedule)  # a restored checkpoint brings its own schedules back

    def state_dict(self) -> dict[str, Any]:
        return {
            "peer": self.peer.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "history": [asdict(c) for c in self.history],
            "config": self.config.to_dict(),
        }

    def restore(self) -> int | None:
        """Load the newest usable checkpoint of this peer, if any; return its round.

        A file that could not have been written by this peer's run (any part malformed, of
        the wrong shape or type, too big for this model) is skipped with a warning naming the
        file and the part, and the next older one is tried. A checkpoint of another
        configuration stops the restore (ValueError naming the settings that differ): that is
        a mistake in how the peer was started, and an older file would only hide it.
        """
        if self.store is None:
            return None
        loaded = self.store.load_latest(self._adopt, max_payload=self.max_checkpoint_payload())
        if loaded is None:
            return None
        log.warning(
            "peer %d: restored from %s (round %d)", self.peer.rank, loaded.path, loaded.round
        )
        return self.peer.round

    def max_checkpoint_payload(self) -> int:
        """The most payload bytes a checkpoint of this peer can hold, from its own sizes.

        The model, its momentum buffers and the algorithm's state (at most a copy per
        neighbour and two more: DEF-ATC) are (degree + 4) model sizes; twice that, as the
        algorithms keep their copies in float32 (double a half-precision model), plus the batch
        order (8 bytes an example, twice), one history entry per round, and a constant for the
        rest. A DEF-ATC peer on a ring writes about half of this, and so does a large model.
        """
        model_bytes = sum(
            t.numel() * t.element_size() for t in self.peer.model.state_dict().values()
        )
        degree = len(self.peer.topology.neighbors(self.peer.rank))
        return (
            2 * (degree + 4) * model_bytes
            + 16 * self.stream.num_examples
            + _HISTORY_ENTRY_BYTES * self.config.rounds
            + _PAYLOAD_SLACK
        )

    def _adopt(self, loaded: LoadedCheckpoint) -> None:
        """Check every part of `loaded` before changing anything, then take it over.

        A bad part raises CheckpointError naming it (load_latest then tries an older file); a
        checkpoint of another configuration raises ValueError. The optimizer state is loaded
        into a scratch optimizer and the stream state into a copy of the stream (sharing its
        examples); the peer checks its own parts before assigning them, so it goes last.
        """
        path, state = loaded.path, loaded.state
        with _part(path, "state"):
            _require_keys(state, {"peer", "optimizer", "stream", "history"}, {"config"})
        with _part(path, "config"):
            saved_config = _saved_config(state.get("config", {}))
        saved, mine = _identity(saved_config), _identity(self.config.to_dict())
        if saved != mine:
            differing = sorted(k for k in mine.keys() | saved.keys() if saved.get(k) != mine.get(k))
            raise ValueError(
                f"{path}: written by another configuration; differs in "
                + ", ".join(f"{k} (saved {saved.get(k)!r}, now {mine.get(k)!r})" for k in differing)
            )
        peer_state = state["peer"]
        with _part(path, "peer"):
            if not isinstance(peer_state, dict):
                raise ValueError(f"expected a dict, got {type(peer_state).__name__}")
        with _part(path, "peer.round"):
            found = peer_state.get("round")
            if type(found) is not int or found != loaded.round:
                raise ValueError(f"expected {loaded.round} (the file's round), got {quoted(found)}")
        with _part(path, "peer.model"):
            _require_finite(peer_state.get("model"))
        scratch = make_optimizer(self.peer.model, self.config.lr, self.config.momentum)
        with _part(path, "optimizer"):
            _check_optimizer_state(state["optimizer"], scratch, self.peer.model)
            scratch.load_state_dict(state["optimizer"])
        stream = copy.copy(self.stream)
        with _part(path, "stream"):
            _check_stream_order(state["stream"], stream.num_examples)
            stream.load_state_dict(state["stream"])
        with _part(path, "history"):
            history = _history(state["history"], loaded.round, self.config)
        with _part(path, "peer"):
            self.peer.load_state_dict(peer_state)
        self.optimizer, self.stream, self.history = scratch, stream, history

    def run(
        self,
        *,
        on_round: Callable[[int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> PeerOutcome:
        """Train from the peer's round until it has done `config.rounds` local steps:
        `config.local_steps` local SGD steps, then one gossip round (a peer that catches up
        with its neighbours skips rounds, and their steps, see Peer.gossip). Accuracy is
        recorded every `eval_every` local steps, checkpoints every `checkpoint_every` gossip
        rounds; `on_round` hears of every gossip round."""
        peer, config = self.peer, self.config
        # seconds into the run: a restored peer goes on from its checkpoint's last evaluation
        self._started = time.perf_counter() - (self.history[-1].seconds if self.history else 0.0)
        while peer.round < config.gossip_rounds:
            with peer.turns.turn() if peer.turns is not None else nullcontext():
                self._round(on_round, should_stop)
        if not self.history or self.history[-1].gossip_round != peer.round:  # restored at the end
            self._evaluate()
        return PeerOutcome(peer.rank, self.history[-1].test_accuracy, peer.stats, self.history)

    def _round(
        self, on_round: Callable[[int], None] | None, should_stop: Callable[[], bool] | None
    ) -> None:
        """The local steps and one gossip round (with the peer's compute turn held, when the
        peers of this process take turns: the turn is given up while it waits in gossip)."""
        peer, config = self.peer, self.config
        before = peer.round
        steps = config.steps_at(before)
        if should_stop is not None and should_stop():
            raise TrainingAborted(f"peer {peer.rank} stopped at round {before + 1}")
        for _ in range(config.steps_at(before + 1) - steps):
            local_step(peer.model, self.optimizer, self.stream.next_batch())
        # once a round suffices: received NaN/Inf is refused at the door, and anything gossip
        # itself overflowed to is caught after the next local steps
        _check_finite(peer, before + 1, "after the local steps")
        if self.coordinator is not None:
            self.coordinator.observe_gradients(peer.model)
        peer.gossip()
        if self.coordinator is not None:
            self.coordinator.after_round()
        r = peer.round  # usually before + 1; more after catching up with the neighbours
        done = config.steps_at(r)
        if _crossed(steps, done, config.eval_every) or done >= config.rounds:
            self._evaluate()
        if self.store is not None and _crossed(before, r, self.checkpoint_every):
            self.store.save(r, self.state_dict())
        if on_round is not None:
            on_round(r)

    def _evaluate(self) -> None:
        """Record the test accuracy and bytes sent so far."""
        peer = self.peer
        accuracy = evaluate_accuracy(peer.model, self.data.x_test, self.data.y_test)
        steps = self.config.steps_at(peer.round)
        seconds = time.perf_counter() - self._started
        sent = peer.stats.bytes_sent_total
        self.history.append(Evaluation(steps, accuracy, sent, peer.round, seconds))


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (before, after] (never when every is 0)."""
    return every > 0 and after // every > before // every


@contextmanager
def _part(path: Path, field: str) -> Iterator[None]:
    """Report a ValueError, TypeError or KeyError raised while checking `field` of the
    checkpoint at `path` as a CheckpointError naming both, so load_latest skips the file."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(path, f"{field}: {error}") from error


def _require_keys(value: Any, required: Set[str], optional: Set[str] = frozenset()) -> None:
    """Raise ValueError unless `value` is a dict holding `required` and only `optional` more."""
    if not isinstance(value, dict) or not required <= set(value) <= required | optional:
        found = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
        expected = sorted(required) + [f"{k} (optional)" for k in sorted(optional)]
        raise ValueError(f"expected keys {expected}, got {quoted(found)}")


def _saved_config(value: Any) -> dict[str, Any]:
    """A checkpoint's configuration as a full, valid TrainConfig's settings.

    Anything TrainConfig would refuse (another type, unknown keys, bad values) cannot have
    been written by a run, so it is a bad file (ValueError), not another configuration.
    """
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        found = sorted(map(repr, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"expected a dict of settings by name, got {quoted(found)}")
    unknown = sorted(value.keys() - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown settings {quoted(unknown)}")
    return TrainConfig(**value).to_dict()


def _require_finite(model: Any) -> None:
    """Raise ValueError if a floating-point tensor of a saved model state holds NaN/Inf (the
    peer never keeps such a model; its shapes are checked by Peer.load_state_dict)."""
    if not isinstance(model, dict):
        return  # Peer.load_state_dict names what is wrong with it
    for name, value in model.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not all_finite(value):
            raise ValueError(f"{quoted(name)} holds NaN/Inf")


def _check_optimizer_state(
    saved: Any, scratch: torch.optim.Optimizer, model: torch.nn.Module
) -> None:
    """Raise ValueError unless `saved` is the state of `scratch` (this run's SGD) after some
    steps: its parameter groups with the same settings, and per parameter at most a finite
    momentum buffer of the parameter's shape and dtype. torch.optim checks the groups' sizes
    only; a buffer of another shape would fail mid-training, and one of another dtype would be
    converted (allocated afresh) before any check."""
    _require_keys(saved, {"state", "param_groups"})
    groups, expected = saved["param_groups"], scratch.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(expected):
        raise ValueError(f"param_groups: expected {len(expected)} groups, got {quoted(groups)}")
    for index, (group, fresh) in enumerate(zip(groups, expected, strict=True)):
        # an older torch may have saved fewer settings; it fills in the defaults
        _require_keys(group, {"params"}, set(fresh) - {"params"})
        for key, value in group.items():
            if not _plain_equal(value, fresh[key]):
                raise ValueError(
                    f"param_groups[{index}][{key!r}]: expected {fresh[key]!r}, got {quoted(value)}"
                )
    params = list(model.parameters())
    per_param = saved["state"]
    if not isinstance(per_param, dict) or not all(
        type(k) is int and 0 <= k < len(params) for k in per_param
    ):
        found = sorted(map(repr, per_param)) if isinstance(per_param, dict) else per_param
        raise ValueError(
            f"state: expected parameter indices 0 to {len(params) - 1}, got {quoted(found)}"
        )
    for index, entry in per_param.items():
        _require_keys(entry, set(), {"momentum_buffer"})
        buffer, param = entry.get("momentum_buffer"), params[index]
        if buffer is None:
            continue
        if (
            not isinstance(buffer, torch.Tensor)
            or buffer.shape != param.shape
            or buffer.dtype != param.dtype
        ):
            found = (
                f"{tuple(buffer.shape)} {buffer.dtype}"
                if isinstance(buffer, torch.Tensor)
                else type(buffer).__name__
            )
            raise ValueError(
                f"state[{index}] momentum_buffer: expected {tuple(param.shape)} {param.dtype}, "
                f"got {quoted(found)}"
            )
        if not all_finite(buffer):
            raise ValueError(f"state[{index}] momentum_buffer holds NaN/Inf")


def _plain_equal(value: Any, expected: Any) -> bool:
    """Whether `value` equals an optimizer setting `expected` (a scalar or a list of them) with
    the same types throughout; never compares a tensor, whose truth value would raise."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(value) == len(expected) and all(
            _plain_equal(a, b) for a, b in zip(value, expected, strict=True)
        )
    return bool(value == expected)


def _check_stream_order(saved: Any, num_examples: int) -> None:
    """What BatchStream.load_state_dict leaves unchecked: the order is one permutation of this
    peer's examples (another index would fail, or read past them, mid-training) and the
    counters are plain integers, not bools."""
    _require_keys(saved, {"generator", "order", "cursor", "epoch"})
    order = saved["order"]
    if isinstance(order, torch.Tensor) and order.dtype == torch.int64 and order.numel():
        permutation = order.ndim == 1 and order.numel() == num_examples
        if not permutation or not torch.equal(order.sort().values, torch.arange(num_examples)):
            raise ValueError(f"order: expected a permutation of {num_examples} example indices")
    for key in ("cursor", "epoch"):
        if isinstance(saved[key], bool):
            raise ValueError(f"{key}: expected an integer, got {saved[key]!r}")


def _history(saved: Any, round: int, config: TrainConfig) -> list[Evaluation]:
    """The saved accuracy history, checked: evaluations at local steps and gossip rounds up to
    the checkpoint's (gossip `round`), with an accuracy in [0, 1] and a byte count >= 0. An
    older checkpoint's entries lack the gossip round: with one local step a round, it is the
    step."""
    if not isinstance(saved, list):
        raise ValueError(f"expected a list, got {type(saved).__name__}")
    history = []
    for index, entry in enumerate(saved):
        _require_keys(entry, {"round", "test_accuracy", "bytes_sent"}, {"gossip_round", "seconds"})
        at, accuracy, sent = entry["round"], entry["test_accuracy"], entry["bytes_sent"]
        gossip_round, seconds = entry.get("gossip_round", at), entry.get("seconds", 0.0)
        try:
            _number("seconds", seconds, 0.0, MAX_RUN_SECONDS, closed_low=True)
            _integer("round", at, 0, config.steps_at(round))
            _integer("gossip_round", gossip_round, 0, round)
            _number("test_accuracy", accuracy, 0.0, 1.0, closed_low=True)
            _integer("bytes_sent", sent, 0)
        except ValueError as error:
            raise ValueError(f"[{index}] {error}") from None
        history.append(Evaluation(at, float(accuracy), sent, gossip_round, float(seconds)))
    return history


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint must agree on; the run's length, evaluation interval,
    timeout and bound on failed rounds may change between a run and its restart. A setting
    missing from an older checkpoint ran with its default."""
    full = {**TrainConfig().to_dict(), **config}
    free = ("rounds", "eval_every", "round_timeout", "max_failed_rounds")
    return {k: v for k, v in full.items() if k not in free}
