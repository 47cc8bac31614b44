"""PeerTrainer: one peer's training run, the local-step/gossip loop with its accuracy history
and checkpoints.

Shared by `gossipcomp simulate` (every peer in one process) and `gossipcomp peer` (one peer per
process), so both train exactly the same way; a restored peer continues exactly as it would
have.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.experiment.config import TrainConfig
from gossipcomp.experiment.outcome import Evaluation, PeerOutcome, TrainingAborted, TrainingDiverged
from gossipcomp.experiment.restore import (
    _check_optimizer_state,
    _check_stream_order,
    _history,
    _identity,
    _part,
    _require_keys,
    _saved_config,
)
from gossipcomp.experiment.setup import peer_examples, static_schedule
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.progress import LossWindow
from gossipcomp.peer import Peer
from gossipcomp.transport.codec import all_finite
from gossipcomp.workload.checkpoint import CheckpointStore, LoadedCheckpoint
from gossipcomp.workload.data import DigitsSplit
from gossipcomp.workload.training import BatchStream, evaluate, local_step, make_optimizer

log = logging.getLogger("gossipcomp.experiment")  # the package's logger, as before the split

# what a checkpoint holds besides the model-sized tensors: configuration, accuracy history,
# generator state and the archive's own records (a few kB for a 600-round run)
_PAYLOAD_SLACK = 16 * 2**20
_HISTORY_ENTRY_BYTES = 128  # a pickled Evaluation takes about 40; at most one per round
OUTSIDE_POLL_SECONDS = 0.05  # how often a peer outside a live network looks for its admission


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
        self.losses = LossWindow()  # the training loss levels follow (checkpointed)
        self.coordinator: CoordinatorClient | None = None
        self.attach(coordinator)
        x, y = peer_examples(data, peer.topology, peer.rank, config)
        self.stream = BatchStream(x, y, config.batch_size, config.seed, peer.rank)
        self.optimizer = make_optimizer(peer.model, config.lr, config.momentum)
        self.history: list[Evaluation] = []
        self._started = time.perf_counter()
        schedule = static_schedule(config, peer.gossiped)
        if schedule is not None and peer.round < schedule.effective_round:
            peer.apply(schedule)  # a restored checkpoint brings its own schedules back

    def attach(self, coordinator: CoordinatorClient | None) -> None:
        """Report to `coordinator` after every round (None: to none), with this trainer's
        training losses: restored with a checkpoint, so a restored peer does not report its
        trained model's loss as its first (levels/progress.py)."""
        self.coordinator = coordinator
        if coordinator is not None:
            coordinator.losses = self.losses

    def state_dict(self) -> dict[str, Any]:
        return {
            "peer": self.peer.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "history": [asdict(c) for c in self.history],
            "config": self.config.to_dict(),
            "losses": self.losses.state_dict(),
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

        The model, its momentum buffers, the algorithm's state (at most a copy per
        neighbour and two more: DEF-ATC) and the outer state (anchor, velocity, drift
        correction) are (degree + 7) model sizes; twice that, as the
        algorithms keep their copies in float32 (double a half-precision model), plus the batch
        order (8 bytes an example, twice), one history entry per round, and a constant for the
        rest. A DEF-ATC peer on a ring writes about half of this, and so does a large model.
        """
        model_bytes = sum(
            t.numel() * t.element_size() for t in self.peer.model.state_dict().values()
        )
        degree = len(self.peer.topology.neighbors(self.peer.rank))
        return (
            2 * (degree + 7) * model_bytes
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
            _require_keys(state, {"peer", "optimizer", "stream", "history"}, {"config", "losses"})
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
        losses = LossWindow()  # a checkpoint from before losses were kept: none measured
        with _part(path, "losses"):
            if "losses" in state:
                losses.load_state_dict(state["losses"])
        with _part(path, "peer"):
            self.peer.load_state_dict(peer_state)
        self.optimizer, self.stream, self.history = scratch, stream, history
        self.losses = losses
        self.attach(self.coordinator)

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
        if not peer.member:  # outside a live network: no local steps until it is admitted
            self._await_admission()
            return
        for _ in range(config.steps_at(before + 1) - steps):
            self.losses.observe(local_step(peer.model, self.optimizer, self.stream.next_batch()))
            peer.note_local_step()  # the drift correction's share, when there is one
        # once a round suffices: received NaN/Inf is refused at the door, and anything gossip
        # itself overflowed to is caught after the next local steps
        _check_finite(peer, before + 1, "after the local steps")
        self.losses.end_round()
        peer.note_training_loss(self.losses.initial, self.losses.recent)  # levels set by peers
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

    def _await_admission(self) -> None:
        """A peer outside a live network (a joiner not admitted yet, or a member the
        coordinator removed) does no rounds, so it takes no local steps either: each would
        train its model on its own shard alone, as fast as the CPU allows, for as long as the
        admission takes. It only looks for its admission (gossip() without a round) and
        reports, a few times a second."""
        self.peer.gossip()
        if self.coordinator is not None:
            self.coordinator.after_round()
        if not self.peer.member:
            time.sleep(OUTSIDE_POLL_SECONDS)

    def _evaluate(self) -> None:
        """Record the test accuracy and loss and the bytes sent so far."""
        peer = self.peer
        accuracy, loss = evaluate(peer.model, self.data.x_test, self.data.y_test)
        steps = self.config.steps_at(peer.round)
        seconds = time.perf_counter() - self._started
        sent = peer.stats.bytes_sent_total
        self.history.append(Evaluation(steps, accuracy, sent, peer.round, seconds, loss))


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (before, after] (never when every is 0)."""
    return every > 0 and after // every > before // every
