"""The coordinator: hears what peers measure, plans merged compression, publishes schedules.

Optional: peers train on their static schedule without it, and on their last schedule when it
dies. Peers report every few rounds (`PeerReport`: round, newest epoch, compute seconds per
round, their compressor's measured cost, the model's tensors, and the recent transfers of each
link); the reply carries the newest schedule when the peer does not hold it yet.

Planning: once every peer of the topology has reported, and then every `replan_every` rounds,
the coordinator builds a cost model from the reports (the slowest peer's compute and
compression costs, since rounds go in lockstep; one alpha-beta fit over every link's
transfers) and runs its planner. It publishes a new schedule when the plan differs from the one
in force, and always once after it starts, so a restarted coordinator brings every peer onto
one schedule again. A schedule takes effect `margin` rounds after the furthest round reported:
every peer reports within `report_every` rounds and stages the reply at its next report, so
3 x report_every + 2 rounds leave room for a peer a little ahead of the others. Where rounds are
faster than a report's round trip, a peer can still pass the effective round first: its next
report shows it, and the coordinator publishes the schedule again under a new epoch with the
margin doubled, until it fits.

Rate control (`adaptive`): peers also report their last sends to each neighbour (bytes, and
seconds until the neighbour had them) and, for an algorithm with per-link levels, the bytes a
round sends at each level. Every time the furthest round has moved `2 x report_every` rounds
on, the coordinator estimates every link from both ends' sends and lets the rate controller
(schedule/rate.py) choose each link's level within the round budget (set, or else the slowest
peer's compute time per round); when any level changes it publishes a schedule with the same
groups and the new levels. With `boost`, the links of a peer that reports a critical learning
phase (Accordion: a layer's gradient norm changed by half or more between windows of rounds,
schedule/critical.py) go one level above the controller's choice while the phase lasts. At most about three schedules then wait at a peer (MAX_STAGED is 4).

No state survives a restart: membership comes back with the next reports, and epochs continue
above the highest epoch any peer reports holding, so they only ever increase.

Every report is hostile until checked: sizes and counts are bounded before anything is kept,
numbers are range-checked, the sender must be a peer of the topology with the same protocol,
topology and model as the first peer heard, and errors quote what they echo shortened.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc

from gossipcomp.compress import parse_spec
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import coordinator_pb2_grpc as cpb_grpc
from gossipcomp.schedule import (
    CompressorCost,
    CostModel,
    LinkCost,
    TensorInfo,
    fit_link,
    make_planner,
)
from gossipcomp.schedule.costs import check_sample
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.rate import (
    FIRST_DECISION_ROUND,
    MAX_LEVEL,
    LevelCosts,
    Link,
    RateController,
)
from gossipcomp.schedule.rate import link as edge_of
from gossipcomp.schedule.schedule import (
    MAX_BUDGET_S,
    MAX_EPOCH,
    MAX_ROUND,
    LinkLevel,
    Schedule,
    ScheduleRefused,
)
from gossipcomp.security.tls import TlsFiles, server_credentials
from gossipcomp.text import quoted
from gossipcomp.topology import Topology
from gossipcomp.transport.base import PROTOCOL_VERSION

log = logging.getLogger(__name__)

MAX_TENSORS = 1 << 16  # parameters of one model in a report
MAX_NAME_CHARS = 1000  # characters of one parameter name
MAX_SAMPLES_PER_LINK = 64  # transfers of one link in one report
MAX_SECONDS = 86_400.0  # a measured time beyond a day is a lie or a bug
MAX_REPORT_BYTES = 16 << 20  # a serialised report (the tensor list dominates)
MAX_LEVELS = 64  # levels of one ladder in a report
MAX_MARGIN = 10_000  # rounds ahead a schedule may be published at most
ADAPTIVE_PLANNER = "adaptive"  # the planner label of schedules that change link levels
SERVICE_NAME = "gossipcomp.v1.Coordinator"


class ReportRefused(ValueError):
    """A report the coordinator will not use; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MemberReport:
    """One peer's report, checked."""

    rank: int
    round: int
    epoch: int
    compute_seconds: float
    compressor: str
    compression: CompressorCost
    tensors: tuple[TensorInfo, ...]
    transfers: tuple[tuple[int, float], ...]  # (bytes, seconds) over all its links
    # neighbour -> its last sends there, (bytes, seconds until delivered), oldest first
    sends: dict[int, tuple[tuple[int, float], ...]]
    levels: LevelCosts | None  # the algorithm's ladder, None without per-link levels
    critical: bool = False  # in a critical learning phase (schedule/critical.py)


