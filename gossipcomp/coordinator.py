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
3 x report_every + 2 rounds leave room for a peer a little ahead of the others.

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
from gossipcomp.schedule.schedule import MAX_EPOCH, MAX_ROUND, Schedule, ScheduleRefused
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


def schedule_to_proto(schedule: Schedule) -> cpb.Schedule:
    return cpb.Schedule(
        epoch=schedule.epoch,
        effective_round=schedule.effective_round,
        planner=schedule.planner,
        groups=[cpb.ScheduleGroup(names=g.names, compressor=g.compressor) for g in schedule.groups],
    )


def schedule_from_proto(message: cpb.Schedule) -> Schedule:
    """A received schedule; ScheduleRefused naming the field when out of range (the peer
    checks it against its model when staging it)."""
    groups = tuple(TensorGroup(tuple(g.names), g.compressor) for g in message.groups)
    return Schedule(message.epoch, message.effective_round, groups, message.planner)


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
    ) -> None:
        make_planner(planner)  # fails naming the planners that exist
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
            self._maybe_plan()
            newest = self.published[-1] if self.published else None
        if newest is not None and newest.epoch > report.epoch:
            return newest
        return None

    def publish(self, groups: Sequence[TensorGroup], planner: str) -> Schedule:
        """A new schedule of `groups`, in force `margin` rounds after the furthest round heard
        (peers check it when they stage it)."""
        with self._lock:
            return self._publish(tuple(groups), planner)

    def _publish(self, groups: tuple[TensorGroup, ...], planner: str) -> Schedule:
        newest = self.published[-1] if self.published else None
        epoch = max(self._highest_epoch, newest.epoch if newest else 0) + 1
        effective = self._lead + self.margin
        if newest is not None:
            effective = max(effective, newest.effective_round + 1)
        schedule = Schedule(epoch, effective, groups, planner)
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
            self._publish(groups, self.planner)

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
