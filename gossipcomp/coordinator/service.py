"""The coordinator served over gRPC: the Report RPC, bounded per caller.

The server is built the one way every gossipcomp server is (transport/serving.py): idle calls
hold no thread and are cut at deadlines. A report's checking and the planning it may start
(planning.py) run on a few threads of their own, off the server's event loop.
"""

from __future__ import annotations

import grpc

from gossipcomp.coordinator.planning import Coordinator
from gossipcomp.coordinator.reports import ReportRefused
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.messages import schedule_to_proto
from gossipcomp.schedule.schedule import ScheduleRefused
from gossipcomp.security.tls import TlsFiles, server_credentials
from gossipcomp.transport.serving import (
    AsyncServer,
    BlockingWork,
    CallerSlots,
    Method,
    ServingLimits,
    bounded_handler,
)

MAX_REPORT_BYTES = 16 << 20  # a serialised report (the tensor list dominates)
REPORT_HEADER_TIMEOUT = 5.0  # seconds from a report call's headers to its message
REPORT_CALL_TIMEOUT = 10.0  # seconds one report call may take in all
REPORTS_IN_FLIGHT = (
    2  # per sender of the topology on one connection (any other sender: per connection)
)
# calls in flight on one connection: in-process peers share one connection to the coordinator
REPORT_CALLS_PER_CONNECTION = 64
SERVICE_NAME = "gossipcomp.v1.Coordinator"


class _Service:
    """The Report RPC on the server's event loop: at most REPORTS_IN_FLIGHT calls per sender on
    one connection, the sender counted only once it is a peer of the topology (any other claim
    shares the connection's own REPORTS_IN_FLIGHT), so rotating the claimed sender holds no more;
    the checking and planning run on a few threads of their own."""

    def __init__(self, coordinator: Coordinator, work: BlockingWork) -> None:
        self._coordinator = coordinator
        self._work = work
        self._slots = CallerSlots(REPORTS_IN_FLIGHT, "reports")

    async def Report(
        self, request: cpb.PeerReport, context: grpc.aio.ServicerContext
    ) -> cpb.ReportReply:
        caller: tuple[int | None, str] = (None, context.peer())
        if 0 <= request.sender < self._coordinator.topology.n:
            caller = (request.sender, context.peer())
        async with self._slots.hold(caller, context):
            try:
                schedules = await self._work.run(lambda: self._coordinator.receive(request))
            except ReportRefused as refused:
                await context.abort(refused.code, str(refused))
            except ScheduleRefused as error:  # a plan that cannot be a schedule: a bug, say so
                await context.abort(grpc.StatusCode.INTERNAL, str(error))
        if not schedules:
            return cpb.ReportReply()
        *earlier, newest = schedules
        return cpb.ReportReply(
            has_schedule=True,
            schedule=schedule_to_proto(newest),
            earlier=[schedule_to_proto(s) for s in earlier],
        )


REPORT_LIMITS = ServingLimits(
    max_message_bytes=MAX_REPORT_BYTES,
    max_streams_per_connection=64,  # in-process peers may share one connection
    header_timeout=REPORT_HEADER_TIMEOUT,
    call_timeout=REPORT_CALL_TIMEOUT,
    max_calls_per_caller=REPORT_CALLS_PER_CONNECTION,
)


class CoordinatorServer:
    """The coordinator served over gRPC at `address` (mutual TLS with `tls`), built the one way
    every gossipcomp server is (transport/serving.py)."""

    def __init__(
        self,
        coordinator: Coordinator,
        address: str,
        tls: TlsFiles | None = None,
        limits: ServingLimits = REPORT_LIMITS,
    ) -> None:
        self.coordinator = coordinator
        self._work = BlockingWork(2, "coordinator")
        service = _Service(coordinator, self._work)
        handler = bounded_handler(
            SERVICE_NAME,
            [
                Method(
                    "Report",
                    service.Report,
                    cpb.ReportReply.SerializeToString,
                    cpb.PeerReport.FromString,
                )
            ],
            limits,
        )
        credentials = server_credentials(tls) if tls is not None else None
        try:
            self._server = AsyncServer(
                "coordinator",
                address,
                [handler],
                limits,
                credentials,
                health_services=("", SERVICE_NAME),
            )
        except BaseException:
            self._work.close()
            raise
        self.address = self._server.address

    def stop(self, grace: float = 0.0) -> None:
        self._server.stop(grace)
        self._work.close()

    def wait(self) -> None:
        self._server.wait()