def schedule_to_proto(schedule: Schedule) -> cpb.Schedule:
    return cpb.Schedule(
        epoch=schedule.epoch,
        effective_round=schedule.effective_round,
        planner=schedule.planner,
        groups=[cpb.ScheduleGroup(names=g.names, compressor=g.compressor) for g in schedule.groups],
        links=[cpb.LinkLevel(low=x.low, high=x.high, level=x.level) for x in schedule.links],
        budget_s=schedule.budget_s,
    )


def schedule_from_proto(message: cpb.Schedule) -> Schedule:
    """A received schedule; ScheduleRefused naming the field when out of range (the peer
    checks it against its model and topology when staging it)."""
    groups = tuple(TensorGroup(tuple(g.names), g.compressor) for g in message.groups)
    links = tuple(LinkLevel(x.low, x.high, x.level) for x in message.links)
    return Schedule(
        message.epoch, message.effective_round, groups, message.planner, links, message.budget_s
    )


def _level_costs(request: cpb.PeerReport) -> LevelCosts | None:
    """The ladder a report states (None when it states none); ReportRefused when malformed."""
    if not request.level_costs:
        return None
    if len(request.level_costs) > MAX_LEVELS:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"level_costs: {len(request.level_costs)} levels, at most {MAX_LEVELS}",
        )
    costs = {}
    for entry in request.level_costs:
        level = _integer("level_costs level", entry.level, MAX_LEVEL)
        if level in costs:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"level_costs: level {level} listed twice"
            )
        costs[level] = _integer("level_costs bytes_per_round", entry.bytes_per_round, 1 << 40)
    try:
        return LevelCosts(costs, request.exchanges_per_round)
    except ValueError as error:
        raise ReportRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


def _number(field: str, value: float, high: float = MAX_SECONDS) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= high):
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: expected a number in [0, {high:g}], got {value!r}",
        )
    return value


