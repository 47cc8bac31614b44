"""The coordinator: hears what peers measure, plans merged compression, publishes schedules.

Optional: peers train on their static schedule without it, and on their last schedule when it
dies. Peers report every few rounds (`PeerReport`: round, newest epoch, compute seconds per
round, their compressor's measured cost, the model's tensors, and the recent transfers of each
link); the reply carries the newest schedule when the peer does not hold it yet, and before
it those published since the peer's epoch that still take effect after its round (`lacking`).

Planning: once every peer of the topology has reported, and then every `replan_every` rounds,
the coordinator builds a cost model from the reports (the slowest peer's compute and
compression costs, since rounds go in lockstep; one alpha-beta fit over every link's
transfers) and runs its planner. It publishes a new schedule when the plan differs from the one
in force, and always once after it starts, so a restarted coordinator brings every peer onto
one schedule again. A schedule takes effect `margin` rounds after the furthest round reported:
every peer reports within `report_every` rounds of the furthest round heard, and stages the
reply after the round that follows its report, in time for the round it runs next (a schedule
is late only for a round a peer has begun, schedule.py `stage`), so 2 x report_every rounds
reach the peer furthest ahead and the margin's 2 x report_every + 1 leave one round for a slow
reply (3 x report_every + 2 until stop 46: with report_every 1, two rounds more of
every adaptive reaction on shaped links, docs/benchmarks.md run 11), 3 x report_every + 2
until the members' pace is measured (start-up); and at least
the rounds the members run in 0.15 s (pace.py), so that rounds of a few milliseconds
do not outrun a reply from a busy coordinator. Should a peer still pass the effective round
first, it takes the schedule from its next round (client.py), and its report says so (or shows
it past the round without the schedule): the margin doubles for the schedules that follow.
Nothing is published again: a peer alone runs its rounds faster than the others, and a
schedule published again for it passed it again (tests/test_torchrun_membership.py, CI at
stop 43: a member never left the members it held before a removal). A raised margin halves
again, down to its base, after
`CALM_MARGINS` times its length in rounds with no schedule missed: one late reply (a busy
spell) would otherwise slow every later change of the run, and of levels most of all. A miss
that follows such a halving doubles the calm it takes (up to `MAX_CALM_MARGINS`), so a machine
that steadily needs the larger margin misses ever more rarely.

Rate control (`adaptive`): peers also report their last sends to each neighbour (bytes, and
seconds until the neighbour had them) and, for an algorithm with per-link levels, the bytes a
round sends at each level. Every time the furthest round has moved `report_every` rounds
on, the coordinator estimates every link from both ends' sends and lets the rate controller
(levels/rate.py) choose each link's level within the round budget (set, or else the slowest
peer's compute time per round); when any level changes it publishes a schedule with the same
groups and the new levels. With `boost`, the links of a peer that reports a critical learning
phase (Accordion: a layer's gradient norm changed by half or more between windows of rounds,
schedule/critical.py) go one level above the controller's choice while the phase lasts. With
`follow_loss` (the default) no link goes above what the fall of the training loss allows
(AdaComm's sqrt(F_0 / F_t) carried to ladder rungs, levels/progress.py: rung k, from 0 at the
lowest, needs a 4^k-fold fall of the members' median loss), so links start at the lowest
level and rise as training comes to need the bytes (past the ceiling each link still rises a
rung at a time; `boost` may put a critical peer's links one rung above it); until a majority of
the members report a loss (a loop of one's own that does not call `observe_loss`) the ceiling
does not apply, and the coordinator's log says so once.

Plans and levels wait while MAX_STAGED - 1 schedules wait for their round, so a peer never has
to refuse the newest (it holds at most MAX_STAGED waiting); changes of members do not (they
must not wait for good where the lead stalls).

Live membership (a topology with `members:`, topology/members.py): the coordinator decides who
is in (membership.py: members silent past `member_timeout` seconds are removed, ranks of the
capacity that report are admitted, a bounded number per change) and publishes each change as a
schedule naming the members, in force a margin after the furthest round heard, like any
schedule; every schedule it publishes on a live topology names them. Planning, the model's
majority and rate control count the members in force only; a peer awaiting its admission
counts toward no round and misses no schedule.

No state survives a restart: membership comes back with the next reports, and epochs continue
above the highest epoch the peers report holding, so they only ever increase.

Nothing one report says decides for the others (transport/claims.py); what each report may
say alone is checked at the door (reports.py):
- the model (signature and tensor list) is the one a majority of the topology's peers report;
  until a majority agrees nothing is planned, and a report of another model is refused;
- a claimed round is believed up to what time allows since that peer's last report, and the
  round schedules are counted from is the furthest believed, at most `margin` past the round
  two peers agree on;
- a claimed epoch is believed up to MAX_STAGED above the one two peers agree on.
The service that serves it over gRPC is service.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace

import grpc

from gossipcomp.coordinator.membership import DEFAULT_MEMBER_TIMEOUT, MemberLiveness
from gossipcomp.coordinator.pace import RoundPace
from gossipcomp.coordinator.reports import MAX_MARGIN, MemberReport, ReportRefused, check_report
from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.progress import LossAllowance
from gossipcomp.levels.rate import FIRST_DECISION_ROUND, LevelCosts, Link, RateController
from gossipcomp.levels.rate import link as edge_of
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule import (
    CompressorCost,
    CostModel,
    LinkCost,
    TensorInfo,
    fit_link,
    make_planner,
)
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import MAX_BUDGET_S, MAX_STAGED, LinkLevel, Schedule
from gossipcomp.topology import Topology
from gossipcomp.transport.base import MAX_WIRE_ROUND
from gossipcomp.transport.claims import (
    DEFAULT_ROUND_SECONDS,
    RoundClaims,
    agreed_round,
    quorum_of,
)

log = logging.getLogger("gossipcomp.coordinator")  # the name it had as one module
# each change of link levels and what it was decided on (`gossipcomp coordinator --adaptive`
# shows them): the budget, its floor and every link's estimate
decisions_log = logging.getLogger("gossipcomp.coordinator.levels")

MAX_NAMED_PEERS = 16  # peers a warning names (a network of thousands: the first 16, then ...)
ADAPTIVE_PLANNER = "adaptive"  # the planner label of schedules that change link levels
CALM_MARGINS = 32  # margins of rounds with no schedule missed before a raised margin halves
MAX_CALM_MARGINS = 32 * CALM_MARGINS  # the most that calm grows to after misses that follow it
# schedules kept (`Coordinator.published`, newest last): a reply needs MAX_STAGED of them; more
# are kept for who reads the history (benchmarks, tests). Adaptive levels publish up to one a
# report interval, so an unbounded list grew by one every few rounds for the whole run
KEPT_SCHEDULES = 256


def _differs(request: cpb.PeerReport, model: tuple[str, tuple[TensorInfo, ...]]) -> str:
    """Why a report's model is not the majority's `model` (signature, tensors)."""
    signature, _ = model
    if request.model_signature != signature:
        return (
            f"model_signature: {quoted(request.model_signature)} is not the model a majority "
            f"of the peers report ({signature})"
        )
    return "tensors: not the parameters a majority of the peers report with this model_signature"


class Coordinator:
    """Membership, measurements and published schedules of one network (thread-safe)."""

    def __init__(
        self,
        topology: Topology,
        *,
        planner: str = "mergecomp",
        report_every: int = 10,
        replan_every: int = 200,
        adaptive: bool = False,
        round_budget: float | None = None,
        boost: bool = False,
        hold_lowest_until: int = 0,
        follow_loss: bool = True,
        member_timeout: float = DEFAULT_MEMBER_TIMEOUT,
        liveness: MemberLiveness | None = None,
    ) -> None:
        """`adaptive`: choose a level per link (module docstring) within `round_budget`
        seconds of transfers per round (None: the slowest peer's compute time per round);
        `boost`: links of a peer in a critical learning phase go one level higher;
        `hold_lowest_until`: decisions before the furthest round reaches it publish every link
        at the ladder's lowest level, and the controller goes on from that level (a link rises
        from it by the controller's own steps once the hold ends; no boost meanwhile; 0: no
        hold); `follow_loss`: no link above what the fall of the members' training loss
        allows (levels/progress.py). A live
        topology: members silent for `member_timeout` seconds are removed (`liveness`: the
        whole rule, membership.py, for tests and callers that set its bounds)."""
        make_planner(planner)  # fails naming the planners that exist
        if round_budget is not None:
            checked_number("round_budget", round_budget, 0.0, MAX_BUDGET_S, closed_low=False)
        self.adaptive = adaptive
        self.boost = boost
        self.hold_lowest_until = checked_integer(
            "hold_lowest_until", hold_lowest_until, 0, MAX_WIRE_ROUND - 1
        )
        if self.hold_lowest_until and not adaptive:
            raise ValueError(
                f"hold_lowest_until {hold_lowest_until}: expected adaptive=True with it (it "
                "holds the link levels an adaptive coordinator sets)"
            )
        self.follow_loss = follow_loss
        self._allowance = LossAllowance()  # the ceiling the loss allows (`follow_loss`)
        self._loss_unmeasured = False  # no majority reported a loss yet (said once)
        self.round_budget = round_budget
        for field, value in (("report_every", report_every), ("replan_every", replan_every)):
            checked_integer(field, value, 1, 10**6)
        self.topology = topology
        self.planner = planner
        self.report_every = report_every
        self.replan_every = replan_every
        self.base_margin = 2 * report_every + 1
        self.unpaced_margin = 3 * report_every + 2  # until the members' pace is measured
        self.margin = self.base_margin
        self._members: dict[int, MemberReport] = {}
        # each rank's latest word on the model (signature, tensors): a majority decides
        self._models: dict[int, tuple[str, tuple[TensorInfo, ...]]] = {}
        self._highest_epoch = 0  # the newest epoch published, or believed held by peers
        # the furthest round believed, at most `margin` past the round two peers agree on
        self._lead = 0
        self._rounds = RoundClaims(
            # time allows a peer at most the fastest round peers assume before measuring one
            DEFAULT_ROUND_SECONDS,
            margin=4 * report_every,
            # two agree, or the one member of a network of one (joiners count none)
            quorum=lambda _: quorum_of(len(self.members)),
        )
        self._missed_epoch = 0  # the newest epoch a member took late: its miss is counted
        self._margin_set_at = 0  # lead round at which the margin last changed
        self._calm_margins = CALM_MARGINS  # margins of calm before a raised margin halves
        self._relaxed = False  # the margin last changed by halving (a miss then: calm too short)
        self._planned_at: int | None = None  # lead round of this coordinator's last plan
        self._adapted_at: int | None = None  # lead round of the last choice of levels
        self._members_at: int | None = None  # lead round of the last change of members
        self._rate: RateController | None = None  # made when the first ladder is known
        self._base: dict[Link, int] = {}  # the levels the controller chose, before any boost
        self.published: deque[Schedule] = deque(maxlen=KEPT_SCHEDULES)  # newest last
        self._liveness: MemberLiveness | None = None
        if topology.live is not None:
            self._liveness = liveness or MemberLiveness(topology.live.initial, member_timeout)
        elif liveness is not None:
            raise ValueError(
                f"member liveness given, but topology {topology.name} has a fixed membership "
                "(a topology file with `members:` is live)"
            )
        self._pace = RoundPace()  # the members' rounds per second: margins cover a time
        self._lock = threading.Lock()

    def check(self, request: cpb.PeerReport) -> MemberReport:
        """The report, checked; ReportRefused naming what is wrong."""
        return check_report(self.topology, request)

    def receive(self, request: cpb.PeerReport) -> tuple[Schedule, ...]:
        """Take a peer's report; the schedules it lacks, oldest first (`lacking`).

        The report's word on the model counts toward the majority first; a report of another
        model than the majority's is then refused (FAILED_PRECONDITION). Its round and epoch
        are kept as far as they are believed (module docstring)."""
        report = self.check(request)
        with self._lock:
            self._models[report.rank] = (request.model_signature, report.tensors)
            model = self._agreed_model()
            if model is not None and self._models[report.rank] != model:
                self._members.pop(report.rank, None)
                raise ReportRefused(grpc.StatusCode.FAILED_PRECONDITION, _differs(request, model))
            report = self._believe_round(report)
            self._members[report.rank] = report
            if self._liveness is not None:
                newest = self.published[-1].epoch if self.published else 0
                rejoining = report.joining and report.epoch >= newest  # else the reply admits
                self._liveness.heard(report.rank, rejoining)
            self._highest_epoch = max(self._highest_epoch, self._believed_epoch())
            agreed = self._rounds.agreed()
            if agreed is not None:  # the furthest round, at most a margin past two peers' word
                furthest = max(m.round for m in self._members.values())
                self._lead = min(furthest, agreed + self.margin)
            self._note_missed(report)
            self._relax_margin()
            self._maybe_change_members()
            self._maybe_plan()
            self._maybe_adapt()
            return self.lacking(report.epoch, report.round)

    def _believe_round(self, report: MemberReport) -> MemberReport:
        """`report` with its round as far as it is believed. A peer awaiting its admission
        (`joining`: it holds no schedule naming it) does no rounds of the network's, and its
        round (0 for a joiner) would hold the agreed round back, so that every schedule, the
        admission first, took effect in the members' past: it counts toward no round, and is
        kept at most at the lead. Every other peer's round counts as before (a restarted
        coordinator knows only the topology's initial members: the rounds of those in force
        now must count too)."""
        if report.joining:
            self._rounds.forget(report.rank)
            self._pace.forget(report.rank)
            return replace(report, round=min(report.round, self._lead))
        believed = self._rounds.believe(report.rank, report.round)
        if believed.cut:
            log.warning(
                "coordinator: peer %d claims round %d; believed up to round %d",
                report.rank,
                report.round,
                believed.round,
            )
        self._pace.heard(report.rank, believed.round, believed.at, believed.cut)
        return replace(report, round=believed.round)

    def lacking(self, epoch: int, round: int) -> tuple[Schedule, ...]:
        """What a peer holding `epoch` at `round` is sent, oldest first: the newest schedule
        when it is newer than `epoch` (also when its round has passed at the peer, which
        then takes it from its next round: `_note_missed`), and before it every
        other schedule newer than `epoch` that still takes effect after `round`, at most
        MAX_STAGED in all. With only the newest, a peer that reported before one schedule and
        after the next ran on under the old one while its neighbours were under the one
        between: their envelopes were refused as long replaced, and the edge went down for a
        whole round timeout (benchmarks/adaptive.py, decisions every round)."""
        if not self.published or self.published[-1].epoch <= epoch:
            return ()
        newest = self.published[-1]
        earlier = []
        for schedule in itertools.islice(reversed(self.published), 1, None):
            if schedule.epoch <= epoch or len(earlier) == MAX_STAGED - 1:
                break
            if round < schedule.effective_round < newest.effective_round:
                earlier.append(schedule)  # not one the newest supersedes at the peer
        return (*reversed(earlier), newest)

    def _agreed_model(self) -> tuple[str, tuple[TensorInfo, ...]] | None:
        """The model (signature, tensors) a majority of the topology's peers report; None
        while no majority agrees."""
        if not self._models:
            return None
        members = set(self.members)
        votes_of = Counter(m for rank, m in self._models.items() if rank in members)
        if not votes_of:
            return None
        model, votes = votes_of.most_common(1)[0]
        return model if votes > len(members) // 2 else None

    @property
    def members(self) -> tuple[int, ...]:
        """The members of the newest schedule published (every rank of a fixed topology; the
        initial members of a live one before any)."""
        live = self.topology.live
        if live is None:
            return tuple(range(self.topology.n))
        newest = self.published[-1] if self.published else None
        return live.members(newest.members if newest else ())

    def _maybe_change_members(self) -> None:
        """Publish the members the liveness rule decides, when they change (membership.py);
        only once the furthest round is agreed, so the change's round is counted from it, and
        at most one change a `margin` rounds of the lead (peers hold at most MAX_STAGED
        schedules waiting; a change does not wait on them, `_staging_full`)."""
        if self._liveness is None or self._rounds.agreed() is None:
            return
        if self._members_at is not None and 0 <= self._lead - self._members_at < self.margin:
            return
        current = self.members
        members = self._liveness.decide(current)
        if members is None:
            return
        self._members_at = self._lead
        for rank in set(current) - set(members):
            self._members.pop(rank, None)  # a removed member's measurements plan nothing
            self._rounds.forget(rank)  # nor does its round count
            self._pace.forget(rank)
        log.warning(
            "coordinator: members %s -> %s (removed: %s; admitted: %s)",
            list(current),
            list(members),
            sorted(set(current) - set(members)),
            sorted(set(members) - set(current)) or ("again" if members == current else []),
        )
        newest = self.published[-1] if self.published else None
        groups, planner = (newest.groups, newest.planner) if newest else ((), self.planner)
        links, budget = (newest.links, newest.budget_s) if newest else ((), 0.0)
        self._publish(groups, planner, links, budget, members)

    def _model_members(self) -> list[MemberReport]:
        """The members that report the majority's model."""
        model = self._agreed_model()
        if model is None:
            return []
        members = set(self.members)
        return [
            m
            for rank, m in self._members.items()
            if rank in members and self._models.get(rank) == model
        ]

    def _believed_epoch(self) -> int:
        """The highest epoch the members hold, believed up to MAX_STAGED above the one two of
        them agree on (one report cannot move epochs to the end of their range)."""
        epochs = [m.epoch for m in self._members.values() if not m.joining]
        agreed = agreed_round(epochs, quorum_of(len(self.members))) or 0
        return min(max(epochs, default=0), agreed + MAX_STAGED)

    def _note_missed(self, report: MemberReport) -> None:
        """A schedule reached a member after its round: the margin was too short for it. Its
        report says so (`late_epoch`, an epoch published here), or shows it at or past the
        newest schedule's round without holding it (the reply takes it there late). The
        margin doubles (up to MAX_MARGIN), once per epoch missed. Not for a schedule the
        member refused as unusable (its report's `refused_epoch`: no margin helps), nor for
        a peer awaiting admission (it does no rounds of the network's)."""
        if report.joining or report.rank not in self.members:
            return
        newest = self.published[-1] if self.published else None
        missed = 0
        if report.late_epoch > self._missed_epoch and any(
            s.epoch == report.late_epoch for s in self.published
        ):
            missed = report.late_epoch
        elif (
            newest is not None
            and self._missed_epoch < newest.epoch
            and report.epoch < newest.epoch
            and report.refused_epoch != newest.epoch
            and report.round >= newest.effective_round
        ):
            missed = newest.epoch
        if not missed:
            return
        self._missed_epoch = missed
        self._margin_set_at = self._lead
        if self._relaxed:
            self._calm_margins = min(2 * self._calm_margins, MAX_CALM_MARGINS)
            self._relaxed = False
        self.margin = min(2 * self.margin, MAX_MARGIN)
        schedule = next(s for s in reversed(self.published) if s.epoch == missed)
        log.warning(
            "coordinator: peer %d at round %d missed schedule epoch %d (from round %d) and "
            "takes it late; the margin is now %d rounds",
            report.rank,
            report.round,
            missed,
            schedule.effective_round,
            self.margin,
        )

    def _relax_margin(self) -> None:
        """Halve a raised margin (not below its base) once the calm (`CALM_MARGINS` x margin
        rounds, more after misses that followed a halving) has passed since it last changed
        with no schedule missed (module docstring)."""
        self._margin_set_at = min(self._margin_set_at, self._lead)  # the lead went back
        if self.margin <= self.base_margin:
            return
        if self._lead - self._margin_set_at < self._calm_margins * self.margin:
            return
        self.margin = max(self.base_margin, self.margin // 2)
        self._margin_set_at = self._lead
        self._relaxed = True
        log.info("coordinator: no schedule missed for a while; margin back to %d", self.margin)

    def publish(self, groups: Sequence[TensorGroup], planner: str) -> Schedule:
        """A new schedule of `groups` (keeping the newest one's link levels), in force
        a margin after the furthest round heard (`margin` rounds, or the members' rounds of
        pace.py's lead time where more; peers check it when they stage it)."""
        with self._lock:
            newest = self.published[-1] if self.published else None
            links, budget = (newest.links, newest.budget_s) if newest else ((), 0.0)
            return self._publish(tuple(groups), planner, links, budget)

    def _publish(
        self,
        groups: tuple[TensorGroup, ...],
        planner: str,
        links: tuple[LinkLevel, ...] = (),
        budget_s: float = 0.0,
        members: tuple[int, ...] | None = None,
    ) -> Schedule:
        """`members`: those from its round on (None: the members in force; a live topology's
        schedules always name them)."""
        if members is None:
            members = self.members if self.topology.live is not None else ()
        newest = self.published[-1] if self.published else None
        epoch = max(self._highest_epoch, newest.epoch if newest else 0) + 1
        effective = self._lead + max(self.margin, self._lead_rounds())
        if newest is not None and newest.effective_round < self._lead + MAX_MARGIN:
            # after the newest one, unless that one is further than any margin (published
            # from rounds no longer believed): a newer epoch supersedes it at the peers
            effective = max(effective, newest.effective_round + 1)
        schedule = Schedule(epoch, effective, groups, planner, links, budget_s, members)
        self.published.append(schedule)
        self._highest_epoch = epoch
        log.info(
            "coordinator: schedule epoch %d (%s, %d groups) from round %d",
            epoch,
            planner,
            len(groups),
            effective,
        )
        return schedule

    def _lead_rounds(self) -> int:
        """The rounds the members run in the time a schedule is given to reach them
        (pace.py): a schedule takes effect no sooner. Before their pace is measured,
        `unpaced_margin`: the first schedule of a run (the first plan, published at the
        members' first reports) meets start-up rounds and a coordinator's first plan, and at
        the base margin of 3 rounds one came a round late to a peer, whose edges went down
        (benchmarks/adaptive.py: 2 of 16 PowerGossip adaptive runs, stop 46)."""
        members = self.members
        quorum = quorum_of(len(members))
        if self._pace.rounds_per_second(members, quorum) is None:
            return self.unpaced_margin
        return self._pace.lead_rounds(members, quorum)

    def _staging_full(self) -> bool:
        """Whether as many schedules wait for their round as a new one may join (a peer holds
        at most MAX_STAGED waiting, and `lacking` sends at most that many): plans and levels
        wait until one is in force, else the newest would be refused at the peers. Changes of
        members do not wait on it: the lead it counts from can stall (members that died,
        a member restarted at round 0), and a removal or an admission must not wait for
        good; they come at most one a margin (`_maybe_change_members`)."""
        recent = itertools.islice(reversed(self.published), MAX_STAGED)
        return sum(s.effective_round > self._lead for s in recent) >= MAX_STAGED - 1

    def _maybe_plan(self) -> None:
        """Plan when every peer has reported the majority's model: first once, then every
        replan_every rounds (and when the agreed round went back)."""
        if len(self._model_members()) < len(self.members):
            return
        if self._planned_at is not None and 0 <= self._lead - self._planned_at < self.replan_every:
            return
        if self._staging_full():
            return
        self._planned_at = self._lead
        groups = self._plan()
        newest = self.published[-1] if self.published else None
        if newest is None or newest.groups != groups:
            links, budget = (newest.links, newest.budget_s) if newest else ((), 0.0)
            self._publish(groups, self.planner, links, budget)

    def _maybe_adapt(self) -> None:
        """Choose every link's level when every peer has reported and, after the first time,
        the furthest round has moved report_every rounds on (one report interval: a link that
        slowed waits one interval for its decision, not two); publish when one changes."""
        if not self.adaptive or len(self._model_members()) < len(self.members):
            return
        reports = self._model_members()
        if self._adapted_at is not None and (
            0 <= self._lead - self._adapted_at < self.report_every
        ):
            return
        if self._adapted_at is None and min(m.round for m in reports) < FIRST_DECISION_ROUND:
            return  # start-up sends (handshakes, first rounds) are slow: not the link's speed
        ladders = [m.levels for m in reports]
        ladder = ladders[0]
        if ladder is None or any(other != ladder for other in ladders):
            return  # an algorithm without levels, or peers that disagree on the ladder
        if self._staging_full():
            return
        self._adapted_at = self._lead
        budget = self.round_budget or max(m.compute_seconds for m in reports)
        if budget <= 0:
            return
        newest = self.published[-1] if self.published else None
        current: dict[Link, int] = {
            (x.low, x.high): x.level for x in (newest.links if newest else ())
        }
        sends: dict[Link, list[tuple[tuple[int, float], ...]]] = {}
        for member in reports:
            for j, samples in member.sends.items():
                sends.setdefault(edge_of(member.rank, j), []).append(samples)
        if self._rate is None or self._rate.costs != ladder:
            self._rate = RateController(ladder)
        held = self._lead < self.hold_lowest_until
        # a warm-up at the cheapest level, or the rung the training loss allows: the controller
        # proposes nothing above it, so past it each link rises from it step by step, each
        # step measured, never straight to a level its sends never tried (no boost while held)
        ceiling = (
            ladder.levels[0]
            if held
            else self._loss_ceiling(reports, ladder)
            if self.follow_loss
            else None
        )
        self._base = self._rate.update(self._base, sends, budget, top=ceiling)
        if ceiling is not None:  # a link kept above it from before (a hold that re-entered)
            self._base = {key: min(level, ceiling) for key, level in self._base.items()}
        budget = self._rate.budget_s or budget  # what the levels fit: at least the slowest link's
        critical = {m.rank for m in reports if m.critical} if self.boost and not held else set()
        chosen = {
            key: ladder.above(level) if critical.intersection(key) else level
            for key, level in self._base.items()
        }
        if chosen == current:
            return
        self._log_decision(chosen, budget, held, None if held else ceiling)
        links = tuple(LinkLevel(a, b, level) for (a, b), level in sorted(chosen.items()))
        self._publish(newest.groups if newest else (), ADAPTIVE_PLANNER, links, budget)

    def _loss_ceiling(self, reports: Sequence[MemberReport], ladder: LevelCosts) -> int | None:
        """The highest level the fall of the members' training loss allows (levels/progress.py:
        the members that report both losses count, once a majority; a member awaiting its
        admission does not). None until a majority ever has, said once: the budget alone sets
        the levels then."""
        reporting = [
            (m.initial_loss, m.loss)
            for m in reports
            if not m.joining and m.initial_loss > 0 and m.loss > 0
        ]
        self._allowance.update(reporting, len(reports))
        if self._allowance.measured:
            return self._allowance.highest(ladder)
        if not self._loss_unmeasured:
            silent = [m.rank for m in reports if m.joining or m.initial_loss <= 0 or m.loss <= 0]
            log.warning(
                "coordinator: levels not capped by the training loss: peers %s (of %d) report "
                "none; a majority must (a loop of one's own calls CoordinatorClient.observe_loss)",
                ", ".join(map(str, silent[:MAX_NAMED_PEERS]))
                + (" ..." if len(silent) > MAX_NAMED_PEERS else ""),
                len(reports),
            )
            self._loss_unmeasured = True
        return None

    def _log_decision(
        self, chosen: dict[Link, int], budget: float, held: bool, ceiling: int | None
    ) -> None:
        """One line per change of levels: the round it was decided at, the budget and where it
        came from, and each link's level with the settled estimate the floor was taken from
        (`held`: every level is the lowest until `hold_lowest_until`; `ceiling`: the highest the
        training loss allows)."""
        if self._rate is None or not decisions_log.isEnabledFor(logging.INFO):
            return
        estimated = self._rate.estimated
        links = ", ".join(
            f"{a}-{b} level {level}"
            + (
                f" ({1e3 * estimated[(a, b)].latency_s:.1f} ms + "
                f"{1e9 * estimated[(a, b)].seconds_per_byte:.0f} ns/B)"
                if (a, b) in estimated
                else ""
            )
            for (a, b), level in sorted(chosen.items())
        )
        decisions_log.info(
            "coordinator: levels decided at round %d: budget %.1f ms (floor %.1f ms: the "
            "slowest link at the lowest level); %s%s%s",
            self._lead,
            1e3 * budget,
            1e3 * self._rate.floor_s,
            links,
            f" (held at the lowest level until round {self.hold_lowest_until})" if held else "",
            ""
            if ceiling is None
            else f" (at most level {ceiling}: the training loss fell {self._allowance.ratio:.2f}x)",
        )

    def _plan(self) -> tuple[TensorGroup, ...]:
        """The planner's groups under the cost model the reports give (none for algorithms
        that send no compressed groups)."""
        members = self._model_members()
        compressor = members[0].compressor
        if not compressor or any(m.compressor != compressor for m in members):
            return ()
        slowest = CompressorCost(
            max(m.compression.fixed_s for m in members),
            max(m.compression.per_element_s for m in members),
        )
        transfers = [t for m in members for t in m.transfers]
        try:
            link = fit_link(transfers)
        except ValueError:  # too few transfers, or all of one size: latency only
            mean = sum(s for _, s in transfers) / len(transfers) if transfers else 0.0
            link = LinkCost(mean, 0.0)
        costs = CostModel(
            {spec: slowest for spec in {compressor, "identity", "fp16"}},
            link,
            compute_s=max(m.compute_seconds for m in members),
        )
        return tuple(make_planner(self.planner).plan(members[0].tensors, costs, compressor))
