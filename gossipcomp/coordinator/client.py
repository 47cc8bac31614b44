"""A peer's side of the coordinator: report every few rounds, stage the schedules it sends.

Nothing here blocks training: a report is sent after a round as a grpc.aio call on the
process's one event loop (transport/serving.py's `PROCESS_LOOP`, where the peer's pushes run
already), and its reply is looked at after a later round. Not as a sync gRPC future: on a
channel with no call in flight, grpcio starts a thread to poll each future's completion and
waits until that thread runs, milliseconds a report on a busy machine (ring4 in one process
reporting every round: 40 ms a round with futures, 30 ms without); and no longer from a
thread of its own making blocking calls, one more thread per peer contending for the
interpreter lock (the shaped adaptive runs of docs/benchmarks.md, issue 24: a reporting
peer's time outside gossip 6.3-8.6 ms a round on the loop in seven runs, 7.6-9.5 from the
thread in six: within the runs' noise; 4.5 without a coordinator).
A coordinator that cannot be reached costs a warning (once until
it answers again) and the peer trains on with the schedules it has; one that sends a schedule
the peer refuses (`ScheduleRefused`) costs an error naming why, and the peer keeps its current
schedule. One that comes after its round (a reply slower than the coordinator's margin, or this
peer running ahead while alone) is still taken, from the peer's next round: the others are in
it already, and waiting for a republication a peer alone outruns again kept it out of the
network for good (tests/test_torchrun_membership.py, CI at stop 43). Its report's `late_epoch`
tells the coordinator, which widens its margin. Schedules are staged from the training thread,
as `Peer.apply` requires.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future

import grpc
import torch

from gossipcomp.gossip.base import LinkLeveled, PeerLeveled
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.progress import LossWindow
from gossipcomp.peer import Peer
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import coordinator_pb2_grpc as cpb_grpc
from gossipcomp.schedule import CompressorCost, measure_compressor
from gossipcomp.schedule.critical import CriticalPhase
from gossipcomp.schedule.messages import schedule_from_proto
from gossipcomp.schedule.schedule import MAX_STAGED, ScheduleRefused
from gossipcomp.security.tls import TlsFiles, channel_credentials
from gossipcomp.transport.base import PROTOCOL_VERSION
from gossipcomp.transport.serving import PROCESS_LOOP

log = logging.getLogger("gossipcomp.coordinator_client")  # the name it had as one module

REPORT_TIMEOUT = 5.0  # seconds a report may take before it counts as unanswered
SAMPLES_SENT = 16  # newest transfers of each link sent in one report
MEASURED_SIZES = (1 << 10, 1 << 14, 1 << 17)  # buffer sizes timed for the compressor's cost
# a coordinator that comes back is found within two seconds (gRPC's default backoff grows
# to two minutes)
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
# a coordinator that answers a report with one of these refuses it for what the peer is (its
# protocol version, topology, model, rank or key), which no retry changes
REFUSED_REPORT = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class CoordinatorClient:
    """Reports `peer`'s measurements every `report_every` rounds and stages what comes back."""

    def __init__(
        self,
        address: str,
        peer: Peer,
        compressor: str | None,
        *,
        report_every: int = 10,
        tls: TlsFiles | None = None,
    ) -> None:
        checked_integer("report_every", report_every, 1, 10**6)
        self.peer = peer
        self.report_every = report_every
        self.compressor = compressor or ""
        self._cost = (
            measure_compressor(self.compressor, list(MEASURED_SIZES), repeats=3)
            if compressor
            else CompressorCost(0.0, 0.0)
        )
        credentials = None if tls is None else channel_credentials(tls)
        self._loop = PROCESS_LOOP.lease()
        try:
            self._channel = self._loop.run(_open_channel(address, credentials))
        except BaseException:
            self._loop.close()
            raise
        self._report = cpb_grpc.CoordinatorStub(self._channel).Report
        self._signature = peer.signature
        algorithm = peer.algorithm
        self._levels = (
            algorithm.level_costs(peer.gossiped)
            if isinstance(algorithm, LinkLeveled | PeerLeveled)
            else None
        )
        self._pending: Future[cpb.ReportReply] | None = None
        self._unreachable = False
        self._refused_report: grpc.StatusCode | None = None  # said once until it answers
        self.phase = CriticalPhase()  # reported: the coordinator may boost a critical peer
        # reported: an adaptive coordinator caps levels by them (a trainer hands in its own
        # window, kept in its checkpoints: PeerTrainer.attach)
        self.losses = LossWindow()
        self.refused: list[str] = []  # why schedules were refused, once per epoch
        self._refused_epoch: int | None = None
        self._unusable_epoch = 0  # reported: the newest refused
        self._late_epoch = 0  # reported: the newest that came after its round (taken late)

    def observe_gradients(self, model: torch.nn.Module) -> None:
        """Note each parameter's gradient norm after this round's local steps (Accordion's
        critical-phase signal, schedule/critical.py)."""
        with torch.no_grad():
            self.phase.observe(
                [float(p.grad.norm()) if p.grad is not None else 0.0 for p in model.parameters()]
            )

    def observe_loss(self, loss: float) -> None:
        """Note one local step's minibatch loss, 0 to 1e6 (an adaptive coordinator raises
        levels as the loss falls, levels/progress.py; a loss outside that range is not counted,
        and while most peers' loops never call this, levels are not capped)."""
        self.losses.observe(loss)

    def after_round(self) -> None:
        """Look at an answered report, then send the next one when it is due."""
        self.losses.end_round()
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            self._take(pending)
        due = self.peer.round % self.report_every == 0
        # a peer outside a live network does no rounds: it reports until it is admitted
        if self._pending is None and (due or not self.peer.member):
            self._pending = self._loop.submit(self._send(self._request()))

    async def _send(self, report: cpb.PeerReport) -> cpb.ReportReply:
        """One report, on the loop (a grpc.aio call belongs to the loop it starts on)."""
        return await self._report(report, timeout=REPORT_TIMEOUT)

    def _take(self, answered: Future[cpb.ReportReply]) -> None:
        try:
            reply = answered.result()
        except grpc.RpcError as error:
            code = error.code()
            if code in REFUSED_REPORT and code != self._refused_report:
                # it answers, and will go on refusing: another version, topology or model
                log.error(
                    "peer %d: the coordinator refuses this peer's reports (%s: %s), so no "
                    "schedule will reach it; training on with schedule epoch %d",
                    self.peer.rank,
                    code.name,
                    quoted(error.details() or ""),
                    self.peer.schedules.newest.epoch,
                )
                self._refused_report = code
            elif code not in REFUSED_REPORT and not self._unreachable:
                log.warning(
                    "peer %d: coordinator not answering (%s); training on with schedule epoch %d",
                    self.peer.rank,
                    code.name,
                    self.peer.schedules.newest.epoch,
                )
            self._unreachable = True
            return
        self._refused_report = None
        if self._unreachable:
            log.warning("peer %d: coordinator answering again", self.peer.rank)
        self._unreachable = False
        if not reply.has_schedule or reply.schedule.epoch == self._refused_epoch:
            return  # nothing new, or the schedule this peer already refused (said once)
        if len(reply.earlier) > MAX_STAGED - 1:
            self._refuse(
                reply.schedule.epoch,
                f"a reply with {len(reply.earlier)} earlier schedules: expected at most "
                f"{MAX_STAGED - 1} (no more wait at a peer)",
            )
            return
        epochs = [message.epoch for message in (*reply.earlier, reply.schedule)]
        if any(later <= before for before, later in itertools.pairwise(epochs)):
            self._refuse(
                reply.schedule.epoch,
                f"a reply whose schedules come in epochs {epochs}: expected each newer than "
                "the one before (oldest first)",
            )
            return
        for message in (*reply.earlier, reply.schedule):
            if message.epoch <= self.peer.schedules.newest.epoch:
                continue  # held already: staged from a neighbour since the report went out
            try:
                schedule = schedule_from_proto(message)
                staged = self.peer.apply(schedule, late=True)
            except ScheduleRefused as refused:
                self._refuse(message.epoch, str(refused))
                continue
            if staged.effective_round != schedule.effective_round:
                self._late_epoch = staged.epoch
                log.warning(
                    "peer %d: schedule epoch %d (from round %d) came at round %d; in force "
                    "here from round %d",
                    self.peer.rank,
                    staged.epoch,
                    schedule.effective_round,
                    self.peer.round,
                    staged.effective_round,
                )

    def _refuse(self, epoch: int, why: str) -> None:
        """Keep the current schedules and say why (the newest refused epoch is not tried
        again, and is reported as unusable, so the coordinator does not take a report past
        its round for a miss)."""
        self._refused_epoch = epoch
        self._unusable_epoch = max(self._unusable_epoch, epoch)
        self.refused.append(why)
        log.error("peer %d: refused the coordinator's schedule: %s", self.peer.rank, why)

    def _request(self) -> cpb.PeerReport:
        peer = self.peer
        stats = peer.stats
        links, sends = [], []
        for neighbour in peer.topology.neighbors(peer.rank):
            for log_, out in ((peer.transfers, links), (peer.sends, sends)):
                samples = log_.samples(neighbour)[-SAMPLES_SENT:]
                if samples:
                    out.append(
                        cpb.LinkSamples(
                            neighbour=neighbour,
                            bytes=[b for b, _ in samples],
                            seconds=[s for _, s in samples],
                        )
                    )
        levels = self._levels
        return cpb.PeerReport(
            protocol_version=PROTOCOL_VERSION,
            sender=peer.rank,
            topology_hash=peer.topology.hash,
            model_signature=self._signature,
            round=peer.round,
            schedule_epoch=peer.schedules.newest.epoch,
            compute_seconds=stats.compute_seconds / max(1, stats.rounds),
            compressor_fixed_seconds=self._cost.fixed_s,
            compressor_element_seconds=self._cost.per_element_s,
            compressor=self.compressor,
            tensors=[cpb.TensorSize(name=name, numel=p.numel()) for name, p in peer.gossiped],
            links=links,
            sends=sends,
            level_costs=[]
            if levels is None
            else [
                cpb.LevelCost(level=level, bytes_per_round=nbytes)
                for level, nbytes in sorted(levels.bytes_per_round.items())
            ],
            exchanges_per_round=0 if levels is None else levels.exchanges_per_round,
            critical=self.phase.critical,
            joining=peer.awaiting_admission,
            refused_epoch=self._unusable_epoch,
            late_epoch=self._late_epoch,
            initial_loss=self.losses.initial,
            loss=self.losses.recent,
        )

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()  # a report in flight is cancelled on the loop
        try:
            self._loop.run(self._channel.close())
        finally:
            self._loop.close()


async def _open_channel(
    address: str, credentials: grpc.ChannelCredentials | None
) -> grpc.aio.Channel:
    """The coordinator's channel, made on the loop its calls will run on."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=RECONNECT)
    return grpc.aio.secure_channel(address, credentials, options=RECONNECT)