def _integer(field: str, value: int, high: int) -> int:
    if not 0 <= value <= high:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field}: expected 0..{high}, got {value}"
        )
    return value


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
    ) -> None:
        """`adaptive`: choose a level per link (module docstring) within `round_budget`
        seconds of transfers per round (None: the slowest peer's compute time per round);
        `boost`: links of a peer in a critical learning phase go one level higher."""
        make_planner(planner)  # fails naming the planners that exist
        if round_budget is not None and not (
            math.isfinite(round_budget) and 0 < round_budget <= MAX_BUDGET_S
        ):
            raise ValueError(
                f"round_budget: expected seconds in (0, {MAX_BUDGET_S:g}], got {round_budget!r}"
            )
        self.adaptive = adaptive
        self.boost = boost
        self.round_budget = round_budget
        for field, value in (("report_every", report_every), ("replan_every", replan_every)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**6:
                raise ValueError(f"{field}: expected an integer in [1, 10^6], got {quoted(value)}")
        self.topology = topology
        self.planner = planner
        self.report_every = report_every
        self.replan_every = replan_every
        self.margin = 3 * report_every + 2
        self._members: dict[int, MemberReport] = {}
        self._model_signature: str | None = None
        self._highest_epoch = 0
        self._lead = 0  # the furthest round any peer reported
        self._planned_at: int | None = None  # lead round of this coordinator's last plan
        self._adapted_at: int | None = None  # lead round of the last choice of levels
        self._rate: RateController | None = None  # made when the first ladder is known
        self._base: dict[Link, int] = {}  # the levels the controller chose, before any boost
        self.published: list[Schedule] = []
        self._lock = threading.Lock()

    def check(self, request: cpb.PeerReport) -> MemberReport:
        """The report, checked; ReportRefused naming what is wrong."""
        if request.protocol_version != PROTOCOL_VERSION:
            raise ReportRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol_version: expected {PROTOCOL_VERSION}, got {request.protocol_version}",
            )
        if request.topology_hash != self.topology.hash:
            raise ReportRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"topology_hash: {quoted(request.topology_hash)} is not this network's",
            )
        if not 0 <= request.sender < self.topology.n:
            raise ReportRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"sender: peer {request.sender} is not in the topology (0 to {self.topology.n - 1})",
            )
        with self._lock:
            known = self._model_signature
        if known is not None and request.model_signature != known:
            raise ReportRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model_signature: {quoted(request.model_signature)} differs from the other peers'",
            )
        if len(request.tensors) > MAX_TENSORS:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensors: {len(request.tensors)}, at most {MAX_TENSORS}",
            )
        tensors = []
        for tensor in request.tensors:
            if not 0 < len(tensor.name) <= MAX_NAME_CHARS:
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor name {quoted(tensor.name)}: expected 1 to {MAX_NAME_CHARS} characters",
                )
            numel = _integer(f"tensor {quoted(tensor.name)} numel", tensor.numel, 1 << 40)
            tensors.append(TensorInfo(tensor.name, numel))
        neighbours = set(self.topology.neighbors(request.sender))
        transfers: list[tuple[int, float]] = []
        for link in request.links:
            if link.neighbour not in neighbours:
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"links: peer {link.neighbour} is not a neighbour of peer {request.sender}",
                )
            if len(link.bytes) != len(link.seconds) or len(link.bytes) > MAX_SAMPLES_PER_LINK:
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"links: expected as many bytes as seconds, at most {MAX_SAMPLES_PER_LINK} "
                    f"per link, got {len(link.bytes)} and {len(link.seconds)}",
                )
            for nbytes, seconds in zip(link.bytes, link.seconds, strict=True):
                try:
                    transfers.append(check_sample(nbytes, seconds, "links"))
                except ValueError as error:
                    raise ReportRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        sends = {}
        for samples in request.sends:
            if samples.neighbour not in neighbours or samples.neighbour in sends:
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"sends: peer {samples.neighbour} is not a neighbour of peer "
                    f"{request.sender}, or is listed twice",
                )
            if (
                len(samples.bytes) != len(samples.seconds)
                or len(samples.bytes) > MAX_SAMPLES_PER_LINK
            ):
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"sends: expected as many bytes as seconds, at most {MAX_SAMPLES_PER_LINK} "
                    f"per neighbour, got {len(samples.bytes)} and {len(samples.seconds)}",
                )
            try:
                sends[samples.neighbour] = tuple(
                    check_sample(b, t, "sends")
                    for b, t in zip(samples.bytes, samples.seconds, strict=True)
                )
            except ValueError as error:
                raise ReportRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        levels = _level_costs(request)
        compressor = request.compressor
        if compressor:
            try:
                compressor = parse_spec(compressor).spec
            except (ValueError, TypeError) as error:
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"compressor {quoted(compressor)}: {error}"
                ) from None
        return MemberReport(
            rank=request.sender,
            round=_integer("round", request.round, MAX_ROUND),
            epoch=_integer("schedule_epoch", request.schedule_epoch, MAX_EPOCH),
            compute_seconds=_number("compute_seconds", request.compute_seconds),
            compressor=compressor,
            compression=CompressorCost(
                _number("compressor_fixed_seconds", request.compressor_fixed_seconds),
                _number("compressor_element_seconds", request.compressor_element_seconds, 1.0),
            ),
            tensors=tuple(tensors),
            transfers=tuple(transfers),
            sends=sends,
            levels=levels,
            critical=request.critical,
        )

    def receive(self, request: cpb.PeerReport) -> Schedule | None:
        """Take a peer's report; the newest schedule when the peer does not hold it yet."""
        report = self.check(request)
        with self._lock:
            if self._model_signature is None:
                self._model_signature = request.model_signature
            self._members[report.rank] = report
            self._highest_epoch = max(self._highest_epoch, report.epoch)
            self._lead = max(self._lead, report.round)
            self._republish_if_missed(report)
            self._maybe_plan()
            self._maybe_adapt()
            newest = self.published[-1] if self.published else None
        if newest is not None and newest.epoch > report.epoch:
            return newest
        return None

    def _republish_if_missed(self, report: MemberReport) -> None:
        """A peer past the newest schedule's effective round without holding it missed it
        (its rounds outran the reports' round trips): it refused it, so the schedule comes
        again as a new epoch, further ahead: the margin doubles (up to MAX_MARGIN)."""
        newest = self.published[-1] if self.published else None
        if newest is None or report.epoch >= newest.epoch:
            return
        if report.round < newest.effective_round:
            return
        self.margin = min(2 * self.margin, MAX_MARGIN)
        log.warning(
            "coordinator: peer %d at round %d missed schedule epoch %d (from round %d); "
            "publishing it again %d rounds ahead",
            report.rank,
            report.round,
            newest.epoch,
            newest.effective_round,
            self.margin,
        )
        self._publish(newest.groups, newest.planner, newest.links, newest.budget_s)

    def publish(self, groups: Sequence[TensorGroup], planner: str) -> Schedule:
        """A new schedule of `groups` (keeping the newest one's link levels), in force
        `margin` rounds after the furthest round heard (peers check it when they stage it)."""
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
    ) -> Schedule:
        newest = self.published[-1] if self.published else None
        epoch = max(self._highest_epoch, newest.epoch if newest else 0) + 1
        effective = self._lead + self.margin
        if newest is not None:
            effective = max(effective, newest.effective_round + 1)
        schedule = Schedule(epoch, effective, groups, planner, links, budget_s)
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

    def _maybe_plan(self) -> None:
        """Plan when every peer has reported: first once, then every replan_every rounds."""
        if len(self._members) < self.topology.n:
            return
        if self._planned_at is not None and self._lead - self._planned_at < self.replan_every:
            return
        self._planned_at = self._lead
        groups = self._plan()
        newest = self.published[-1] if self.published else None
        if newest is None or newest.groups != groups:
            links, budget = (newest.links, newest.budget_s) if newest else ((), 0.0)
            self._publish(groups, self.planner, links, budget)

    def _maybe_adapt(self) -> None:
        """Choose every link's level when every peer has reported and, after the first time,
        the furthest round has moved 2 x report_every rounds on; publish when one changes."""
        if not self.adaptive or len(self._members) < self.topology.n:
            return
        if self._adapted_at is not None and self._lead - self._adapted_at < 2 * self.report_every:
            return
        if self._adapted_at is None and min(m.round for m in self._members.values()) < (
            FIRST_DECISION_ROUND
        ):
            return  # start-up sends (handshakes, first rounds) are slow: not the link's speed
        ladders = [m.levels for m in self._members.values()]
        ladder = ladders[0]
        if ladder is None or any(other != ladder for other in ladders):
            return  # an algorithm without levels, or peers that disagree on the ladder
        self._adapted_at = self._lead
        budget = self.round_budget or max(m.compute_seconds for m in self._members.values())
        if budget <= 0:
            return
        newest = self.published[-1] if self.published else None
        current: dict[Link, int] = {
            (x.low, x.high): x.level for x in (newest.links if newest else ())
        }
        sends: dict[Link, list[tuple[tuple[int, float], ...]]] = {}
        for member in self._members.values():
            for j, samples in member.sends.items():
                sends.setdefault(edge_of(member.rank, j), []).append(samples)
        if self._rate is None or self._rate.costs != ladder:
            self._rate = RateController(ladder)
        self._base = self._rate.update(self._base, sends, budget)
        critical = {m.rank for m in self._members.values() if m.critical} if self.boost else set()
        chosen = {
            key: ladder.above(level) if critical.intersection(key) else level
            for key, level in self._base.items()
        }
        if chosen == current:
            return
        links = tuple(LinkLevel(a, b, level) for (a, b), level in sorted(chosen.items()))
        self._publish(newest.groups if newest else (), ADAPTIVE_PLANNER, links, budget)

    def _plan(self) -> tuple[TensorGroup, ...]:
        """The planner's groups under the cost model the reports give (none for algorithms
        that send no compressed groups)."""
        members = list(self._members.values())
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


