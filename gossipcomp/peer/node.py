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

import dataclasses
import logging
import math
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from gossipcomp.gossip.base import (
    RESUME_PHASE,
    GossipAlgorithm,
    LinkStats,
    NamedParams,
    Neighbourhood,
    Regroupable,
    Resumable,
)
from gossipcomp.gossip.clipping import total_norm
from gossipcomp.gossip.dpsgd import DPSGD
from gossipcomp.gossip.state import checked_tensors
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.levels.edges import EdgeLevels
from gossipcomp.levels.peer import LEVELS_LOGGER as LEVELS_LOGGER
from gossipcomp.levels.peer import LEVELS_PHASE as LEVELS_PHASE
from gossipcomp.levels.peer import CompressionLevels, LevelBook
from gossipcomp.levels.senders import SenderLevels
from gossipcomp.models import constant_tensors, gossiped_tensors, model_signature
from gossipcomp.peer.links import RESUME_MARGIN, Backoff, LinkMonitor, RoundPace
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.costs import TransferLog
from gossipcomp.schedule.messages import ScheduleReplies, schedule_from_proto
from gossipcomp.schedule.schedule import Schedule, ScheduleBook, ScheduleRefused
from gossipcomp.text import quoted
from gossipcomp.topology import Topology
from gossipcomp.transport.base import (
    MAX_WIRE_ROUND,
    ExchangeResult,
    Greeting,
    HelloAnswer,
    Identity,
    Payload,
    PayloadSpec,
    PeerNotReady,
    Transport,
)
from gossipcomp.transport.codec import all_finite
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport
from gossipcomp.transport.schedules import MAX_SHARED_SCHEDULES, SharesSchedules
from gossipcomp.transport.throttled import LinkRates, ThrottledTransport

AVERAGE_PHASE = "average"
MAX_GOSSIP_MOVE = 100.0  # a gossip round may move the model by this many times (||x|| + 1)
MIN_ROUND_SECONDS = 1e-6  # a checkpointed pace below this would believe any claimed round
MAX_ROUND_TIMEOUT = 86400.0  # seconds: a round deadline beyond a day is a typing mistake
# rounds in a row whose exchanges failed with every neighbour before the peer stops (0: never)
DEFAULT_MAX_FAILED_ROUNDS = 20
FAILED_ROUNDS_WARNING = 3  # ... and before it warns that its exchanges keep failing
log = logging.getLogger("gossipcomp.peer")


@dataclass(frozen=True)
class PeerStats:
    """What a peer has done so far: rounds, serialised bytes per link, and where time went."""

    rank: int
    rounds: int
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    failed_exchanges: dict[int, int]
    compute_seconds: float
    comm_seconds: float
    mismatched_epoch_exchanges: int = 0  # exchanges refused: the two ends were in other epochs
    schedule_epochs: tuple[Schedule, ...] = ()  # every schedule that took effect, in order
    local_steps: int = 0  # local steps counted by `after_local_step` (custom loops)
    # each change of one of its links' level: {round, link: [low, high], level: label}
    link_levels: tuple[dict[str, Any], ...] = ()
    # per neighbour: the median seconds of the last sends there (what a round's transfer takes)
    send_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    # each change of the level it broadcasts at (choco, def): {round, level: label}
    peer_levels: tuple[dict[str, Any], ...] = ()

    @property
    def bytes_sent_total(self) -> int:
        return sum(self.bytes_sent.values())


