"""A hostile caller against a served coordinator (issue 23, findings 1, 3 and 4), over real gRPC.

Each test is one finding reproduced the way it was observed (forged reports from a process on
the same host, idle streams), and checks what must hold now: the coordinator keeps serving
honest peers, one report decides nothing for the others, and what it publishes stays in range.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import grpc
import pytest
import torch
from torch import nn

from gossipcomp.coordinator import (
    REPORT_LIMITS,
    REPORTS_IN_FLIGHT,
    SERVICE_NAME,
    Coordinator,
    CoordinatorServer,
)
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import coordinator_pb2_grpc as cpb_grpc
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import MAX_EPOCH, MAX_STAGED
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION
from gossipcomp.transport.serving import ServingLimits
from gossipcomp.workload.models import model_signature

RING4 = build_topology("ring", n=4)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3))


MODEL = _model()
SIGNATURE = model_signature(MODEL)
TENSORS = [cpb.TensorSize(name=n, numel=p.numel()) for n, p in MODEL.named_parameters()]
NAMES = {t.name for t in TENSORS}


def _report(sender: int, round: int, **fields) -> cpb.PeerReport:
    base = dict(
        protocol_version=PROTOCOL_VERSION,
        sender=sender,
        topology_hash=RING4.hash,
        model_signature=SIGNATURE,
        round=round,
        compute_seconds=0.01,
        compressor="sign",
        tensors=TENSORS,
    )
    return cpb.PeerReport(**{**base, **fields})


@contextmanager
def _served(
    coordinator: Coordinator, limits: ServingLimits = REPORT_LIMITS
) -> Iterator[tuple[CoordinatorServer, grpc.Channel]]:
    server = CoordinatorServer(coordinator, "127.0.0.1:0", limits=limits)
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, channel
    finally:
        channel.close()
        server.stop()


def _honest_round(report, round: int, epoch: int = 0) -> list[cpb.ReportReply]:
    return [report(_report(r, round, schedule_epoch=epoch), timeout=5) for r in range(4)]


def _idle(stop: threading.Event) -> Iterator[bytes]:
    yield from ()
    stop.wait()


def test_idle_streams_do_not_stall_the_coordinator():
    """Finding 3. Observed: 4 Report streams that sent headers and never the request made every
    honest report time out (a sync server of 4 threads). Now 32 such streams on 8 connections
    leave honest reports answered long before the server cuts them at its header deadline
    (15 s here: stalled honest reports would wait that long, slow ones on a loaded machine
    do not)."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    stop = threading.Event()
    own = [("grpc.use_local_subchannel_pool", 1)]
    limits = replace(REPORT_LIMITS, header_timeout=15.0, call_timeout=20.0)
    with _served(coordinator, limits) as (server, channel):
        strangers = [grpc.insecure_channel(server.address, own) for _ in range(8)]
        try:
            idle = [
                strangers[i % 8]
                .stream_unary(f"/{SERVICE_NAME}/Report")
                .future(_idle(stop), timeout=60)
                for i in range(32)
            ]
            time.sleep(0.5)
            report = cpb_grpc.CoordinatorStub(channel).Report
            started = time.monotonic()
            for round in (4, 6, 8):
                _honest_round(report, round)
            assert time.monotonic() - started < 12.0
            assert len(coordinator.published) == 1  # every peer reported: it planned
            errors = [call.exception(40) for call in idle]
            assert {e and e.code() for e in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        finally:
            stop.set()
            for stranger in strangers:
                stranger.close()


def test_one_connection_rotating_senders_holds_no_more_reports():
    """Review of issue 23. Observed: the report slots were keyed on the claimed sender before it
    was checked, so one connection claiming a new sender per call held as many reports in
    flight as it had streams. Now a sender counts only once it is a peer of the topology: any
    other claim shares its connection's REPORTS_IN_FLIGHT. No report is handled until the
    gate opens; the ones refused for want of a slot come back meanwhile."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    gate = threading.Event()
    receive = coordinator.receive

    def gated(request: cpb.PeerReport):
        gate.wait(60)
        return receive(request)

    coordinator.receive = gated  # type: ignore[method-assign]
    own = [("grpc.use_local_subchannel_pool", 1)]
    with _served(coordinator) as (server, _):
        with grpc.insecure_channel(server.address, own) as channel:
            report = cpb_grpc.CoordinatorStub(channel).Report
            bound = 4 * REPORTS_IN_FLIGHT + REPORTS_IN_FLIGHT
            try:
                members = [report.future(_report(s % 4, 10), timeout=60) for s in range(12)]
                strangers = [report.future(_report(s, 10), timeout=60) for s in range(4, 20)]
                calls = [*members, *strangers]
                deadline = time.monotonic() + 30
                while sum(c.done() for c in calls) < len(calls) - bound:
                    assert time.monotonic() < deadline, (
                        f"{len(calls) - sum(c.done() for c in calls)} reports in flight on one "
                        f"connection, expected at most {bound}"
                    )
                    time.sleep(0.05)
                refused = [c.exception() for c in calls if c.done()]
                assert sum(c.done() for c in calls) == len(calls) - bound
            finally:
                gate.set()
            assert {e and e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "reports: at most 2 in flight per caller" in refused[0].details()
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
            codes = [
                [c.exception(30) and c.exception().code() for c in g] for g in (members, strangers)
            ]
            assert codes[0].count(exhausted) == len(members) - 4 * REPORTS_IN_FLIGHT
            # the strangers' reports held are refused once checked, naming the sender
            assert codes[1].count(exhausted) == len(strangers) - REPORTS_IN_FLIGHT
            assert codes[1].count(grpc.StatusCode.PERMISSION_DENIED) == REPORTS_IN_FLIGHT


def test_a_report_claiming_a_far_round_moves_no_schedule_far():
    """Finding 1, coordinator side. Observed: one report claiming round 2^53-1001 was believed
    and the schedule was republished effective at round 9,007,199,254,740,055. Now a claim is
    believed only up to what time allows since that peer's last report, a peer never heard
    before is bounded from the round the others agree on, and schedules count from the round
    two peers agree on."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    with _served(coordinator) as (_, channel):
        report = cpb_grpc.CoordinatorStub(channel).Report
        for round in (10, 12):
            _honest_round(report, round)
        first = coordinator.published[0]
        assert first.effective_round < 100
        with pytest.raises(grpc.RpcError) as refused:  # no room to publish above it
            report(_report(0, 2**53 - 1001), timeout=5)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("round: expected an integer in [0, ")
        report(_report(0, 2**52), timeout=5)  # in range, but not where peer 0 can be
        coordinator.publish([TensorGroup(tuple(sorted(NAMES)), "sign")], "hand")
        _honest_round(report, 14, epoch=first.epoch)
        effective = [(s.epoch, s.effective_round) for s in coordinator.published]
        assert len(effective) >= 2 and all(e < 200 for _, e in effective), effective
    fresh = Coordinator(RING4, planner="single", report_every=2)  # a liar heard first
    fresh.receive(_report(0, 2**52))
    for sender in (1, 2, 3):
        fresh.receive(_report(sender, 40))
    fresh.receive(_report(0, 40))
    assert [s.effective_round < 200 for s in fresh.published] == [True]


@pytest.mark.parametrize(
    ("field", "value"),
    [("schedule_epoch", MAX_EPOCH), ("round", 2**53 - 1), ("schedule_epoch", MAX_EPOCH - 5)],
)
def test_values_that_would_overflow_a_publication_are_refused_at_the_door(field, value):
    """Finding 4. Observed: a report with schedule_epoch 2^31-1 or round 2^53-1 made every later
    publication fail with INTERNAL. Now it is refused with INVALID_ARGUMENT naming the field,
    and the honest peers' reports still bring a schedule."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    with _served(coordinator) as (_, channel):
        report = cpb_grpc.CoordinatorStub(channel).Report
        with pytest.raises(grpc.RpcError) as refused:
            hostile = _report(0, 10)
            setattr(hostile, field, value)
            report(hostile, timeout=5)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"{field}: expected an integer in [0, ")
        replies = _honest_round(report, 10)
        assert replies[-1].has_schedule and replies[-1].schedule.epoch == 1


def test_one_report_cannot_push_the_epochs_to_the_end_of_their_range():
    """Finding 4 (epochs). A peer's claimed epoch is believed only up to MAX_STAGED above the
    one two peers agree on: one report of epoch 10^9 does not make the next schedule 10^9+1."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    for sender in range(4):
        coordinator.receive(_report(sender, 10))
    coordinator.receive(_report(0, 12, schedule_epoch=10**9))
    published = coordinator.publish([TensorGroup(tuple(sorted(NAMES)), "sign")], "hand")
    assert published.epoch <= 1 + MAX_STAGED + 1


def test_the_first_report_no_longer_decides_the_model():
    """Finding 4. Observed: one report with a fake model_signature, sent before the peers,
    locked every honest peer out ('differs from the other peers''). Now the model is the one a
    majority of the topology's peers report: every honest report is taken, a plan is made, and
    the fake one is refused once the majority is known."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    with _served(coordinator) as (_, channel):
        report = cpb_grpc.CoordinatorStub(channel).Report
        report(_report(0, 2, model_signature="f" * 64), timeout=5)
        replies = _honest_round(report, 4)
        assert replies[-1].has_schedule
        with pytest.raises(grpc.RpcError) as refused:
            report(_report(2, 6, model_signature="f" * 64), timeout=5)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "is not the model a majority of the peers report" in refused.value.details()


def test_a_fake_tensor_list_never_reaches_a_plan():
    """Finding 4. Observed: fake tensor names in the first report made every plan name unknown
    tensors. Now the tensor list is the majority's: a report sent first as peer 0 with the
    right signature and 10,000 made-up names is outvoted, and the plan names the model's own
    tensors only (made once the real peer 0 reports)."""
    coordinator = Coordinator(RING4, planner="single", report_every=2)
    fake = [cpb.TensorSize(name=f"fake.{i}", numel=1) for i in range(10_000)]
    with _served(coordinator) as (_, channel):
        report = cpb_grpc.CoordinatorStub(channel).Report
        report(_report(0, 2, tensors=fake), timeout=5)
        for sender in (1, 2, 3):
            report(_report(sender, 4), timeout=5)
        assert len(coordinator.published) == 0  # peer 0 has not reported the majority's model
        with pytest.raises(grpc.RpcError) as refused:
            report(_report(0, 4, tensors=fake), timeout=5)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details().startswith("tensors: not the parameters")
        report(_report(0, 4), timeout=5)
        assert len(coordinator.published) == 1
        named = {name for group in coordinator.published[0].groups for name in group.names}
        assert named == NAMES


@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ([cpb.TensorSize(name=f"t{i}", numel=1) for i in range(20_000)], "at most"),
        ([cpb.TensorSize(name=f"{i:04d}" + "x" * 996, numel=1) for i in range(1100)], "characters"),
    ],
)
def test_the_tensor_list_of_a_report_is_bounded(tensors, fragment):
    """Finding 4: the tensor list a report may carry is bounded: 20,000 names (above any
    model's parameter count) or 1.1 million characters of names are refused."""
    coordinator = Coordinator(RING4)
    with _served(coordinator) as (_, channel):
        with pytest.raises(grpc.RpcError) as refused:
            cpb_grpc.CoordinatorStub(channel).Report(_report(0, 2, tensors=tensors), timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (
            refused.value.details().startswith("tensors:") and fragment in refused.value.details()
        )