class _Service(cpb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def Report(self, request: cpb.PeerReport, context: grpc.ServicerContext) -> cpb.ReportReply:
        try:
            schedule = self._coordinator.receive(request)
        except ReportRefused as refused:
            context.abort(refused.code, str(refused))
        except ScheduleRefused as error:  # a plan that cannot be a schedule: a bug, say so
            context.abort(grpc.StatusCode.INTERNAL, str(error))
        if schedule is None:
            return cpb.ReportReply()
        return cpb.ReportReply(has_schedule=True, schedule=schedule_to_proto(schedule))


class CoordinatorServer:
    """The coordinator served over gRPC at `address` (mutual TLS with `tls`)."""

    def __init__(self, coordinator: Coordinator, address: str, tls: TlsFiles | None = None) -> None:
        self.coordinator = coordinator
        options = [
            ("grpc.max_receive_message_length", MAX_REPORT_BYTES),
            ("grpc.max_send_message_length", MAX_REPORT_BYTES),
        ]
        # unary calls of small messages: few threads, and callers beyond the limit are
        # refused (RESOURCE_EXHAUSTED) instead of queued
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="coordinator"),
            options=options,
            maximum_concurrent_rpcs=64,
        )
        cpb_grpc.add_CoordinatorServicer_to_server(_Service(coordinator), self._server)
        if tls is None:
            port = self._server.add_insecure_port(address)
        else:
            port = self._server.add_secure_port(address, server_credentials(tls))
        if port == 0:
            raise OSError(f"coordinator: cannot listen on {quoted(address)}")
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{port}"
        self._server.start()

    def stop(self, grace: float = 0.0) -> None:
        self._server.stop(grace).wait()

    def wait(self) -> None:
        self._server.wait_for_termination()
