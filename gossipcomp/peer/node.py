"""Peer: one training participant, the Python API for custom training loops.

Build it from a model, a topology, a rank, a gossip algorithm and a transport; call `start()`
once (handshake with neighbours), then `gossip()` after each optimizer step. It counts the bytes
serialised per link, the rounds, and the time spent computing (between gossip calls) versus
communicating (inside exchanges). `apply(schedule)` stages a new schedule (tensor groups and
their compressors) for the round it takes effect; every peer switches at that round.
`adapt_levels()` lets the peers set compression levels among themselves, without a coordinator
(link levels: levels/edges.py; a broadcasting algorithm's own levels: levels/senders.py).
The peer's side of compression levels, whoever sets them, is `CompressionLevels`
(levels/peer.py), which the peer calls at a few points of its round.

    model = build_mlp(seed=0)
    with Peer.over_grpc(model, topology, rank, DPSGD()) as peer:
        peer.start()
        for batch in batches:
            local_step(model, optimizer, batch)
            peer.gossip()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from functools import partial
from typing import Any

import torch

from gossipcomp.gossip.base import (
    RESUME_PHASE,
    GossipAlgorithm,
    LinkStats,
    NamedParams,
    Neighbourhood,
    Regroupable,
)
from gossipcomp.gossip.dpsgd import DPSGD
from gossipcomp.gossip.round_wait import RoundWait
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.levels.edges import EdgeLevels
from gossipcomp.levels.peer import CompressionLevels
from gossipcomp.levels.senders import SenderLevels
from gossipcomp.outer.drift import DriftTracker
from gossipcomp.outer.optimizers import OuterSGD
from gossipcomp.outer.phase import CheckedPhases, LocalPhases
from gossipcomp.peer import factory
from gossipcomp.peer.checkpoint import check_state, peer_state
from gossipcomp.peer.deadlines import check_round_timeout
from gossipcomp.peer.failures import DEFAULT_MAX_FAILED_ROUNDS, FailedRounds
from gossipcomp.peer.guard import MAX_GOSSIP_MOVE, ModelGuard, check_max_move
from gossipcomp.peer.links import Backoff, LinkMonitor, LinkState, RoundPace
from gossipcomp.peer.membership import PeerMembership
from gossipcomp.peer.rejoin import Rejoin
from gossipcomp.peer.round_graphs import check_round_graphs
from gossipcomp.peer.schedules import PeerSchedules
from gossipcomp.peer.stats import PeerStats, median_send_seconds
from gossipcomp.schedule.costs import TransferLog
from gossipcomp.schedule.schedule import Schedule, ScheduleBook
from gossipcomp.topology import Topology
from gossipcomp.transport.base import (
    ExchangeResult,
    HelloAnswer,
    Payload,
    PeerNotReady,
)
from gossipcomp.transport.protocol import Transport
from gossipcomp.workload.models import gossiped_tensors, model_signature

AVERAGE_PHASE = "average"
log = logging.getLogger("gossipcomp.peer")


class Peer:
    """One peer of a gossip network, wrapping a model that the caller trains."""

    def __init__(
        self,
        model: torch.nn.Module,
        topology: Topology,
        rank: int,
        algorithm: GossipAlgorithm,
        transport: Transport,
        *,
        round_timeout: float = 30.0,
        backoff: Backoff | None = None,
        ready: bool = True,
        pace: RoundPace | None = None,
        max_move: float | None = MAX_GOSSIP_MOVE,
        gossip_buffers: bool = True,
        local_steps: int = 1,
        constant_buffers: bool = True,
        max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS,
        turns: ComputeTurns | None = None,
        outer: OuterSGD | None = None,
        drift: DriftTracker | None = None,
        joining: bool = False,
    ) -> None:
        """`ready=False` (a peer about to restore a checkpoint): neighbours' handshakes are
        answered "not ready" until `ready()`, so none is answered from a round about to change.
        `pace`: how fast this peer goes through rounds, which bounds the rounds it believes a
        neighbour can have reached (links.py); measured as it trains. `max_move`: a gossip
        round that would move the model by more than max_move * (||x|| + 1), or make it NaN/Inf,
        is refused (None: only NaN/Inf is). Honest averaging moves a model by at most twice its
        distance to a neighbour, so only a lying or broken neighbour gets near the default;
        clipping (`--clip`) is what bounds smaller lies. `gossip_buffers`: floating-point
        buffers (BatchNorm's running statistics) are gossiped with the parameters, as one more
        tensor each (models.gossiped_tensors); False keeps each peer's own. Non-persistent
        buffers (register_buffer(..., persistent=False)) are never gossiped. Every peer of a
        network must agree (the handshake's model signature says which buffers travel).
        `constant_buffers`: the floating-point buffers that are not a normalisation layer's
        running statistics (a causal mask, a positional table) are taken as constant: never
        sent, their values in the model signature (a neighbour whose copy differs is refused
        at the handshake), and checked unchanged every round (ValueError if training changed
        one); False gossips them every round like the statistics. `local_steps`:
        `after_local_step()` gossips after every `local_steps` of them (local SGD: 1/local_steps
        of the bytes). `max_failed_rounds`: after that many rounds in a row whose exchanges
        failed with every neighbour, `gossip()` raises GossipStalled (0: never); a warning
        comes after FAILED_ROUNDS_WARNING of them. Losing some neighbours is not a failed round,
        nor is a round with every edge down, waiting for probes or resume rounds. `turns`: the
        compute turns of the peers sharing this process (gossip/turns.py), given up while this
        peer waits for its neighbours; None: this peer never waits for a turn. `outer`: the
        outer optimizer that steps from each phase's anchor by anchor - (gossip's mixed model)
        after every gossip round (a phase: `local_steps` local steps; None: the mixed model as
        it is). `drift`: the drift correction added to each local step
        (`note_local_step`/`after_local_step`) and moved by each gossip round (outer/drift.py).
        `joining` (a live topology, topology/members.py): this peer is a member only once a
        schedule newer than its own names it (a peer restarted after it may have been removed,
        or a new rank); until then it starts alone and does no rounds (peer/membership.py).
        """
        if not 0 <= rank < topology.n:
            raise ValueError(
                f"rank {rank} out of range for topology {topology.name} (n={topology.n})"
            )
        if transport.rank != rank:
            raise ValueError(f"transport is for rank {transport.rank}, peer is rank {rank}")
        check_round_timeout(round_timeout)
        self.model = model
        self.topology = topology
        self.rank = rank
        self.algorithm = algorithm
        self.transport = transport
        self.round_timeout = round_timeout
        check_max_move(max_move)
        self.round = 0
        checked_integer("local_steps", local_steps, 1)
        self.local_steps = local_steps
        self._steps_taken = 0
        # the phase's anchor, outer optimizer state and drift correction (outer/phase.py)
        trained = [p for _, p in model.named_parameters() if p.requires_grad]
        if drift is not None:  # the default rate is what this topology's gossip bears
            step = getattr(algorithm, "consensus_step", None)
            drift = drift.for_mixing(
                topology.smallest_eigenvalue,
                step if isinstance(step, float) else 1.0,
                exact=isinstance(algorithm, DPSGD),
            )
        self._phases = LocalPhases(trained, local_steps, outer, drift)
        self.gossip_buffers = gossip_buffers
        self.constant_buffers = constant_buffers
        self._params: NamedParams = gossiped_tensors(model, gossip_buffers, constant_buffers)
        # refuses a round that would break the model; checks the constant buffers
        self._guard = ModelGuard(
            rank, model, self._params, max_move, gossip_buffers, constant_buffers
        )
        check_round_graphs(topology, algorithm)
        self._weights = topology.neighbor_weights(rank)
        # the rounds in a row that heard no neighbour, and why each last failed
        self._failures = FailedRounds(rank, self._weights, max_failed_rounds)
        self.turns = turns
        self._links = LinkStats()
        self._compute_seconds = 0.0
        self._comm_seconds = 0.0
        self._last_mark: float | None = None
        self._in_step_since: float | None = None  # start of the last round heard by a neighbour
        neighbours = topology.neighbors(rank)
        edges = sorted((min(a, b), max(a, b)) for a, b in topology.graph.edges)
        self.links = LinkMonitor(
            rank,
            neighbours,
            backoff,
            on_resume=transport.inbox.allow_round,
            pace=pace,
            newest_epoch=lambda: self.schedules.newest.epoch,
            on_newer_epoch=self._want_schedules,
            may_probe=lambda j: self._membership.may_link(j),
        )
        # compression levels: a coordinator's schedules', or set with the neighbours
        self._levels = CompressionLevels(
            rank,
            topology,
            self._weights,
            algorithm,
            self._params,
            transport,
            self.links,
            schedules=lambda: self.schedules,
        )
        specs = algorithm.setup(self._params, rank, neighbours)
        specs.setdefault(RESUME_PHASE, ())  # an empty resume exchange confirms both ends are there
        self._averager = DPSGD(phase=AVERAGE_PHASE)
        specs.update(self._averager.setup(self._params, rank, neighbours))
        for phase, spec in specs.items():
            transport.inbox.expect(phase, spec)
        # the schedules it holds, stages, fetches from neighbours and switches to; `specs` is
        # per phase what envelopes hold under the schedule with no groups (epoch 0)
        self._schedules = PeerSchedules(
            rank,
            transport,
            algorithm,
            self._params,
            edges,
            self._levels,
            specs,
            capacity=topology.n if topology.live is not None else None,
            initial_members=topology.live.initial if topology.live is not None else (),
        )
        # who it gossips with, greets and answers on a live topology (peer/membership.py)
        self._membership = PeerMembership(rank, topology, lambda: self.schedules, joining)
        # handshakes, catching up, resynchronising resumed edges
        self._rejoin = Rejoin(
            rank,
            topology,
            transport,
            self.links,
            self._schedules,
            self._levels,
            algorithm,
            self._params,
            self._failures,
            self._membership,
        )
        self._admission_epoch: int | None = None  # the admission counted from (membership.py)
        # start() done: a handshake may no longer take down an edge whose exchanges succeed
        self._started = False
        self._ready = threading.Event()
        if ready:
            self._ready.set()
        transport.set_hello_handler(self._answer_hello)

    @property
    def schedules(self) -> ScheduleBook:
        """The schedules this peer holds: the one in force, those staged, their history."""
        return self._schedules.book

    @property
    def members(self) -> tuple[int, ...]:
        """The members of the network in force at this peer (every rank of a fixed topology)."""
        return self._membership.members()

    @property
    def member(self) -> bool:
        """Whether this peer is a member in force (always, on a fixed topology)."""
        return self._membership.member()

    @property
    def awaiting_admission(self) -> bool:
        """Whether this peer joins and holds no schedule naming it yet (its reports ask the
        coordinator for one)."""
        return self._membership.awaiting_admission()

    @property
    def max_move(self) -> float | None:
        """How far a gossip round may move the model, in (||x|| + 1) (None: no bound)."""
        return self._guard.max_move

    @property
    def max_failed_rounds(self) -> int:
        """Failed rounds in a row after which `gossip()` raises GossipStalled (0: never)."""
        return self._failures.max_failed_rounds

    @property
    def failed_rounds(self) -> int:
        """Rounds that tried an exchange since one last heard a neighbour."""
        return self._failures.count

    @property
    def alone(self) -> bool:
        """Whether the last round reached no neighbour."""
        return self._failures.alone

    def ready(self) -> None:
        """Start answering neighbours' handshakes (see `ready` in the constructor)."""
        self._ready.set()

    def _answer_hello(
        self, sender: int, their_round: int, proposed: int, alone: bool, epoch: int
    ) -> HelloAnswer:
        if not self._ready.is_set():
            raise PeerNotReady(f"peer {self.rank} is restoring its checkpoint")
        return self._rejoin.answer_hello(
            sender, their_round, proposed, alone, epoch, self.round, self._started
        )

    def _want_schedules(self, neighbour: int) -> None:
        """`neighbour` holds a newer schedule epoch (its handshake said so): fetch its schedules
        at the start of the next round (any thread may call this)."""
        self._schedules.want(neighbour)

    def _fetch_schedules(self) -> None:
        """Stage what finished fetches of neighbours' schedules brought, then ask the
        neighbours wanted since (peer/schedules.py)."""
        self._schedules.fetch(self.round)

    def adopt(self, schedule: Schedule) -> bool:
        """Stage a schedule a neighbour holds, checked as `apply` checks a coordinator's; one
        whose round this peer has passed takes effect at its next round (the edges it left
        resume once both ends are in it). False when this peer already has its epoch."""
        return self._schedules.adopt(schedule, self.round)

    def adapt_levels(self, round_budget: float | None = None, follow_loss: bool = True) -> None:
        """Set levels with the neighbours, without a coordinator. A link-leveled algorithm
        (PowerGossip, levels/edges.py): for each edge to a higher-ranked neighbour, this
        peer's rate controller picks the level from its own sends over it and announces it in
        its envelopes; lower-ranked neighbours' notices set the other edges. A broadcasting
        one (Choco, DEF-ATC, levels/senders.py): this peer picks the level it sends at
        from its sends over all its links and announces it; each neighbour's notices set the
        level that neighbour is decoded at. `round_budget`: seconds a round's transfers over
        one link may take (None: this peer's median compute time per round). `follow_loss`:
        no level above what the fall of this peer's training loss allows (levels/progress.py;
        `note_training_loss` tells it; False: the budget alone). Call before
        `start()` and before restoring a checkpoint; every peer of the network must (a peer
        that does not refuses notices). From then on schedules with link levels are refused:
        levels come from a coordinator or from the peers, never both."""
        self._schedules.base_specs.update(self._levels.adapt(round_budget, follow_loss))

    def note_training_loss(self, initial: float, recent: float) -> None:
        """This peer's training loss after a round: the untrained model's (the mean of its
        first local steps) and the recent rounds' mean, as levels/progress.py's `LossWindow`
        keeps them (PeerTrainer calls this; a loop of one's own does, for levels set by the
        peers to follow the loss), from the thread that calls `gossip`. Nothing happens unless
        `adapt_levels` follows it; then a loss not finite or outside 0 to 1e6 is a ValueError
        naming it, and 0 is "not measured yet"."""
        self._levels.note_loss(initial, recent)

    def apply(self, schedule: Schedule, *, late: bool = False) -> Schedule:
        """Stage `schedule` to take effect at its effective round (every peer switches then);
        the schedule as staged.

        Raises ScheduleRefused, keeping the current schedule, when it does not cover every
        parameter exactly once, names an unknown parameter or compressor, does not go forward
        in epoch, or takes effect at a round this peer has begun (ScheduleLate; with `late`,
        such a one takes effect at the first round it has not begun instead: the others
        switched already). Between two calls of `gossip()`, `round` has not begun. Envelopes
        laid out by it are accepted from now on (a neighbour may switch first); this peer uses
        it from its round. Call it from the thread that calls `gossip()`.
        """
        return self._schedules.apply(schedule, self.round, late)

    @property
    def _edge_levels(self) -> EdgeLevels | None:
        """The link levels set with the neighbours (None: fixed or a coordinator's)."""
        return self._levels.edges

    @property
    def _sender_levels(self) -> SenderLevels | None:
        """A broadcasting algorithm's levels set by the senders (None: fixed or a
        coordinator's)."""
        return self._levels.senders

    # a peer with its own gRPC server (peer/factory.py)
    over_grpc = classmethod(factory.over_grpc)

    @property
    def gossiped(self) -> NamedParams:
        """The tensors gossip averages, by name: the parameters, then the floating-point
        buffers unless they are left out. Schedules group exactly these names."""
        return list(self._params)

    @property
    def signature(self) -> str:
        """The model signature this peer's handshake carries (models.model_signature)."""
        return model_signature(self.model, self.gossip_buffers, self.constant_buffers)

    @property
    def address(self) -> str | None:
        """Where this peer's server listens (gRPC transports only)."""
        return getattr(self.transport, "address", None)

    def start(self, timeout: float = 60.0, addresses: dict[int, str] | None = None) -> None:
        """Handshake with every neighbour, waiting up to `timeout` seconds for them to appear.

        The handshake carries this peer's round. A neighbour at another round (this peer was
        restored from a checkpoint while the neighbour trained on, or the other way round)
        answers with a resume round: until then this peer trains alone (catching up, when it is
        behind), then both ends resynchronise the edge and gossip on it again. An edge that was
        down when the checkpoint was written is resynchronised whatever the rounds.

        Raises ValueError, before reaching any neighbour, when a gossiped tensor holds NaN/Inf
        (every neighbour would refuse it, and the peer would train alone) or a constant buffer
        is not what it was when the peer was made.
        """
        self._guard.check_gossiped_finite()
        self._guard.check_constants("at start")
        self._rejoin.connect(self.round, timeout, addresses)
        self._catch_up()  # at once: the neighbours reach the resume round within a few rounds
        self._last_mark = time.perf_counter()
        self._started = True

    def _await_admission(self) -> None:
        """Live membership, a peer holding its admission: count the neighbours' rounds from
        the admission's effective round (peer/membership.py), once per admission."""
        admission = self._membership.admission()
        if admission is None or admission.epoch == self._admission_epoch:
            return
        self._admission_epoch = admission.epoch
        self.links.restored(admission.effective_round, 0.0)

    def _catch_up(self) -> None:
        """Move to a resuming neighbour's round when rounds disagree (see links.py): forward
        when behind; back as well when this peer has no live edge (its round is its own). The
        new round is opened at once so that neighbour's envelopes are let in."""
        target = self.links.catch_up_round(self.round)
        if target is None:
            return
        before, self.round = self.round, target
        self._rejoin.moved(before, target)

    def _neighbourhood(
        self,
        links: LinkStats,
        live: list[int] | None = None,
        row: dict[int, float] | None = None,
        wait: RoundWait | None = None,
    ) -> Neighbourhood:
        """This peer's view of the network for the current round: the live neighbours (all by
        default) with their weights (`row`: the round's, else the topology's); the weight of any
        neighbour left out stays with the peer, so the live mixing matrix is symmetric and
        doubly stochastic when both ends agree. Its exchanges draw on the round's waiting
        budget `wait` (default: a fresh one of one round timeout)."""
        row = self._weights if row is None else row
        weights = row if live is None else {j: row[j] for j in live if j in row}
        return Neighbourhood(
            rank=self.rank,
            round=self.round,
            weights=weights,
            self_weight=1.0 - sum(weights.values()),
            transport=self.transport,
            wait=RoundWait(self.round_timeout) if wait is None else wait,
            links=links,
            schedule_epoch=self.schedules.current.epoch,
            turns=self.turns,
            period=self._period(),
        )

    def _period(self) -> int | None:
        """Rounds after which the graph in force repeats (topology.period; live: the family's
        over the members in force)."""
        live = self.topology.live
        if live is None:
            return self.topology.period
        return live.period(self.schedules.current.members)

    def _link_failed(self, neighbour: int, reason: str) -> None:
        """Take the edge to `neighbour` down this round, noting why."""
        self.links.failed(neighbour, self.round, reason)
        self._failures.failed(neighbour, reason)

    def _exchange(
        self, wait: RoundWait, phase: str, live: list[int], payload: Payload = ()
    ) -> ExchangeResult:
        """One exchange of this round with the neighbours `live`, drawing on the round's
        waiting budget `wait`, its time counted."""
        hood = self._neighbourhood(self._links, live, wait=wait)
        result = hood.exchange(phase, payload)
        self._comm_seconds += hood.comm_seconds
        return result

    def note_local_step(self) -> None:
        """Count one local optimizer step of the phase and add its share of the drift
        correction (when there is one), without gossiping: for loops that call `gossip()`
        themselves at the end of each phase."""
        self._phases.local_step()

    def after_local_step(self) -> bool:
        """Count one local optimizer step (`note_local_step`); gossip when `local_steps` of
        them have been taken since the last round (the phase ends on its own). Returns whether
        this call gossiped."""
        self._steps_taken += 1
        self._phases.local_step()
        if self._phases.steps_in_phase < self.local_steps:
            return False
        self.gossip()
        return True

    def gossip(self) -> None:
        """Run one gossip round of the algorithm on the model's parameters (in place).

        Lost neighbours are left out (and probed in the background); neighbours whose edge
        resumes this round are resynchronised first. A peer behind an edge's agreed resume
        round jumps to it (`round` then grows by more than one). A round whose result would
        make the model NaN/Inf, or move it further than `max_move` allows, is refused: the
        model is put back as it was and the edges heard this round are taken down (they resume
        later with their state resynchronised), so nothing a neighbour sends can stop the peer.
        """
        now = time.perf_counter()
        if self._last_mark is not None:
            self._compute_seconds += now - self._last_mark
            self._levels.note_compute(now - self._last_mark)
        if self._in_step_since is not None:
            self.links.pace.record(now - self._in_step_since)
        self._guard.check_constants(f"before round {self.round}")
        self._fetch_schedules()
        self._await_admission()
        self.links.poll_probes(self.round, self.transport.probe)
        self._catch_up()
        epoch = self.schedules.current.epoch
        self._schedules.switch(self.round)
        if self.schedules.current.epoch != epoch:  # a change of members drops the edges out
            for j in self._membership.outside(self.topology.neighbors(self.rank)):
                if self.links.state(j) is not LinkState.DOWN:
                    self.links.mark_down(j, self.round, "not a member of the network now")
        self._levels.switch_due(self.round)
        if not self._membership.member():  # no rounds outside the network (membership.py)
            self._last_mark = time.perf_counter()
            self._in_step_since = None  # no round in step to time until it is back
            return
        # one round timeout of waiting for all of the round's exchanges: resumes, levels, the
        # algorithm's phases (gossip/round_wait.py)
        wait = RoundWait(self.round_timeout)
        resumed = self._rejoin.resume_edges(self.round, partial(self._exchange, wait))
        self._levels.decide(self.round, self._links.sends)
        row = self._membership.row(self.round)  # this round's graph (over its members)
        hood = self._neighbourhood(self._links, self.links.live(), row, wait)
        before = self._guard.snapshot()
        ends = self._phases.ends()
        self.algorithm.step(self._params, hood)
        for j, reason in hood.failed.items():
            self._link_failed(j, reason)
        self._levels.hear(hood, self.round)
        heard = [j for j in hood.weights if j not in hood.failed]
        if heard and not self._guard.acceptable(before):
            blamed = self._guard.to_blame(hood, heard, before)
            reason = self._guard.refuse_round(before, blamed, self.round)
            for j in blamed:
                self._link_failed(j, reason)
            heard = []
        self._phases.finish(ends)  # the outer step from the mixed model, the drift's move
        self.links.in_step(heard, self.round)
        self._in_step_since = now if heard else None
        failed = set(hood.failed) | set(hood.weights).difference(heard)
        if row:  # a round whose graph gives this peer no neighbour is not isolation
            self._failures.report_isolation(hood.weights, failed, self.round)
        self._failures.count_round(bool(heard), resumed or bool(hood.weights), self.round)
        self.round += 1
        self._comm_seconds += hood.comm_seconds
        self._last_mark = time.perf_counter()
        self._failures.stop_if_stalled(self.round - 1)

    def averaging_rounds(self, tolerance: float = 1e-6) -> int:
        """Exact-gossip rounds that shrink disagreement by `tolerance` on this topology."""
        live = self.topology.live
        slem = (
            self.topology.second_largest_eigenvalue_modulus
            if live is None
            else live.slem(self.schedules.current.members)
        )
        if slem <= 0.0:
            return 1
        return min(1000, max(1, math.ceil(math.log(tolerance) / math.log(slem))))

    def network_average(self, rounds: int | None = None) -> list[torch.Tensor]:
        """Estimate the network-average model by exact gossip on copies of the gossiped
        tensors (`gossiped`, in that order).

        A measurement, not training: the model is untouched and the bytes are not counted in
        `stats`. Every peer must call it at the same point with the same `rounds`.
        """
        rounds = self.averaging_rounds() if rounds is None else rounds
        self._levels.silence()  # no level notice outlives training
        copies = [(name, p.detach().clone()) for name, p in self._params]
        for _ in range(rounds):
            row = self._membership.row(self.round) if self.topology.live is not None else None
            self._averager.step(copies, self._neighbourhood(LinkStats(), self.links.live(), row))
            self.round += 1
        return [p for _, p in copies]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of this peer: round, model, algorithm state and counters."""
        return peer_state(
            self.round,
            self.model,
            self.algorithm,
            self._links,
            self.links,
            self.schedules,
            self._levels.state_dict(),
            self._phases.state_dict() if self._phases.active else None,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint before `start()`: every part is checked against this peer's
        model and algorithm first, so a mismatch raises ValueError and changes nothing."""
        checked = check_state(
            state, self.model.state_dict(), set(self._weights), self._guard.constant_values()
        )
        round = checked.round
        schedules = self._schedules.checked_book(state, round)
        levels = self._levels.checked(state.get("link_levels"), state.get("broadcast_levels"))
        specs = self._schedules.specs_in_use(schedules, levels.book)  # checks they fit
        phases = self._checked_phases(state.get("outer"))
        self._levels.load_algorithm(state["algorithm"], schedules.current, levels)
        # everything below was checked above: nothing can fail half-way
        if isinstance(self.algorithm, Regroupable):
            self.algorithm.regroup(self._params, schedules.current.groups or None)
        self._schedules.restore(schedules, specs)
        self._membership.restarted_from(schedules.newest.epoch)
        self._levels.restore(levels, schedules.current)
        self.transport.inbox.forget_epochs_before(schedules.current.epoch)
        self._schedules.refresh_replies()
        self.model.load_state_dict(checked.model)
        if phases is not None:
            self._phases.restore(phases)
        self.round = round
        self._links.bytes_sent = checked.counters["bytes_sent"]
        self._links.bytes_received = checked.counters["bytes_received"]
        self._links.failures = checked.counters["failures"]
        self._rejoin.restored(round, checked.down, checked.saved_at, checked.seconds_per_round)

    def _checked_phases(self, saved: Any) -> CheckedPhases | None:
        """A checkpoint's outer state checked against this peer's outer settings (None: the
        checkpoint has none, and this peer uses none)."""
        if saved is None and not self._phases.active:
            return None
        if saved is None:
            raise ValueError(
                "peer checkpoint: holds no outer optimizer or drift state, and this peer uses "
                "one (written by a run without --outer/--drift?)"
            )
        return self._phases.checked(saved)

    @property
    def transfers(self) -> TransferLog:
        """The last transfers of each link (bytes both ways, seconds per exchange)."""
        return self._links.transfers

    @property
    def sends(self) -> TransferLog:
        """The last sends to each neighbour (bytes sent, seconds until it had them)."""
        return self._links.sends

    @property
    def stats(self) -> PeerStats:
        return PeerStats(
            rank=self.rank,
            rounds=self.round,
            bytes_sent=dict(self._links.bytes_sent),
            bytes_received=dict(self._links.bytes_received),
            failed_exchanges=dict(self._links.failures),
            compute_seconds=self._compute_seconds,
            comm_seconds=self._comm_seconds,
            mismatched_epoch_exchanges=self._links.epoch_mismatches,
            schedule_epochs=tuple(self.schedules.history),
            late_epochs=frozenset(self.schedules.taken_late),
            local_steps=self._steps_taken,
            link_levels=tuple(self._levels.link_changes),
            peer_levels=tuple(self._levels.own_changes),
            send_seconds=median_send_seconds(self._links.sends),
        )

    def stop_waiting(self) -> None:
        """End this peer's waits for envelopes, now and from now on: the run it belongs to is
        over, and an exchange in progress returns with what has arrived (its transport stays
        open until `close`, so nothing in flight is cut off)."""
        self.transport.inbox.mailbox.shut()

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
