"""A peer's schedules: the ScheduleBook it holds, how it stages a coordinator's schedule
(`apply`) or a neighbour's (`adopt`, after fetching it from a neighbour whose handshake named a
newer epoch), what envelopes it accepts under each, and the switch at the agreed round. Every
schedule is checked against the peer's model and algorithm before anything of it is used."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from gossipcomp.gossip.base import GossipAlgorithm, NamedParams, Regroupable
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.peer import CompressionLevels, LevelBook
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.messages import ScheduleReplies, schedule_from_proto
from gossipcomp.schedule.schedule import Schedule, ScheduleBook, ScheduleRefused
from gossipcomp.transport.base import PayloadSpec
from gossipcomp.transport.protocol import Transport
from gossipcomp.transport.schedules import MAX_SHARED_SCHEDULES, SharesSchedules

log = logging.getLogger("gossipcomp.peer")  # its messages are the peer's


class PeerSchedules:
    """The schedules of peer `rank`: `book` holds them; `base_specs` is, per phase, what
    neighbours' envelopes hold under the schedule with no groups (epoch 0); `adapt_levels`
    adds to it."""

    def __init__(
        self,
        rank: int,
        transport: Transport,
        algorithm: GossipAlgorithm,
        params: NamedParams,
        edges: list[tuple[int, int]],
        levels: CompressionLevels,
        base_specs: dict[str, PayloadSpec],
        capacity: int | None = None,
        initial_members: tuple[int, ...] = (),
    ) -> None:
        """`capacity`: a live topology's (schedules may name members below it); None: fixed.
        `initial_members`: a live topology's, what a schedule naming none means."""
        self.rank = rank
        self.transport = transport
        self.algorithm = algorithm
        self.params = params
        self.edges = edges
        self.levels = levels
        self.base_specs = base_specs
        self.capacity = capacity
        self.initial_members = initial_members
        self.book = self.fresh_book()
        # neighbours whose newer schedules this peer wants, and the fetches under way
        self._lock = threading.Lock()
        self._wanted: set[int] = set()
        self._fetches: dict[int, Future[list[cpb.Schedule]]] = {}
        self._replies = ScheduleReplies()  # what neighbours are sent, serialised once
        self.refresh_replies()
        if isinstance(transport, SharesSchedules):
            transport.set_schedule_source(self.newer_than)

    def fresh_book(self) -> ScheduleBook:
        """An empty book for this peer's gossiped tensors and topology's edges."""
        return ScheduleBook([name for name, _ in self.params], self.edges, self.capacity)

    def want(self, neighbour: int) -> None:
        """`neighbour` holds a newer schedule epoch (its handshake said so): fetch its schedules
        at the start of the next round (any thread may call this)."""
        with self._lock:
            self._wanted.add(neighbour)

    def newer_than(self, neighbour: int, epoch: int) -> bytes:
        """What a neighbour that holds up to `epoch` is sent when it asks (server thread): the
        serialised ScheduleList kept since the schedule book last changed."""
        return self._replies.newer_than(epoch, MAX_SHARED_SCHEDULES)

    def held(self) -> tuple[Schedule, ...]:
        return (self.book.current, *self.book.staged)

    def refresh_replies(self) -> None:
        """Serialise again what neighbours are sent, after the book changed."""
        self._replies.refresh(self.held())

    def fetch(self, round: int) -> None:
        """Stage what finished fetches brought (as `adopt` does, at `round`), then ask the
        neighbours wanted since, one question to each at a time."""
        with self._lock:
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
                    self.adopt(schedule_from_proto(message), round)
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
            with self._lock:
                self._fetches[j] = future

    def adopt(self, schedule: Schedule, round: int) -> bool:
        """Stage a schedule a neighbour holds (see Peer.adopt); this peer is at `round`."""
        if schedule.epoch <= self.book.newest.epoch:
            return False
        held = self.book.newest.members or self.initial_members
        if (schedule.members or self.initial_members) != held:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch} from a neighbour changes the members; "
                "expected the members this peer holds: only the coordinator's own schedules "
                "change them (a neighbour cannot announce others' departures or arrivals)"
            )
        specs = self.specs(schedule)
        staged = self.book.stage(schedule, round, late=True, begun=self.begun(round))
        self.expect_epoch(staged.epoch, specs)
        self.refresh_replies()
        self.levels.expect()
        log.warning(
            "peer %d: schedule epoch %d from a neighbour, in force from round %d",
            self.rank,
            staged.epoch,
            staged.effective_round,
        )
        return True

    def apply(self, schedule: Schedule, round: int, late: bool = False) -> Schedule:
        """Stage a coordinator's schedule (see Peer.apply); this peer is at `round`. The
        schedule as staged (`late`: from the next round, where its own has passed)."""
        specs = self.specs(schedule)
        staged = self.book.stage(schedule, round, late=late, begun=self.begun(round))
        self.expect_epoch(schedule.epoch, specs)
        self.levels.expect()  # waiting level notices hold under it too
        self.refresh_replies()
        return staged

    def begun(self, round: int) -> int:
        """The furthest round this peer, at `round` between two of its rounds, has begun: the
        one before, unless its inbox opened `round` already (a start, or a round whose exchanges
        began and broke off). A schedule of a round not begun is on time: nothing was exchanged
        under the old one, and envelopes under the new one were refused only as not yet due
        (their senders push them again)."""
        return max(round - 1, self.transport.inbox.mailbox.reached)

    def specs(self, schedule: Schedule, book: LevelBook | None = None) -> dict[str, PayloadSpec]:
        """Per phase, what neighbours' envelopes hold under `schedule` (with the levels in
        force in `book`, default this peer's, when peers set them); ScheduleRefused when it
        does not fit this peer's model or algorithm."""
        schedule.check([name for name, _ in self.params])
        schedule.check_links(self.edges)
        schedule.check_members(self.capacity)
        specs = dict(self.base_specs)
        leveled = self.levels.schedule_specs(schedule, book)
        if leveled is not None:
            specs.update(leveled)
        elif isinstance(self.algorithm, Regroupable):
            try:
                specs.update(self.algorithm.specs(self.params, schedule.groups or None))
            except ValueError as error:
                raise ScheduleRefused(f"schedule epoch {schedule.epoch}: {error}") from None
        elif schedule.groups:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: algorithm {self.algorithm.name!r} sends no "
                "compressed groups; expected a schedule without groups"
            )
        specs.update(self.levels.local_specs(schedule, book))
        return specs

    def expect_epoch(self, epoch: int, specs: dict[str, PayloadSpec]) -> None:
        for phase, spec in specs.items():
            self.transport.inbox.expect(phase, spec, epoch)
        self.transport.schedule_epoch = max(self.transport.schedule_epoch, epoch)

    def checked_book(self, state: dict[str, Any], round: int) -> ScheduleBook:
        """The schedule book of a peer checkpoint `state` at `round`, checked (bounds as
        staging does); an empty one when it has none."""
        book = self.fresh_book()
        if "schedules" in state:
            book.load_state_dict(state["schedules"], round)
        return book

    def specs_in_use(
        self, book: ScheduleBook, levels: LevelBook | None
    ) -> dict[int, dict[str, PayloadSpec]]:
        """Per epoch in use in `book`, what envelopes hold (`specs`): ScheduleRefused when
        one does not fit this peer."""
        return {s.epoch: self.specs(s, levels) for s in (book.current, *book.staged)}

    def restore(self, book: ScheduleBook, specs: dict[int, dict[str, PayloadSpec]]) -> None:
        """Hold a checkpoint's checked `book`, accepting the envelopes of each epoch in
        `specs` (what `specs` gave for its schedules in use)."""
        self.book = book
        for epoch, epoch_specs in specs.items():
            self.expect_epoch(epoch, epoch_specs)

    def switch(self, round: int) -> None:
        """Put in force the schedule that takes effect at `round`, if any. Envelopes of the
        epoch before stay accepted, so a neighbour still in it is seen (and counted in
        `mismatched_epoch_exchanges`) rather than refused at the door."""
        previous = self.book.current.epoch
        schedule = self.book.due(round)
        if schedule is None:
            return
        if isinstance(self.algorithm, Regroupable):
            self.algorithm.regroup(self.params, schedule.groups or None)
        self.levels.switch_schedule(self.book.history[-2], schedule, round)
        self.transport.inbox.forget_epochs_before(previous)
        self.refresh_replies()
        log.info(
            "peer %d: schedule epoch %d (%s, %d groups) in force from round %d",
            self.rank,
            schedule.epoch,
            schedule.planner,
            len(schedule.groups) or len(self.params),
            round,
        )
