"""Every schedule reaches every peer before its round (coordinator/planning.py `lacking`).

A report's reply carried only the newest schedule. With the rate controller deciding at every
report, two schedules can be published between two reports of one peer: that peer staged only
the second and ran on under the old epoch while its neighbours were under the first; their
envelopes were refused as "long replaced", the edge went down and a round timed out
(benchmarks/adaptive.py at its defaults: 60 s lost, a peer training alone). A reply now also
carries the schedules published before the newest that still take effect after the peer's
round, oldest first, and the peer stages them in order."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import grpc
import pytest
import torch
from conftest import build_network, reporting_rounds
from helpers import ladder_report
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator import client as client_module
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.coordinator.planning import KEPT_SCHEDULES
from gossipcomp.gossip import Choco
from gossipcomp.peer import Peer
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.messages import schedule_to_proto
from gossipcomp.schedule.schedule import MAX_STAGED, Schedule, ScheduleLate
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION

RING4 = build_topology("ring", n=4)
LATE = 1  # the peer that does not report while the two schedules are published


def _models() -> list[nn.Module]:
    models = []
    for rank in range(4):
        torch.manual_seed(rank)
        models.append(nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3)))
    return models


def _answered(client: CoordinatorClient) -> None:
    """Send a report and stage its reply (the peer's round does not move)."""
    client.after_round()  # sends
    deadline = time.monotonic() + 10
    while client._pending is not None and not client._pending.done():  # noqa: SLF001
        assert time.monotonic() < deadline, "report not answered in 10 s"
        time.sleep(0.01)
    client.after_round()  # takes the reply (and sends the next report)


def test_a_peer_that_missed_a_schedule_between_two_reports_stages_it_before_the_newest():
    peers = build_network(
        RING4, _models(), lambda: Choco(parse_spec("sign"), consensus_step=0.4), "grpc", 8.0
    )
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    coordinator.margin = 20  # room for a reply that comes late on a busy machine
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    clients = [CoordinatorClient(server.address, p, "sign", report_every=1) for p in peers]
    try:
        deadline = time.monotonic() + 20
        while not coordinator.published:  # the planner's first schedule, once all reported
            assert time.monotonic() < deadline, "nothing published in 20 s"
            reporting_rounds(peers, clients, 1)
        first = coordinator.published[-1]
        reporting_rounds(peers, clients, first.effective_round - min(p.round for p in peers) + 1)
        for client in clients:
            _answered(client)
        assert {p.schedules.current.epoch for p in peers} == {first.epoch}
        # two schedules published while the late peer does not report, the others hearing of each
        second = coordinator.publish(first.groups, "single")
        for client in clients:
            if client.peer.rank != LATE:
                _answered(client)
        third = coordinator.publish(first.groups, "single")
        assert first.effective_round < second.effective_round < third.effective_round
        for client in clients:
            _answered(client)
        late = peers[LATE].schedules
        assert [s.epoch for s in late.staged] == [second.epoch, third.epoch]
        reporting_rounds(peers, clients, third.effective_round - peers[0].round + 2)
        for peer in peers:
            took = [(s.epoch, s.effective_round) for s in peer.schedules.history[-3:]]
            assert took == [
                (first.epoch, first.effective_round),
                (second.epoch, second.effective_round),
                (third.epoch, third.effective_round),
            ], (peer.rank, took)
            assert not any(peer.stats.failed_exchanges.values()), peer.stats.failed_exchanges
    finally:
        for client in clients:
            client.close()
        server.stop()
        for peer in peers:
            peer.close()


def test_a_reply_carries_what_the_peer_lacks_that_can_still_take_effect_at_it():
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    published = [coordinator.publish((), "single") for _ in range(MAX_STAGED + 2)]
    rounds = [s.effective_round for s in published]
    assert rounds == sorted(rounds) and len(set(rounds)) == len(rounds)
    newest = published[-1]
    # holding nothing at round 0: the newest and the MAX_STAGED - 1 before it
    assert coordinator.lacking(0, 0) == tuple(published[-MAX_STAGED:])
    # holding the third: what came after it
    assert coordinator.lacking(published[2].epoch, 0) == tuple(published[3:])
    # past the fourth's round: that one and those before it cannot take effect any more
    assert coordinator.lacking(0, published[3].effective_round) == tuple(published[4:])
    # the newest even when its round has passed (the peer refuses it, and it comes again)
    assert coordinator.lacking(0, newest.effective_round + 5) == (newest,)
    assert coordinator.lacking(newest.epoch, 0) == ()


def test_the_coordinator_keeps_a_bounded_history_and_still_answers_from_it():
    """Adaptive levels publish up to one schedule a report interval: the coordinator keeps the
    newest KEPT_SCHEDULES (the list grew for the whole run before) and a reply is still the
    newest plus the earlier ones a peer lacks, and epochs go on counting."""
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    published = [coordinator.publish((), "single") for _ in range(KEPT_SCHEDULES + 10)]
    assert len(coordinator.published) == KEPT_SCHEDULES
    assert list(coordinator.published) == published[-KEPT_SCHEDULES:]
    assert coordinator.published[-1].epoch == KEPT_SCHEDULES + 10
    assert coordinator.lacking(0, 0) == tuple(published[-MAX_STAGED:])
    assert coordinator.lacking(published[-2].epoch, 0) == (published[-1],)


def _schedule(epoch: int, round: int) -> cpb.Schedule:
    return schedule_to_proto(Schedule(epoch, round))


def _reply(newest: int, rounds: tuple[int, ...]) -> cpb.ReportReply:
    """A reply carrying epochs 1..`newest`, taking effect at `rounds` (one each)."""
    schedules = [_schedule(epoch, r) for epoch, r in enumerate(rounds, start=1)]
    assert len(schedules) == newest
    return cpb.ReportReply(has_schedule=True, schedule=schedules[-1], earlier=schedules[:-1])


def _take(client: CoordinatorClient, reply: cpb.ReportReply) -> None:
    """Have `client` look at `reply` as at an answered report."""
    done: Future[cpb.ReportReply] = Future()
    done.set_result(reply)
    client._take(done)  # noqa: SLF001


@contextmanager
def _peer_zero_client() -> Iterator[tuple[list[Peer], CoordinatorClient]]:
    """Four peers in memory and peer 0's coordinator client (no coordinator behind it: replies
    are handed over with `_take`), closed afterwards."""
    peers = build_network(
        RING4, _models(), lambda: Choco(parse_spec("sign"), consensus_step=0.4), "memory"
    )
    client = CoordinatorClient("127.0.0.1:1", peers[0], "sign", report_every=1)
    try:
        yield peers, client
    finally:
        client.close()
        for peer in peers:
            peer.close()


def test_a_reply_with_more_earlier_schedules_than_can_wait_is_refused_and_nothing_staged():
    with _peer_zero_client() as (peers, client):
        reply = cpb.ReportReply(
            has_schedule=True,
            schedule=_schedule(MAX_STAGED + 1, 50),
            earlier=[_schedule(epoch, 10 + epoch) for epoch in range(1, MAX_STAGED + 1)],
        )
        _take(client, reply)
        assert peers[0].schedules.staged == ()
        assert client.refused and f"expected at most {MAX_STAGED - 1}" in client.refused[-1]
        # and a reply within the bound stages each in order
        _take(client, _reply(3, (20, 30, 40)))
        assert [(s.epoch, s.effective_round) for s in peers[0].schedules.staged] == [
            (1, 20),
            (2, 30),
            (3, 40),
        ]


def test_a_reply_whose_schedules_are_out_of_order_is_refused_and_nothing_staged():
    """A hostile reply listing epoch 3 before epoch 2: staged in the order given, the peer
    took 3, skipped 2 as held and took 4, never checking what it was sent."""
    with _peer_zero_client() as (peers, client):
        reply = cpb.ReportReply(
            has_schedule=True,
            schedule=_schedule(4, 40),
            earlier=[_schedule(3, 30), _schedule(2, 20)],
        )
        _take(client, reply)
        assert peers[0].schedules.staged == ()
        assert client.refused == [
            "a reply whose schedules come in epochs [3, 2, 4]: expected each newer than the one "
            "before (oldest first)"
        ]


@pytest.mark.parametrize("held", [1, 2])
def test_earlier_schedules_the_peer_already_holds_are_skipped_quietly(held):
    with _peer_zero_client() as (peers, client):
        for epoch in range(1, held + 1):
            peers[0].apply(Schedule(epoch, 10 * (epoch + 1)))
        _take(client, _reply(3, (20, 30, 40)))
        assert [s.epoch for s in peers[0].schedules.staged] == [1, 2, 3]
        assert client.refused == []


def _report(sender: int, round: int, epoch: int, slower: float) -> cpb.PeerReport:
    """A ring4 peer's report at `round` holding `epoch` (helpers.ladder_report)."""
    return ladder_report(RING4, sender, round, slower, schedule_epoch=epoch)


def test_levels_are_decided_only_while_a_peer_can_hold_one_more_schedule():
    """Links 30x slower every other two rounds, every peer reporting every round: the
    coordinator would have had MAX_STAGED schedules waiting at once (a peer refuses the last
    one); it now decides again once fewer than MAX_STAGED - 1 wait."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    most = 0
    for round in range(4, 60):
        slower = 30.0 if (round // 2) % 2 else 1.0
        for rank in range(4):
            held = coordinator.published[-1].epoch if coordinator.published else 0
            coordinator.receive(_report(rank, round, held, slower))
            lead = max(r.round for r in coordinator._members.values())  # noqa: SLF001
            most = max(most, sum(s.effective_round > lead for s in coordinator.published))
    assert len({s.links for s in coordinator.published}) >= 3  # levels did move
    assert most <= MAX_STAGED - 1


def test_a_schedule_that_comes_late_is_taken_from_the_next_round_and_reported():
    """A coordinator's schedule that comes after the peer's round is taken from the peer's
    next round (the others are in it: waiting for it again left a peer alone, ahead of every
    republication, out of the network for good; CI at stop 43), and the report's late_epoch
    says so; refused_epoch names only a schedule refused as unusable (a tensor the model
    lacks), which is staged nowhere."""
    with _peer_zero_client() as (peers, client):
        peers[0].round = 5  # between rounds 4 and 5: round 4 has begun, 5 not yet
        _take(client, cpb.ReportReply(has_schedule=True, schedule=_schedule(1, 4)))
        assert client.refused == []
        (staged,) = peers[0].schedules.staged
        assert (staged.epoch, staged.effective_round) == (1, 5)
        assert peers[0].schedules.taken_late == {1}
        request = client._request()  # noqa: SLF001 (the report it sends)
        assert (request.late_epoch, request.refused_epoch, request.schedule_epoch) == (1, 0, 1)
        ghost = Schedule(2, 20, (TensorGroup(("ghost.weight",), "sign"),))
        _take(client, cpb.ReportReply(has_schedule=True, schedule=schedule_to_proto(ghost)))
        assert len(client.refused) == 1 and "unknown" in client.refused[0]
        assert client._request().refused_epoch == 2  # noqa: SLF001
        assert peers[0].schedules.staged == (staged,)
        assert peers[0].schedules.due(5) == staged  # in force from the round it runs next
        assert peers[0].stats.late_epochs == {1}


def test_a_peer_s_own_schedule_call_still_refuses_one_whose_round_passed():
    """Peer.apply without `late` (a custom loop's own schedule) keeps refusing a schedule
    whose round has passed, naming it, and stages nothing."""
    with _peer_zero_client() as (peers, _):
        peers[0].round = 5
        with pytest.raises(ScheduleLate, match="takes effect at round 4, expected a round af"):
            peers[0].apply(Schedule(1, 4))
        assert peers[0].schedules.staged == () and peers[0].schedules.taken_late == set()


def test_a_schedule_of_the_round_a_peer_runs_next_is_on_time_until_that_round_begins():
    """Between two rounds a peer at round r has exchanged nothing of round r: a schedule from
    round r that comes then is staged on time, and the peer switches with the others (taking it
    late, from r + 1, cut it off from every neighbour at round r: CI at stop 47, one late
    reply isolated a peer for 15 rounds). Once the inbox has opened round r (exchanges of it
    began), the same schedule is late."""
    with _peer_zero_client() as (peers, client):
        peers[0].round = 5
        _take(client, cpb.ReportReply(has_schedule=True, schedule=_schedule(1, 5)))
        (staged,) = peers[0].schedules.staged
        assert (staged.epoch, staged.effective_round) == (1, 5)
        assert peers[0].schedules.taken_late == set()
        assert client._request().late_epoch == 0  # noqa: SLF001 (no miss to report)
        peers[0].transport.inbox.open_round(5)  # round 5's exchanges have begun
        with pytest.raises(ScheduleLate, match="takes effect at round 5, expected a round af"):
            peers[0].apply(Schedule(2, 5))
        _take(client, cpb.ReportReply(has_schedule=True, schedule=_schedule(2, 5)))
        assert [(s.epoch, s.effective_round) for s in peers[0].schedules.staged] == [(1, 5), (2, 6)]
        assert peers[0].schedules.taken_late == {2}


def test_a_coordinator_that_refuses_the_reports_is_said_once_loudly_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer of another protocol version than its coordinator's (one upgraded without the
    other) is refused every report: that is said once, as an error naming the refusal and the
    coordinator's reason, not as a coordinator "not answering" (which would come back)."""
    peers = build_network(
        RING4, _models(), lambda: Choco(parse_spec("sign"), consensus_step=0.4), "memory"
    )
    server = CoordinatorServer(Coordinator(RING4, planner="single", report_every=1), "127.0.0.1:0")
    monkeypatch.setattr(client_module, "PROTOCOL_VERSION", PROTOCOL_VERSION - 1)
    client = CoordinatorClient(server.address, peers[0], "sign", report_every=1)
    try:
        with caplog.at_level(logging.WARNING, logger=client_module.log.name):
            for _ in range(3):
                _answered(client)
        said = [r for r in caplog.records if r.name == client_module.log.name]
        assert len(said) == 1, [r.getMessage() for r in said]
        message = said[0].getMessage()
        assert said[0].levelno == logging.ERROR
        assert "refuses this peer's reports (FAILED_PRECONDITION" in message
        assert (
            f"protocol_version: expected {PROTOCOL_VERSION}, got {PROTOCOL_VERSION - 1}" in message
        )
        assert "not answering" not in message
        assert peers[0].schedules.newest.epoch == 0  # nothing staged from a refusal
    finally:
        client.close()
        server.stop()
        for peer in peers:
            peer.close()


class _Refusal(grpc.RpcError):
    """A refused call as grpc raises it: a status code and the server's details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_coordinators_refusal_of_any_length_is_quoted_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The refusal's details come from the network: a coordinator answering with 100,000
    characters gets a quote of a few hundred in the peer's log, not the whole text."""
    with _peer_zero_client() as (_, client):
        refused: Future[cpb.ReportReply] = Future()
        refused.set_exception(_Refusal(grpc.StatusCode.PERMISSION_DENIED, "x" * 100_000))
        with caplog.at_level(logging.ERROR, logger=client_module.log.name):
            client._take(refused)  # noqa: SLF001
        (record,) = [r for r in caplog.records if r.name == client_module.log.name]
        assert "PERMISSION_DENIED" in record.getMessage()
        assert "(100000 characters)" in record.getMessage()
        assert len(record.getMessage()) < 500