class GossipStalled(RuntimeError):
    """A peer's exchanges failed with every neighbour in `max_failed_rounds` rounds in a row:
    it has been training alone, which is not what a gossip run was asked to do."""


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
        peer waits for its neighbours; None: this peer never waits for a turn."""
        if not 0 <= rank < topology.n:
            raise ValueError(
                f"rank {rank} out of range for topology {topology.name} (n={topology.n})"
            )
        if transport.rank != rank:
            raise ValueError(f"transport is for rank {transport.rank}, peer is rank {rank}")
        _check_round_timeout(round_timeout)
        self.model = model
        self.topology = topology
        self.rank = rank
        self.algorithm = algorithm
        self.transport = transport
        self.round_timeout = round_timeout
        if max_move is not None and not (math.isfinite(max_move) and max_move > 0):
            raise ValueError(f"max_move: expected a number > 0 or None, got {max_move}")
        self.max_move = max_move
        self.round = 0
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps: expected an integer >= 1, got {quoted(local_steps)}")
        self.local_steps = local_steps
        self._steps_taken = 0
        self.gossip_buffers = gossip_buffers
        self.constant_buffers = constant_buffers
        self._params: NamedParams = gossiped_tensors(model, gossip_buffers, constant_buffers)
        # (name, buffer, its value now): each checked unchanged every round
        self._constants = [
            (name, b, b.detach().clone())
            for name, b in constant_tensors(model, gossip_buffers, constant_buffers)
        ]
        if (
            isinstance(max_failed_rounds, bool)
            or not isinstance(max_failed_rounds, int)
            or max_failed_rounds < 0
        ):
            raise ValueError(
                f"max_failed_rounds: expected an integer >= 0 (0: never stop), got "
                f"{quoted(max_failed_rounds)}"
            )
        self.max_failed_rounds = max_failed_rounds
        self.turns = turns
        self.failed_rounds = 0  # rounds that tried an exchange since one last heard a neighbour
        self._first_failed_round = 0  # the first of them
        self._failure_reasons: dict[int, str] = {}  # neighbour -> why its last exchange failed
        self._weights = topology.neighbor_weights(rank)
        self._links = LinkStats()
        self._compute_seconds = 0.0
        self._comm_seconds = 0.0
        self._last_mark: float | None = None
        self._in_step_since: float | None = None  # start of the last round heard by a neighbour
        self.alone = False  # the last round reached no neighbour
        neighbours = topology.neighbors(rank)
        self._edges = sorted((min(a, b), max(a, b)) for a, b in topology.graph.edges)
        self.schedules = ScheduleBook([name for name, _ in self._params], self._edges)
        self.links = LinkMonitor(
            rank,
            neighbours,
            backoff,
            on_resume=transport.inbox.allow_round,
            pace=pace,
            newest_epoch=lambda: self.schedules.newest.epoch,
            on_newer_epoch=self._want_schedules,
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
        self._specs = specs  # per phase, under the schedule with no groups (epoch 0)
        for phase, spec in specs.items():
            transport.inbox.expect(phase, spec)
        # start() done: a handshake may no longer take down an edge whose exchanges succeed
        self._started = False
        self._ready = threading.Event()
        if ready:
            self._ready.set()
        transport.set_hello_handler(self._answer_hello)
        # neighbours whose newer schedules this peer wants, and the fetches under way
        self._schedule_lock = threading.Lock()
        self._wanted: set[int] = set()
        self._fetches: dict[int, Future[list[cpb.Schedule]]] = {}
        self._replies = ScheduleReplies()  # what neighbours are sent, serialised once
        self._replies.refresh(self._held_schedules())
        if isinstance(transport, SharesSchedules):
            transport.set_schedule_source(self._schedules_newer_than)

    def ready(self) -> None:
        """Start answering neighbours' handshakes (see `ready` in the constructor)."""
        self._ready.set()

    def _answer_hello(
        self, sender: int, their_round: int, proposed: int, alone: bool, epoch: int
    ) -> HelloAnswer:
        if not self._ready.is_set():
            raise PeerNotReady(f"peer {self.rank} is restoring its checkpoint")
        newest = self.schedules.newest.epoch
        if epoch > newest:  # the edge resumes once this peer has that schedule too
            self._want_schedules(sender)  # asked at its own address: a forged claim costs that
            raise PeerNotReady(
                f"peer {self.rank} has schedules up to epoch {newest}, not yet epoch {epoch}"
            )
        if self._started and self.links.would_park(sender, their_round, proposed, self.round):
            if not alone:  # its round would be followed: wait for the edge itself to fail
                raise PeerNotReady(
                    f"peer {self.rank}: its edge to peer {sender} is up and exchanging; a "
                    "rejoin is agreed once an exchange on it fails"
                )
            answer = self.links.offer_resume(sender, self.round)  # taken up if it fails
            return dataclasses.replace(answer, schedule_epoch=newest)
        answer = self.links.answer_hello(sender, their_round, proposed, alone, self.round)
        return dataclasses.replace(answer, schedule_epoch=newest)

    def _want_schedules(self, neighbour: int) -> None:
        """`neighbour` holds a newer schedule epoch (its handshake said so): fetch its schedules
        at the start of the next round (any thread may call this)."""
        with self._schedule_lock:
            self._wanted.add(neighbour)

    def _schedules_newer_than(self, neighbour: int, epoch: int) -> bytes:
        """What a neighbour that holds up to `epoch` is sent when it asks (server thread): the
        serialised ScheduleList kept since the schedule book last changed."""
        return self._replies.newer_than(epoch, MAX_SHARED_SCHEDULES)

    def _held_schedules(self) -> tuple[Schedule, ...]:
        return (self.schedules.current, *self.schedules.staged)

    def _fetch_schedules(self) -> None:
        """Stage what finished fetches brought (as `adopt` does), then ask the neighbours
        wanted since, one question to each at a time."""
        with self._schedule_lock:
            done = {j: f for j, f in self._fetches.items() if f.done()}
            for j in done:
                del self._fetches[j]
            asked = self._wanted - set(self._fetches)
            self._wanted -= asked
        for j, fetched in sorted(done.items()):
            if fetched.exception() is not None:
                log.warning(
                    "peer %d: neighbour %d did not send its schedules (%s)",
                    self.rank,
                    j,
                    fetched.exception(),
                )
                continue
            for message in fetched.result():
                try:
                    self.adopt(schedule_from_proto(message))
                except ValueError as refused:  # ScheduleRefused, or a malformed group
                    log.error(
                        "peer %d: refused neighbour %d's schedule: %s",
                        self.rank,
                        j,
                        quoted(str(refused), 300),
                    )
        if not isinstance(self.transport, SharesSchedules):
            return
        for j in sorted(asked):
            future = self.transport.fetch_schedules(j)
            with self._schedule_lock:
                self._fetches[j] = future

    def adopt(self, schedule: Schedule) -> bool:
        """Stage a schedule a neighbour holds, checked as `apply` checks a coordinator's; one
        whose round this peer has passed takes effect at its next round (the edges it left
        resume once both ends are in it). False when this peer already has its epoch."""
        if schedule.epoch <= self.schedules.newest.epoch:
            return False
        specs = self._schedule_specs(schedule)
        staged = self.schedules.stage(schedule, self.round, late=True)
        self._expect_epoch(staged.epoch, specs)
        self._replies.refresh(self._held_schedules())
        self._levels.expect()
        log.warning(
            "peer %d: schedule epoch %d from a neighbour, in force from round %d",
            self.rank,
            staged.epoch,
            staged.effective_round,
        )
        return True

    def adapt_levels(self, round_budget: float | None = None) -> None:
        """Set levels with the neighbours, without a coordinator. A link-leveled algorithm
        (PowerGossip, levels/edges.py): for each edge to a higher-ranked neighbour, this
        peer's rate controller picks the level from its own sends over it and announces it in
        its envelopes; lower-ranked neighbours' notices set the other edges. A broadcasting
        one (Choco, DEF-ATC, levels/senders.py): this peer picks the level it sends at
        from its sends over all its links and announces it; each neighbour's notices set the
        level that neighbour is decoded at. `round_budget`: seconds a round's transfers over
        one link may take (None: this peer's median compute time per round). Call before
        `start()` and before restoring a checkpoint; every peer of the network must (a peer
        that does not refuses notices). From then on schedules with link levels are refused:
        levels come from a coordinator or from the peers, never both."""
        self._specs.update(self._levels.adapt(round_budget))

    def apply(self, schedule: Schedule) -> None:
        """Stage `schedule` to take effect at its effective round (every peer switches then).

        Raises ScheduleRefused, keeping the current schedule, when it does not cover every
        parameter exactly once, names an unknown parameter or compressor, does not go forward
        in epoch, or takes effect at or before this peer's round. Envelopes laid out by it are
        accepted from now on (a neighbour may switch first); this peer uses it from its round.
        Call it from the thread that calls `gossip()`.
        """
        specs = self._schedule_specs(schedule)
        self.schedules.stage(schedule, self.round)
        self._expect_epoch(schedule.epoch, specs)
        self._levels.expect()  # waiting level notices hold under it too
        self._replies.refresh(self._held_schedules())

    @property
    def _edge_levels(self) -> EdgeLevels | None:
        """The link levels set with the neighbours (None: fixed or a coordinator's)."""
        return self._levels.edges

    @property
    def _sender_levels(self) -> SenderLevels | None:
        """A broadcasting algorithm's levels set by the senders (None: fixed or a
        coordinator's)."""
        return self._levels.senders

    def _schedule_specs(
        self, schedule: Schedule, book: LevelBook | None = None
    ) -> dict[str, PayloadSpec]:
        """Per phase, what neighbours' envelopes hold under `schedule` (with the levels in
        force in `book`, default this peer's, when peers set them); ScheduleRefused when it
        does not fit this peer's model or algorithm."""
        schedule.check([name for name, _ in self._params])
        schedule.check_links(self._edges)
        specs = dict(self._specs)
        leveled = self._levels.schedule_specs(schedule, book)
        if leveled is not None:
            specs.update(leveled)
        elif isinstance(self.algorithm, Regroupable):
            try:
                specs.update(self.algorithm.specs(self._params, schedule.groups or None))
            except ValueError as error:
                raise ScheduleRefused(f"schedule epoch {schedule.epoch}: {error}") from None
        elif schedule.groups:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: algorithm {self.algorithm.name!r} sends no "
                "compressed groups; expected a schedule without groups"
            )
        specs.update(self._levels.local_specs(schedule, book))
        return specs

    def _expect_epoch(self, epoch: int, specs: dict[str, PayloadSpec]) -> None:
        for phase, spec in specs.items():
            self.transport.inbox.expect(phase, spec, epoch)
        self.transport.schedule_epoch = max(self.transport.schedule_epoch, epoch)

    def _switch_schedule(self) -> None:
        """Put in force the schedule that takes effect at this round, if any. Envelopes of the
        epoch before stay accepted, so a neighbour still in it is seen (and counted in
        `mismatched_epoch_exchanges`) rather than refused at the door."""
        previous = self.schedules.current.epoch
        schedule = self.schedules.due(self.round)
        if schedule is None:
            return
        if isinstance(self.algorithm, Regroupable):
            self.algorithm.regroup(self._params, schedule.groups or None)
        self._levels.switch_schedule(self.schedules.history[-2], schedule, self.round)
        self.transport.inbox.forget_epochs_before(previous)
        self._replies.refresh(self._held_schedules())
        log.info(
            "peer %d: schedule epoch %d (%s, %d groups) in force from round %d",
            self.rank,
            schedule.epoch,
            schedule.planner,
            len(schedule.groups) or len(self._params),
            self.round,
        )

    @classmethod
    def over_grpc(
        cls,
        model: torch.nn.Module,
        topology: Topology,
        rank: int,
        algorithm: GossipAlgorithm,
        *,
        bind: str | None = None,
        options: GrpcOptions | None = None,
        round_timeout: float = 30.0,
        backoff: Backoff | None = None,
        ready: bool = True,
        gossip_buffers: bool = True,
        local_steps: int = 1,
        link_rates: LinkRates | None = None,
        constant_buffers: bool = True,
        max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS,
        turns: ComputeTurns | None = None,
    ) -> Peer:
        """A peer with its own gRPC server at `bind` (default: its address in the topology).
        A stream that carries an envelope must finish within the round's deadline. With
        `link_rates`, its links are throttled to those rates (transport/throttled.py)."""
        _check_round_timeout(round_timeout)
        signature = model_signature(model, gossip_buffers, constant_buffers)
        identity = Identity(rank, topology.hash, signature)
        options = dataclasses.replace(options or GrpcOptions(), stream_timeout=round_timeout)
        grpc_transport = GrpcTransport(
            identity,
            topology.neighbors(rank),
            bind=bind or topology.addresses[rank],
            options=options,
        )
        transport: Transport = (
            grpc_transport if link_rates is None else ThrottledTransport(grpc_transport, link_rates)
        )
        try:
            return cls(
                model,
                topology,
                rank,
                algorithm,
                transport,
                round_timeout=round_timeout,
                backoff=backoff,
                ready=ready,
                gossip_buffers=gossip_buffers,
                local_steps=local_steps,
                constant_buffers=constant_buffers,
                max_failed_rounds=max_failed_rounds,
                turns=turns,
            )
        except Exception:
            transport.close()
            raise

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
        self._check_gossiped_finite()
        self._check_constants("at start")
        book = addresses or dict(enumerate(self.topology.addresses))
        restored = self.round > 0  # its round is stale: adopt the neighbours'
        proposals = {j: self.round + RESUME_MARGIN for j in self.links.not_up()}
        answers = self.transport.connect(
            {j: book[j] for j in self.topology.neighbors(self.rank)},
            timeout,
            Greeting(self.round, proposals, alone=restored),
        )
        for j, answer in answers.items():
            if answer.schedule_epoch > self.schedules.newest.epoch:
                self._want_schedules(j)
                self.links.mark_down(
                    j, self.round, f"runs schedule epoch {answer.schedule_epoch}, not yet here"
                )
            elif answer.resume_round > 0:
                self.links.resume(j, answer, self.round, alone=restored)
        self._catch_up()  # at once: the neighbours reach the resume round within a few rounds
        self._last_mark = time.perf_counter()
        self._started = True

    def _check_gossiped_finite(self) -> None:
        """Refuse to start with a gossiped tensor holding NaN/Inf, naming it and the remedy."""
        buffers = {name for name, _ in self.model.named_buffers()}
        for name, tensor in self._params:
            if all_finite(tensor.detach()):
                continue
            if name in buffers:
                raise ValueError(
                    f"peer {self.rank}: buffer {name!r} holds NaN/Inf, and every neighbour "
                    "refuses non-finite values, so this peer would train alone; expected finite "
                    "gossiped buffers: make it non-persistent (register_buffer(..., "
                    "persistent=False)) if it is no part of the model's state, or leave buffers "
                    "out of gossip (Peer(gossip_buffers=False), --no-gossip-buffers)"
                )
            raise ValueError(
                f"peer {self.rank}: parameter {name!r} holds NaN/Inf, and every neighbour "
                "refuses non-finite values; expected a finite model (look at its "
                "initialisation, or the checkpoint it was restored from)"
            )

    def _check_constants(self, when: str) -> None:
        """Raise ValueError naming a constant buffer (not gossiped: see the constructor) whose
        value is no longer what it was when the peer was made."""
        for name, buffer, value in self._constants:
            if not torch.equal(buffer.detach(), value):
                raise ValueError(
                    f"peer {self.rank}: buffer {name!r} changed {when}, but it was taken as "
                    "constant (it is not a normalisation layer's running statistic), so it is "
                    "not gossiped and peers would disagree on it; expected it unchanged, or "
                    "Peer(constant_buffers=False) to gossip every floating-point buffer every "
                    "round"
                )

    def _catch_up(self) -> None:
        """Move to a resuming neighbour's round when rounds disagree (see links.py): forward
        when behind; back as well when this peer has no live edge (its round is its own). The
        new round is opened at once so that neighbour's envelopes are let in."""
        target = self.links.catch_up_round(self.round)
        if target is None:
            return
        log.warning(
            "peer %d: %s its neighbours; moves from round %d to %d",
            self.rank,
            "behind" if target > self.round else "alone and ahead of",
            self.round,
            target,
        )
        before, self.round = self.round, target
        if target < before:
            self.transport.inbox.rewind_round(target)
        else:
            self.transport.inbox.open_round(target)
        for j in self.links.live():  # now out of step: fail at once rather than wait a deadline
            self.links.failed(j, before, f"this peer moved to round {target}")

    def _report_isolation(self, hood: Neighbourhood, failed: set[int]) -> None:
        """Say so when a round reached no neighbour at all (the peer trains alone), and when
        neighbours are back. `failed`: neighbours whose exchange failed this round."""
        alone = not set(hood.weights) - failed
        if alone and not self.alone:
            lost = sorted(set(self._weights) - (set(hood.weights) - failed))
            log.warning(
                "peer %d: no neighbour reachable in round %d (%s); training alone",
                self.rank,
                self.round,
                ", ".join(str(j) for j in lost),
            )
        elif self.alone and not alone:
            log.warning("peer %d: neighbours reachable again in round %d", self.rank, self.round)
        self.alone = alone

    def _count_failed_round(self, heard: bool, tried: bool) -> None:
        """Count the failed rounds since a neighbour was last heard: rounds that tried an
        exchange (gossip or resume) and heard no one. A round with every edge down or waiting
        for its agreed resume round tries none: the links are recovering (a partition, a
        neighbour restarting, probes under way), which is not counted, nor does it clear the
        count. `_stop_if_stalled` ends the run after `max_failed_rounds`; a warning comes after
        FAILED_ROUNDS_WARNING."""
        if heard:
            self.failed_rounds = 0
            return
        if not (tried and self._weights):
            return
        self.failed_rounds += 1
        if self.failed_rounds == 1:
            self._first_failed_round = self.round
        if self.failed_rounds == FAILED_ROUNDS_WARNING:
            log.warning(
                "peer %d: its exchanges failed with every neighbour in %d rounds in a row (rounds "
                "%d to %d, none heard in between), so it trains alone; %s; %s",
                self.rank,
                self.failed_rounds,
                self._first_failed_round,
                self.round,
                self._failure_summary(),
                f"it stops after {self.max_failed_rounds} (max_failed_rounds, "
                "--max-failed-rounds; 0: never)"
                if self.max_failed_rounds
                else "max_failed_rounds is 0: it goes on alone",
            )

    def _stop_if_stalled(self) -> None:
        """Raise GossipStalled once `max_failed_rounds` failed rounds came in a row."""
        if self.max_failed_rounds and self.failed_rounds >= self.max_failed_rounds:
            raise GossipStalled(
                f"peer {self.rank}: its exchanges failed with every neighbour in "
                f"{self.failed_rounds} rounds in a row (rounds {self._first_failed_round} to "
                f"{self.round - 1}, none heard in between), so it was training alone; "
                f"{self._failure_summary()}; stopped (max_failed_rounds "
                f"{self.max_failed_rounds}, --max-failed-rounds; 0: never stop)"
            )

    def _failure_summary(self) -> str:
        """The last failure of each neighbour, each reason cut short (it may quote a
        neighbour's words)."""
        if not self._failure_reasons:
            return "no neighbour answered"
        return "last failures: " + "; ".join(
            f"neighbour {j}: {quoted(reason, 160)}"
            for j, reason in sorted(self._failure_reasons.items())
        )

    def _neighbourhood(self, links: LinkStats, live: list[int] | None = None) -> Neighbourhood:
        """This peer's view of the network for the current round: the live neighbours (all by
        default) with their weights; the weight of any neighbour left out stays with the peer,
        so the live mixing matrix is symmetric and doubly stochastic when both ends agree."""
        weights = self._weights if live is None else {j: self._weights[j] for j in live}
        return Neighbourhood(
            rank=self.rank,
            round=self.round,
            weights=weights,
            self_weight=1.0 - sum(weights.values()),
            transport=self.transport,
            timeout=self.round_timeout,
            links=links,
            schedule_epoch=self.schedules.current.epoch,
            turns=self.turns,
        )

    def _resume_edges(self) -> bool:
        """Resynchronise the edges that resume this round (both ends agreed on it), so that the
        algorithm's per-edge state (public copies, references, power vectors) matches at both
        ends before the edge carries gossip again. Returns whether any edge tried."""
        due = self.links.resuming_at(self.round)
        if not due:
            return False
        self._levels.before_resume(due, self.round)
        resumable = isinstance(self.algorithm, Resumable)
        payload = self.algorithm.resume_payload(self._params) if resumable else None
        # always exchanged, empty when there is nothing to resynchronise: an edge is back only
        # when both ends reached the resume round
        result = self._exchange(RESUME_PHASE, due, payload or ())
        unsynced = self._levels.after_resume(result, self.round, self._exchange)
        for j in due:
            if j in result.received and j not in result.failed and j not in unsynced:
                if resumable:
                    envelope = result.received[j] if payload is not None else None
                    self.algorithm.resume_edge(j, envelope, self.round)
                # if a handshake moved the resume round meanwhile, the edge stays resuming and
                # is resynchronised again then
                self.links.up(j, self.round)
            else:
                reason = result.failed.get(j) or unsynced.get(j, "no resume payload")
                self.links.resume_failed(j, self.round, reason)
                self._failure_reasons[j] = reason
        return True

    def _exchange(self, phase: str, live: list[int], payload: Payload = ()) -> ExchangeResult:
        """One exchange of this round with the neighbours `live`, its time counted."""
        hood = self._neighbourhood(self._links, live)
        result = hood.exchange(phase, payload)
        self._comm_seconds += hood.comm_seconds
        return result

    def after_local_step(self) -> bool:
        """Count one local optimizer step; gossip when `local_steps` of them have been taken
        since the last round. Returns whether this call gossiped."""
        self._steps_taken += 1
        if self._steps_taken % self.local_steps:
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
        self._check_constants(f"before round {self.round}")
        self._fetch_schedules()
        self.links.poll_probes(self.round, self.transport.probe)
        self._catch_up()
        self._switch_schedule()
        self._levels.switch_due(self.round)
        resumed = self._resume_edges()
        self._levels.decide(self.round, self._links.sends)
        hood = self._neighbourhood(self._links, self.links.live())
        before = [p.detach().clone() for _, p in self._params]
        self.algorithm.step(self._params, hood)
        for j, reason in hood.failed.items():
            self.links.failed(j, self.round, reason)
            self._failure_reasons[j] = reason
        self._levels.hear(hood, self.round)
        heard = [j for j in hood.weights if j not in hood.failed]
        if heard and not self._acceptable(before):
            self._refuse_round(before, self._to_blame(hood, heard, before))
            heard = []
        self.links.in_step(heard, self.round)
        self._in_step_since = now if heard else None
        self._report_isolation(hood, set(hood.failed) | set(hood.weights).difference(heard))
        self._count_failed_round(bool(heard), resumed or bool(hood.weights))
        self.round += 1
        self._comm_seconds += hood.comm_seconds
        self._last_mark = time.perf_counter()
        self._stop_if_stalled()

    def _acceptable(self, before: list[torch.Tensor]) -> bool:
        """Whether the model after this round's gossip is finite and moved no more than
        `max_move` allows from `before`."""
        with torch.no_grad():
            moved = total_norm(p - b for (_, p), b in zip(self._params, before, strict=True))
            if not math.isfinite(moved):
                return False
            return self.max_move is None or moved <= self.max_move * (total_norm(before) + 1.0)

    def _to_blame(
        self, hood: Neighbourhood, heard: list[int], before: list[torch.Tensor]
    ) -> list[int]:
        """The neighbours of a refused round that sent a raw value beyond what `max_move`
        allows; all those heard when none did (the lie was in a compressed payload)."""
        limit = (self.max_move or MAX_GOSSIP_MOVE) * (total_norm(before) + 1.0)
        blamed = [j for j in heard if hood.largest_raw_value(j) > limit]
        return blamed or heard

    def _refuse_round(self, before: list[torch.Tensor], heard: list[int]) -> None:
        """Undo a gossip round that would break the model and take the blamed edges down."""
        with torch.no_grad():
            for (_, p), saved in zip(self._params, before, strict=True):
                p.copy_(saved)
        reason = "what it sent would make this peer's model NaN/Inf or move it absurdly far"
        log.warning(
            "peer %d: round %d would make the model NaN/Inf or move it more than %s x "
            "(its norm + 1); refused, model kept, neighbours %s taken down to resynchronise",
            self.rank,
            self.round,
            self.max_move,
            ", ".join(str(j) for j in heard),
        )
        for j in heard:
            self.links.failed(j, self.round, reason)
            self._failure_reasons[j] = reason

    def averaging_rounds(self, tolerance: float = 1e-6) -> int:
        """Exact-gossip rounds that shrink disagreement by `tolerance` on this topology."""
        slem = self.topology.second_largest_eigenvalue_modulus
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
            self._averager.step(copies, self._neighbourhood(LinkStats(), self.links.live()))
            self.round += 1
        return [p for _, p in copies]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of this peer: round, model, algorithm state and counters."""
        state: dict[str, Any] = {
            "round": self.round,
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "algorithm": self.algorithm.state_dict(),
            "bytes_sent": dict(self._links.bytes_sent),
            "bytes_received": dict(self._links.bytes_received),
            "failures": dict(self._links.failures),
            "down": self.links.not_up(),
            "saved_at": time.time(),  # with the pace: how far neighbours can be when restored
            "seconds_per_round": self.links.pace.seconds_per_round(),
            "schedules": self.schedules.state_dict(),
        }
        state.update(self._levels.state_dict())  # levels set with the neighbours shape it
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint before `start()`: every part is checked against this peer's
        model and algorithm first, so a mismatch raises ValueError and changes nothing."""
        expected = {
            "round",
            "model",
            "algorithm",
            "bytes_sent",
            "bytes_received",
            "failures",
            "down",
        }
        # absent from older ones; link_levels or broadcast_levels only when peers set levels
        optional = {"saved_at", "seconds_per_round", "schedules", "link_levels", "broadcast_levels"}
        if not isinstance(state, dict) or not expected <= set(state) <= expected | optional:
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"peer checkpoint: expected keys {sorted(expected)} (and optionally "
                f"{sorted(optional)}), got {quoted(keys)}"
            )
        round = state["round"]
        if isinstance(round, bool) or not isinstance(round, int) or not 0 <= round < MAX_WIRE_ROUND:
            raise ValueError(
                f"peer checkpoint: round must be an integer in [0, 2^53), got {quoted(round)}"
            )
        saved_at = _positive_seconds(state.get("saved_at"), "saved_at")
        seconds_per_round = _positive_seconds(
            state.get("seconds_per_round"),
            "seconds_per_round",
            MIN_ROUND_SECONDS,
            MAX_ROUND_TIMEOUT,
        )
        current = self.model.state_dict()
        saved = state["model"]
        if set(saved) != set(current):
            raise ValueError(
                f"peer checkpoint: model has parameters {sorted(saved)}, "
                f"this model has {sorted(current)}"
            )
        checked_tensors(
            "peer checkpoint model", list(current.values()), [saved[k] for k in current]
        )
        neighbours = set(self._weights)
        counters = {}
        for key in ("bytes_sent", "bytes_received", "failures"):
            counters[key] = _neighbour_counts(state[key], neighbours, key)
        down = state["down"]
        if not isinstance(down, list) or not set(down) <= neighbours:
            raise ValueError(
                f"peer checkpoint: down must list neighbours of {sorted(neighbours)}, got {quoted(down)}"
            )
        schedules = ScheduleBook([name for name, _ in self._params], self._edges)
        if "schedules" in state:
            schedules.load_state_dict(state["schedules"], round)  # bounds as staging does
        levels = self._levels.checked(state.get("link_levels"), state.get("broadcast_levels"))
        in_use = (schedules.current, *schedules.staged)
        specs = {s.epoch: self._schedule_specs(s, levels.book) for s in in_use}  # checks they fit
        self._levels.load_algorithm(state["algorithm"], schedules.current, levels)
        # everything below was checked above: nothing can fail half-way
        if isinstance(self.algorithm, Regroupable):
            self.algorithm.regroup(self._params, schedules.current.groups or None)
        self.schedules = schedules
        for epoch, epoch_specs in specs.items():
            self._expect_epoch(epoch, epoch_specs)
        self._levels.restore(levels, schedules.current)
        self.transport.inbox.forget_epochs_before(schedules.current.epoch)
        self._replies.refresh(self._held_schedules())
        self.model.load_state_dict(saved)
        self.round = round
        self._links.bytes_sent = counters["bytes_sent"]
        self._links.bytes_received = counters["bytes_received"]
        self._links.failures = counters["failures"]
        for j in down:  # probed and resynchronised after the restart, like any lost edge
            self.links.mark_down(j, round, "down when the checkpoint was written")
        # the checkpoint's round is the last one this peer can have been in step at
        self.links.restored(round, 0.0 if saved_at is None else time.time() - saved_at)
        if seconds_per_round is not None:
            self.links.pace.assume(seconds_per_round)

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
            local_steps=self._steps_taken,
            link_levels=tuple(self._levels.link_changes),
            peer_levels=tuple(self._levels.own_changes),
            send_seconds={
                j: statistics.median(s for _, s in self._links.sends.samples(j))
                for j in self._links.sends.links()
                if self._links.sends.samples(j)
            },
        )

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _neighbour_counts(value: Any, neighbours: set[int], what: str) -> dict[int, int]:
    """A checkpointed per-neighbour counter, checked: neighbour ranks to integers >= 0."""
    if not isinstance(value, dict) or not all(
        j in neighbours and isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for j, n in value.items()
    ):
        raise ValueError(
            f"peer checkpoint: {what} must map neighbours of {sorted(neighbours)} to counts "
            f">= 0, got {quoted(value)}"
        )
    return dict(value)


def _check_round_timeout(seconds: float) -> None:
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_ROUND_TIMEOUT):
        raise ValueError(
            f"round_timeout: expected seconds in (0, {MAX_ROUND_TIMEOUT:g}], got {seconds}"
        )


def _positive_seconds(
    value: Any, what: str, low: float = 0.0, high: float = math.inf
) -> float | None:
    """An optional checkpointed time in seconds, checked: a finite number in (low, high], or
    None. The pace bounds how far neighbours are believed, so it may not be absurdly small."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and low < value <= high)
    ):
        raise ValueError(
            f"peer checkpoint: {what} must be a finite number in ({low:g}, {high:g}], "
            f"got {quoted(value)}"
        )
    return float(value)
