"""A peer's compression levels: where they come from, when they switch, what is logged.

Levels come from one source, never both:
- a coordinator's schedules: a level per link for a LinkLeveled algorithm (PowerGossip: the
  rank; choco-edge: a rung of its compressor's ladder), switched at the schedule's round; for a PeerLeveled one (Choco, DEF-ATC) each peer
  broadcasts at its slowest link's level, which every neighbour computes from the schedule's
  link table (`peer_levels` in levels/rate.py);
- the peers themselves (`Peer.adapt_levels`): the lower-ranked end of each edge decides that
  link's level (levels/edges.py), a broadcasting peer the level it sends at
  (levels/senders.py); a decision travels as a notice in envelope headers and both ends
  switch at its round. A resumed edge goes back to the algorithm's own level; a broadcasting
  peer states its level in its resume envelope and one more exchange (`LEVELS_PHASE`) carries
  the waiting notices.

`CompressionLevels` holds this for one Peer, which owns it and calls it at the few points of its
life and round (peer.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gossipcomp.gossip.base import (
    RESUME_PHASE,
    GossipAlgorithm,
    LinkLeveled,
    NamedParams,
    Neighbourhood,
    PeerLeveled,
)
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.levels.edges import EdgeLevels, LocalRateControl, NoticeConflict
from gossipcomp.levels.notices import MAX_NOTICE_LEAD
from gossipcomp.levels.rate import peer_levels
from gossipcomp.levels.senders import OwnLevelControl, SenderLevels
from gossipcomp.peer.links import LinkMonitor
from gossipcomp.schedule.costs import TransferLog
from gossipcomp.schedule.schedule import Schedule, ScheduleBook, ScheduleRefused
from gossipcomp.topology import Topology
from gossipcomp.transport.base import (
    ExchangeResult,
    LevelNotice,
    NoticeRules,
    PayloadSpec,
)
from gossipcomp.transport.protocol import Transport

LEVELS_PHASE = "levels"  # after a resume exchange: waiting level notices, and a barrier
LEVELS_LOGGER = "gossipcomp.levels"  # link level changes (the command line shows them)
log = logging.getLogger("gossipcomp.peer")  # its warnings are the peer's
levels_log = logging.getLogger(LEVELS_LOGGER)

# levels set with the neighbours: per link, or each sender's own
LevelBook = EdgeLevels | SenderLevels
# one exchange with some neighbours: (phase, neighbours) -> result, its time counted
Exchange = Callable[[str, list[int]], ExchangeResult]


@dataclass(frozen=True)
class SavedLevels:
    """The levels set with the neighbours that a checkpoint holds, checked, not yet in force
    (None: this peer does not set levels so)."""

    edges: EdgeLevels | None
    senders: SenderLevels | None

    @property
    def book(self) -> LevelBook | None:
        return self.edges or self.senders


class CompressionLevels:
    """The compression levels of one peer's links (of the peer and each neighbour, for a
    broadcasting algorithm) and everything that keeps both ends of an edge at the same one.

    The Peer calls it:
    - `adapt` once, before starting, when the peers set levels without a coordinator;
    - `schedule_specs` and `local_specs` whenever it checks a schedule, `expect` once it stages
      one, `switch_schedule` when one takes effect;
    - each round, `note_compute` (and `note_loss`, from the trainer, on the same thread), then
      `switch_due` at the top, `before_resume` and
      `after_resume` around the resume exchange, `decide` before the gossip, `hear` after it;
    - `state_dict`, `checked`, `load_algorithm` and `restore` for checkpoints.

    It sets the algorithm's levels (`set_levels`, `set_peer_levels`), declares to the transport
    what each neighbour's envelopes hold and which notices they carry, and takes down an edge
    whose notice contradicts a waiting one. `link_changes` and `own_changes` are the level
    changes PeerStats reports (`link_levels`, `peer_levels`)."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        weights: Mapping[int, float],
        algorithm: GossipAlgorithm,
        params: NamedParams,
        transport: Transport,
        links: LinkMonitor,
        schedules: Callable[[], ScheduleBook],
    ) -> None:
        """`weights`: the peer's neighbours and their mixing weights; `schedules`: the
        peer's schedules now (a restored checkpoint replaces them)."""
        self.rank = rank
        self.topology = topology
        self.algorithm = algorithm
        self.transport = transport
        self.links = links
        self._weights = weights
        self._params = params
        self._schedules = schedules
        # each change of one of its links' level: {round, link: [low, high], level: label}
        self.link_changes: list[dict[str, Any]] = []
        # each change of the level it broadcasts at: {round, level: label}
        self.own_changes: list[dict[str, Any]] = []
        # levels set with the neighbours, without a coordinator (`adapt`); None: fixed or a
        # coordinator's
        self.edges: EdgeLevels | None = None
        self._rate: LocalRateControl | None = None
        # a broadcasting algorithm's levels set by each sender (`adapt`); None: fixed or a
        # coordinator's
        self.senders: SenderLevels | None = None
        self._own_rate: OwnLevelControl | None = None
        self._loss_unheard = False  # said once: levels follow the loss, and none is noted

    @property
    def book(self) -> LevelBook | None:
        """The levels set with the neighbours (None: fixed or a coordinator's)."""
        return self.edges or self.senders

    def _in_use(self) -> tuple[Schedule, ...]:
        schedules = self._schedules()
        return (schedules.current, *schedules.staged)

    def adapt(self, round_budget: float | None, follow_loss: bool = True) -> dict[str, PayloadSpec]:
        """Set levels with the neighbours from now on (Peer.adapt_levels says how); returns
        the phases this adds to every schedule's, with what their envelopes hold."""
        if not isinstance(self.algorithm, LinkLeveled | PeerLeveled):
            raise ValueError(
                f"levels set by peers: algorithm {self.algorithm.name!r} has no level per link "
                "or per peer (powergossip, choco-edge, choco and def have)"
            )
        if any(s.links for s in self._in_use()):
            raise ValueError(
                "levels set by peers: this peer holds a schedule with link levels (a "
                "coordinator's); expected none"
            )
        costs = self.algorithm.level_costs(self._params)
        if isinstance(self.algorithm, PeerLeveled):
            self._own_rate = OwnLevelControl(costs, round_budget, follow_loss=follow_loss)
            default = self.algorithm.default_level()
            self.senders = SenderLevels(self.rank, self._weights, default)
            for schedule in self._in_use():
                self.transport.inbox.expect(LEVELS_PHASE, (), schedule.epoch)
            rules = NoticeRules(
                frozenset(costs.levels),
                MAX_NOTICE_LEAD,
                own_levels=True,  # a notice sets its sender's own level
                in_force_phase=RESUME_PHASE,  # a resume envelope's: the level in force then
            )
            self.transport.inbox.accept_notices(rules)
            return {LEVELS_PHASE: ()}
        self._rate = LocalRateControl(costs, round_budget, follow_loss=follow_loss)
        self.edges = EdgeLevels(self.rank, self._weights)
        self.transport.inbox.accept_notices(NoticeRules(frozenset(costs.levels), MAX_NOTICE_LEAD))
        return {}

    def schedule_specs(
        self, schedule: Schedule, book: LevelBook | None = None
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec] | None:
        """Per phase, what neighbours' envelopes hold under `schedule` at its levels (always
        for a broadcasting algorithm; for a link-leveled one unless the peers set the levels
        and it lists no links); None when levels play no part in it. ScheduleRefused for link
        levels while the peers set levels (in force in `book`, default this peer's), or
        levels that do not fit."""
        book = book or self.book
        if book is not None and schedule.links:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: link levels, but this peer sets its links' "
                "levels with its neighbours (adaptive without a coordinator); expected a "
                "schedule without links"
            )
        if isinstance(self.algorithm, PeerLeveled):
            try:
                return self.algorithm.peer_specs(
                    self._params, schedule.groups or None, self._peer_levels(schedule, book)
                )
            except ScheduleRefused:
                raise  # names its epoch already
            except ValueError as error:
                raise ScheduleRefused(f"schedule epoch {schedule.epoch}: {error}") from None
        if not isinstance(self.algorithm, LinkLeveled):
            if not schedule.links:
                return None
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: algorithm {self.algorithm.name!r} has no "
                "per-link level; expected a schedule without links"
            )
        if not schedule.links and book is not None:
            return None  # levels set with the neighbours: `local_specs`
        # a schedule without links puts every link back at the algorithm's own level when it
        # takes effect (`switch_schedule`), so its envelopes hold that level's, whatever the
        # schedule in force now sets
        try:
            return self.algorithm.link_specs(
                self._params, schedule.groups or None, schedule.levels_of(self.rank)
            )
        except ValueError as error:
            raise ScheduleRefused(f"schedule epoch {schedule.epoch}: {error}") from None

    def local_specs(
        self, schedule: Schedule, book: LevelBook | None = None
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, each neighbour's envelope under `schedule`'s groups at the link levels
        set with the neighbours (in force in `book`, default this peer's); none when links'
        levels are not set so. ScheduleRefused when they do not fit."""
        book = book or self.book
        if not isinstance(book, EdgeLevels):
            return {}
        try:
            return self._level_specs(schedule, book.in_force)
        except ValueError as error:
            raise ScheduleRefused(f"schedule epoch {schedule.epoch}: {error}") from None

    def _level_specs(
        self, schedule: Schedule, levels: Mapping[int, int]
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, each neighbour's envelope under `schedule`'s groups at `levels` (per
        link, or per peer for a broadcasting algorithm)."""
        if isinstance(self.algorithm, PeerLeveled):
            return self.algorithm.peer_specs(self._params, schedule.groups or None, levels)
        assert isinstance(self.algorithm, LinkLeveled)
        return self.algorithm.link_specs(self._params, schedule.groups or None, levels)

    def expect(self) -> None:
        """Declare, under every schedule in use, what each neighbour's envelopes hold at the
        level in force now and, from its round on, at the level a waiting notice sets (the
        transport picks by the envelope's round). Called whenever levels set with the
        neighbours change or a schedule is staged; nothing when levels are not set so."""
        book = self.book
        if book is None:
            return
        in_force, waiting = book.in_force, book.waiting()
        for schedule in self._in_use():
            for phase, spec in self._level_specs(schedule, in_force).items():
                self.transport.inbox.expect(phase, spec, schedule.epoch)
            for j in self._weights:
                later: dict[str, PayloadSpec] = {}
                if j in waiting:
                    changed = {**in_force, j: waiting[j].level}
                    for phase, spec in self._level_specs(schedule, changed).items():
                        later[phase] = spec[j] if isinstance(spec, Mapping) else spec
                round = waiting[j].effective_round if j in waiting else 0
                self.transport.inbox.expect_from(j, round, later, schedule.epoch)

    def switch_schedule(self, before: Schedule, after: Schedule, round: int) -> None:
        """Put in force the levels of `after`, the schedule that takes effect at `round`
        (`before`: the one it replaces); link levels set with the neighbours stay."""
        if isinstance(self.algorithm, LinkLeveled) and self.edges is None:
            self._switch_levels(before, after, round)
        if isinstance(self.algorithm, PeerLeveled):
            self._switch_peer_levels(before, after, round)

    def _switch_levels(self, before: Schedule, after: Schedule, round: int) -> None:
        """Put `after`'s link levels in force (the algorithm is LinkLeveled), logging each
        link whose level changes."""
        assert isinstance(self.algorithm, LinkLeveled)
        old, new = before.levels_of(self.rank), after.levels_of(self.rank)
        self.algorithm.set_levels(new, after.effective_round)  # the same round at both ends
        for j in sorted(set(old) | set(new)):
            if old.get(j) != new.get(j):
                self._link_changed(j, new.get(j), round)

    def _peer_levels(self, schedule: Schedule, book: LevelBook | None = None) -> dict[int, int]:
        """The level this peer and each neighbour broadcast at under `schedule` (the algorithm
        is PeerLeveled): each one's own in `book` (default this peer's) when the senders set
        them, otherwise each one's slowest link's; ScheduleRefused for a link level that is
        not on the algorithm's ladder, wherever it is (a schedule comes from the network)."""
        assert isinstance(self.algorithm, PeerLeveled)
        book = book or self.book
        if isinstance(book, SenderLevels):
            return book.in_force
        top = max(self.algorithm.level_costs(self._params).levels)
        for x in schedule.links:
            checked_integer(
                f"schedule epoch {schedule.epoch}: link {x.low}-{x.high} level (the ladder of "
                f"{self.algorithm.name})",
                x.level,
                1,
                top,
                ScheduleRefused,
            )
        table = {(x.low, x.high): x.level for x in schedule.links}
        around = {p: self.topology.neighbors(p) for p in (self.rank, *self._weights)}
        return peer_levels(table, around, self.algorithm.default_level())

    def _switch_peer_levels(self, before: Schedule, after: Schedule, round: int) -> None:
        """Put `after`'s levels in force (the algorithm is PeerLeveled), logging the change of
        this peer's own level and of each of its links' level."""
        assert isinstance(self.algorithm, PeerLeveled)
        old, new = self._peer_levels(before), self._peer_levels(after)
        self.algorithm.set_peer_levels(self._params, new, after.effective_round)
        if old[self.rank] != new[self.rank]:
            self._own_changed(new[self.rank], round)
        links_before, links_after = before.levels_of(self.rank), after.levels_of(self.rank)
        for j in sorted(set(links_before) | set(links_after)):
            if links_before.get(j) != links_after.get(j):
                self._link_changed(j, links_after.get(j), round, say=False)

    def _link_changed(self, j: int, level: int | None, round: int, say: bool = True) -> None:
        """Record that the link to `j` goes to `level` (None: the algorithm's own) at `round`,
        and with `say`, log it (one line per link: at its lower-ranked end)."""
        assert isinstance(self.algorithm, LinkLeveled | PeerLeveled)
        label = "default" if level is None else self.algorithm.level_label(level)
        edge = [min(self.rank, j), max(self.rank, j)]
        self.link_changes.append({"round": round, "link": edge, "level": label})
        if say and self.rank < j:  # one line per link
            levels_log.info("link %d-%d: %s from round %d", *edge, label, round)

    def _own_changed(self, level: int, round: int) -> None:
        """Record and log that this peer broadcasts at `level` from `round` on."""
        assert isinstance(self.algorithm, PeerLeveled)
        label = self.algorithm.level_label(level)
        self.own_changes.append({"round": round, "level": label})
        levels_log.info("peer %d: %s from round %d", self.rank, label, round)

    def note_compute(self, seconds: float) -> None:
        """Count `seconds` of computing for a round (the default round budget)."""
        for rate in (self._rate, self._own_rate):
            if rate is not None:
                rate.note_compute(seconds)

    def note_loss(self, initial: float, recent: float) -> None:
        """This peer's training loss, the untrained model's and the recent rounds' mean (the
        ceiling levels set by the peers follow; levels/progress.py)."""
        for rate in (self._rate, self._own_rate):
            if rate is not None:
                rate.note_loss(initial, recent)

    def _say_if_loss_unheard(self) -> None:
        """Warn once when levels should follow the training loss but none has been noted by
        the time decisions begin: the budget alone sets them then."""
        rate = self._own_rate.local if self._own_rate is not None else self._rate
        if rate is None or rate.allowance is None or rate.allowance.measured:
            return
        if self._own_rate is None and not any(j > self.rank for j in self._weights):
            return  # the higher end of every edge: it decides no level
        if self._loss_unheard or rate.budget() is None:
            return
        self._loss_unheard = True
        log.warning(
            "peer %d: levels not capped by the training loss: none noted (a loop of one's own "
            "calls Peer.note_training_loss after each round); the round budget alone sets them",
            self.rank,
        )

    def switch_due(self, round: int) -> None:
        """Put in force the levels set with the neighbours whose round has come."""
        if self.edges is not None:
            changes = self.edges.due(round)
            if changes:
                self._put_local_levels(changes, round)
        if self.senders is not None:
            changes = self.senders.due(round)
            if changes:
                self._put_sender_levels(changes, round)

    def _put_sender_levels(self, changed: Mapping[int, int], round: int) -> None:
        """Compress at the own level and decode each neighbour at its own from `round` on
        (`changed`: the peers whose level changes), logging a change of the own level."""
        assert isinstance(self.algorithm, PeerLeveled) and self.senders is not None
        self.algorithm.set_peer_levels(self._params, self.senders.in_force, round)
        if self.rank in changed:
            self._own_changed(changed[self.rank], round)
        self.expect()

    def _put_local_levels(self, changed: Mapping[int, int | None], round: int) -> None:
        """Use the levels set with the neighbours from `round` on (`changed`: the edges whose
        level changes, None for the algorithm's own), logging each change."""
        assert isinstance(self.algorithm, LinkLeveled) and self.edges is not None
        self.algorithm.set_levels(self.edges.in_force, round)
        for j, level in sorted(changed.items()):
            self._link_changed(j, level, round)
        self.expect()

    def before_resume(self, due: list[int], round: int) -> None:
        """Before the resume exchange of the edges `due` at `round`: their links go back to the
        algorithm's own level (both ends do); a broadcasting peer's resume envelopes state
        the level it sends at."""
        if self.edges is not None:  # both ends: back to the algorithm's own level
            reset = {j: None for j in due if self.edges.reset(j)}
            if reset:
                self._put_local_levels(reset, round)
        if self.senders is not None:  # the resume envelope states the own level
            for j in due:
                self.transport.inbox.announce(j, LevelNotice(self.senders.own, round))

    def after_resume(
        self, resumed: ExchangeResult, round: int, exchange: Exchange
    ) -> dict[int, str]:
        """For a broadcasting peer setting its level: take in the level each resuming
        neighbour states in its resume envelope (in force at this round), then exchange the
        waiting notices in one more, empty exchange (`exchange`), which also makes sure both
        ends hold each other's level before either sends this round's gossip
        (levels/senders.py). Returns the neighbours whose levels did not come through,
        with why: their edge does not resume (none when levels are not set so)."""
        book = self.senders
        if book is None:
            return {}
        failed: dict[int, str] = {}
        changed = False
        for j, envelope in resumed.received.items():
            if envelope.notice is None:
                failed[j] = "its resume envelope stated no level"
            elif j not in resumed.failed:
                changed |= book.resync(j, envelope.notice.level)
        if changed:
            self._put_sender_levels({}, round)
        synced = [j for j in resumed.received if j not in resumed.failed and j not in failed]
        for j in synced:
            self.transport.inbox.announce(j, book.own_notice)
        if not synced:
            return failed
        result = exchange(LEVELS_PHASE, synced)
        failed.update(result.failed)
        failed.update({j: "no level exchange" for j in synced if j not in result.received})
        heard = False
        for j, envelope in result.received.items():
            if envelope.notice is not None and j not in failed:
                try:
                    heard |= book.hear(j, envelope.notice, round)
                except NoticeConflict as error:
                    failed[j] = str(error)
        if heard:
            self.expect()
        return failed

    def decide(self, round: int, sends: TransferLog) -> None:
        """The lower-ranked end's decisions for its live edges (a broadcasting peer's: its own
        level) from the last `sends`, and the notices this round's envelopes carry (each
        repeats until its round)."""
        self._say_if_loss_unheard()
        if self._own_rate is not None and self.senders is not None:
            book = self.senders
            self._own_rate.decide(book, self.links.live(), sends, round)
            for j in self._weights:
                self.transport.inbox.announce(j, book.own_notice)
            return
        if self._rate is None or self.edges is None:
            return
        decided = self._rate.decide(self.edges, self.links.live(), sends, round)
        if decided:
            self.expect()
        for j in self._weights:
            self.transport.inbox.announce(j, self.edges.notice_for(j))

    def hear(self, hood: Neighbourhood, round: int) -> None:
        """Take in the notices lower-ranked neighbours (any neighbour, of its own level, for a
        broadcasting algorithm) sent this round (checked at receipt). One contradicting a
        notice of its own that still waits loses its edge, which comes back through a resume
        (at the algorithm's own level, or at the level the neighbour states then)."""
        book = self.book
        if book is None:
            return
        heard = False
        for j, envelopes in hood.received.items():
            if (isinstance(book, EdgeLevels) and j > self.rank) or j in hood.failed:
                continue
            for notice in {e.notice for e in envelopes if e.notice is not None}:
                try:
                    heard |= book.hear(j, notice, round)
                except NoticeConflict as error:
                    log.warning("peer %d: %s; edge taken down to resynchronise", self.rank, error)
                    self.links.failed(j, round, str(error))
                    break
        if heard:
            self.expect()

    def silence(self) -> None:
        """Carry no level notice from now on (no notice outlives training)."""
        for j in self._weights:
            self.transport.inbox.announce(j, None)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint rows of the levels set with the neighbours (they shape the
        algorithm's state): `link_levels` or `broadcast_levels`, none when not set so."""
        state: dict[str, Any] = {}
        if self.edges is not None:
            state["link_levels"] = self.edges.state_dict()
        if self.senders is not None:
            state["broadcast_levels"] = self.senders.state_dict()
        return state

    def checked(self, link_levels: Any, broadcast_levels: Any) -> SavedLevels:
        """A checkpoint's rows (None: absent), checked; ValueError when they do not fit this
        peer (its ladder is checked with the schedules' specs)."""
        return SavedLevels(
            self._saved_levels(link_levels), self._saved_sender_levels(broadcast_levels)
        )

    def _saved_levels(self, saved: Any) -> EdgeLevels | None:
        """The levels set with the neighbours that a checkpoint holds, checked (None when this
        peer does not set levels so); ValueError when they do not fit this peer."""
        if self.edges is None:
            if saved is not None:
                raise ValueError(
                    "peer checkpoint: link levels set with neighbours (adaptive without a "
                    "coordinator), but this peer does not set levels so; expected none"
                )
            return None
        edge_levels = EdgeLevels(self.rank, self._weights)
        if saved is not None:
            edge_levels.load_state_dict(saved)
        return edge_levels

    def _saved_sender_levels(self, saved: Any) -> SenderLevels | None:
        """The broadcast levels set by the senders that a checkpoint holds, checked (None when
        this peer does not set levels so); ValueError when they do not fit this peer."""
        if self.senders is None:
            if saved is not None:
                raise ValueError(
                    "peer checkpoint: broadcast levels set by the peers (adaptive without a "
                    "coordinator), but this peer does not set levels so; expected none"
                )
            return None
        book = SenderLevels(self.rank, self._weights, self.senders.default)
        if saved is not None:
            book.load_state_dict(saved)  # levels checked on the ladder with the specs
        return book

    def load_algorithm(self, state: Any, current: Schedule, saved: SavedLevels) -> None:
        """Restore the algorithm's state saved at the link levels of `saved` or else of the
        checkpoint's `current` schedule (they shape the state, as from its round); on a
        mismatch, ValueError with the algorithm as it was."""
        levels = current.levels_of(self.rank) if saved.edges is None else saved.edges.in_force
        round = current.effective_round
        if not isinstance(self.algorithm, LinkLeveled):
            self.algorithm.load_state_dict(state)  # checks everything, then assigns
            return
        before = self.algorithm.state_dict()
        in_force = (
            self._schedules().current.levels_of(self.rank)
            if self.edges is None
            else self.edges.in_force
        )
        self.algorithm.set_levels(levels, round)
        try:
            self.algorithm.load_state_dict(state)
        except Exception:
            self.algorithm.set_levels(in_force, round)
            self.algorithm.load_state_dict(before)
            raise

    def restore(self, saved: SavedLevels, current: Schedule) -> None:
        """Put in force the checkpoint's levels (checked) under its `current` schedule, once
        the peer holds the checkpoint's schedules."""
        if isinstance(self.algorithm, PeerLeveled):
            levels = self._peer_levels(current, saved.book)  # checked with the specs
            self.algorithm.set_peer_levels(self._params, levels, current.effective_round)
        if saved.edges is not None:
            self.edges = saved.edges
        if saved.senders is not None:
            self.senders = saved.senders
        self.expect()
