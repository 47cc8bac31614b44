"""Live membership decided by a coordinator, over real gRPC: a peer that stops is removed after
the timeout (the others' graph is rebuilt over the rest and their rounds stop losing exchanges),
it comes back from its checkpoint and is admitted again, a fifth rank joins and trains; the rule refuses a report
speaking for another peer, strangers and floods of joins."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from helpers import mlp_models

from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.coordinator.membership import MemberLiveness
from gossipcomp.coordinator.reports import ReportRefused
from gossipcomp.gossip import DPSGD
from gossipcomp.peer import Peer
from gossipcomp.peer.links import Backoff
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.schedule import MAX_STAGED
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION

REPORT_EVERY = 2
TIMEOUT = 4.0  # seconds of silence before the coordinator removes a member (> 2 round timeouts)
ROUND_TIMEOUT = 1.5


class Running:
    """One peer training in its own thread: gossip, report, a short pause, until stopped."""

    def __init__(self, peer: Peer, coordinator: str) -> None:
        self.peer = peer
        self.client = CoordinatorClient(coordinator, peer, None, report_every=REPORT_EVERY)
        self.round_seconds: list[tuple[int, float]] = []  # (round, seconds) of each round
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                start, before = time.monotonic(), self.peer.round
                self.peer.gossip()
                if self.peer.round > before:
                    self.round_seconds.append((self.peer.round, time.monotonic() - start))
                self.client.after_round()
                time.sleep(0.01)
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), f"peer {self.peer.rank} did not stop"
        self.client.close()
        self.peer.close()
        if self.error is not None:
            raise self.error


def _wait(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.05)


def _peer(topology, rank, model, address="127.0.0.1:0", joining=False) -> Peer:
    return Peer.over_grpc(
        model,
        topology,
        rank,
        DPSGD(),
        bind=address,
        round_timeout=ROUND_TIMEOUT,
        backoff=Backoff(first=0.05, longest=0.3),
        joining=joining,
    )


def _started(peers: list[Peer], addresses: dict[int, str], coordinator: str) -> dict[int, Running]:
    """`peers` handshaken together (each in a thread), then each training and reporting."""
    threads = [threading.Thread(target=p.start, args=(20, addresses)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return {p.rank: Running(p, coordinator) for p in peers}


def test_a_dead_peer_is_removed_comes_back_and_a_fifth_rank_joins():
    topology = build_topology("ring", n=5, members=[0, 1, 2, 3])
    models = mlp_models(6, hidden=8)
    coordinator = Coordinator(
        topology, planner="per-tensor", report_every=REPORT_EVERY, member_timeout=TIMEOUT
    )
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    peers = [_peer(topology, r, models[r]) for r in range(5)]  # rank 4 waits to join
    addresses = {p.rank: p.address for p in peers}
    running = _started(peers[:4], addresses, server.address)
    try:
        _wait(lambda: min(r.peer.round for r in running.values()) >= 10, 60, "10 rounds")
        # rank 3 stops for good: after the timeout it is removed, the ring is over 0, 1, 2
        stopped = running.pop(3)
        stopped.stop()
        saved = stopped.peer.state_dict()  # its checkpoint, as --checkpoint-dir keeps it
        _wait(lambda: coordinator.members == (0, 1, 2), 60, "rank 3 removed")
        _wait(
            lambda: all(running[r].peer.members == (0, 1, 2) for r in (0, 1, 2)),
            60,
            "the removal in force at ranks 0, 1, 2",
        )
        third = pytest.approx(1 / 3)
        for r in (0, 1, 2):  # the 3-ring's weights, renormalised: nobody's weight is on rank 3
            peer = running[r].peer
            assert peer._membership.row(peer.round) == {j: third for j in (0, 1, 2) if j != r}
        failed = {r: sum(running[r].peer.stats.failed_exchanges.values()) for r in (0, 1, 2)}
        start = {r: running[r].peer.round for r in (0, 1, 2)}
        _wait(lambda: all(running[r].peer.round >= start[r] + 20 for r in (0, 1, 2)), 60, "20")
        for r in (0, 1, 2):  # rounds after the removal lose no exchange and wait no timeout
            assert sum(running[r].peer.stats.failed_exchanges.values()) == failed[r]
            later = [s for n, s in running[r].round_seconds if n > start[r]]
            assert max(later) < ROUND_TIMEOUT / 2

        # rank 3 comes back at its address from its checkpoint, joining: admitted again, it
        # gossips with 0 and 2
        back = _peer(topology, 3, mlp_models(4, hidden=8)[0], addresses[3], joining=True)
        back.load_state_dict(saved)
        for p, q in zip(back.model.parameters(), stopped.peer.model.parameters(), strict=True):
            assert torch.equal(p, q)
        back.start(20, addresses)
        assert back.round == saved["round"] and not back.member
        running[3] = Running(back, server.address)
        _wait(lambda: coordinator.members == (0, 1, 2, 3), 60, "rank 3 admitted again")
        _wait(lambda: back.member and back.round > 0, 60, "rank 3 a member in force")
        heard = dict(back.stats.bytes_received)
        _wait(
            lambda: all(back.stats.bytes_received.get(j, 0) > heard.get(j, 0) for j in (0, 2)),
            60,
            "rank 3 gossiping with its ring neighbours 0 and 2",
        )

        # a fifth rank (not an initial member) starts, reports, is admitted and trains
        peers[4].start(20, addresses)
        running[4] = Running(peers[4], server.address)
        _wait(lambda: coordinator.members == (0, 1, 2, 3, 4), 60, "rank 4 admitted")
        _wait(
            lambda: peers[4].member and sum(peers[4].stats.bytes_received.values()) > 0,
            60,
            "rank 4 gossiping",
        )
        at = peers[4].round
        _wait(lambda: peers[4].round >= at + 10, 60, "rank 4 keeps up")
        for r in (0, 3, 4):
            assert running[r].peer.members == (0, 1, 2, 3, 4)
        for r in running.values():
            assert r.error is None
    finally:
        for r in list(running.values()):
            r.stop()
        server.stop()


def test_a_member_restarted_before_its_removal_and_joining_is_admitted_again():
    """Rank 3 stops and comes back at once from its checkpoint, joining (it cannot know whether
    it was removed), long before the member timeout: the coordinator still counts it a member,
    so no change of members would ever come; its reports say it waits, and a new schedule with
    the same members admits it again. (Before, it waited outside the network for good.)"""
    topology = build_topology("ring", n=4, members=[0, 1, 2, 3])
    models = mlp_models(5, hidden=8)
    coordinator = Coordinator(
        topology, planner="per-tensor", report_every=REPORT_EVERY, member_timeout=600.0
    )
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    peers = [_peer(topology, r, models[r]) for r in range(4)]
    addresses = {p.rank: p.address for p in peers}
    running = _started(peers, addresses, server.address)
    try:
        _wait(lambda: min(r.peer.round for r in running.values()) >= 10, 60, "10 rounds")
        stopped = running.pop(3)
        stopped.stop()
        saved = stopped.peer.state_dict()
        epochs = len(coordinator.published)
        back = _peer(topology, 3, models[4], addresses[3], joining=True)
        back.load_state_dict(saved)
        back.start(20, addresses)
        assert not back.member and back.awaiting_admission
        running[3] = Running(back, server.address)
        _wait(lambda: back.member and back.round > saved["round"], 60, "rank 3 admitted again")
        assert coordinator.members == (0, 1, 2, 3)  # never removed: the same members...
        assert len(coordinator.published) == epochs + 1  # ...under one new epoch
        assert not back.awaiting_admission
        heard = dict(back.stats.bytes_received)
        _wait(
            lambda: all(back.stats.bytes_received.get(j, 0) > heard.get(j, 0) for j in (0, 2)),
            60,
            "rank 3 gossiping with its ring neighbours 0 and 2",
        )
        for r in running.values():
            assert r.error is None
    finally:
        for r in list(running.values()):
            r.stop()
        server.stop()


def _report(topology, sender: int, round: int = 3, **fields) -> cpb.PeerReport:
    return cpb.PeerReport(
        protocol_version=PROTOCOL_VERSION,
        sender=sender,
        topology_hash=topology.hash,
        model_signature="m" * 64,
        round=round,
        compute_seconds=0.01,
        tensors=[cpb.TensorSize(name="w", numel=10)],
        **fields,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_report_speaks_only_for_its_sender_and_strangers_are_refused():
    """Reports from 0, 1 and 2 that say their links to rank 3 fail do not remove rank 3 while
    it reports; a rank outside the capacity is refused and admits nobody; only silence past the
    timeout, on the coordinator's own clock, removes a member."""
    topology = build_topology("ring", n=4, members=[0, 1, 2, 3])
    clock = Clock()
    coordinator = Coordinator(
        topology, planner="per-tensor", liveness=MemberLiveness((0, 1, 2, 3), 5.0, clock=clock)
    )
    lost = [cpb.LinkSamples(neighbour=3, bytes=[0] * 4, seconds=[99.0] * 4)]
    for step in range(8):
        clock.now = step * 2.0
        for sender in (0, 1, 2):
            coordinator.receive(_report(topology, sender, 3 + step, links=lost, sends=lost))
        coordinator.receive(_report(topology, 3, 3 + step))
    assert coordinator.members == (0, 1, 2, 3)
    with pytest.raises(ReportRefused) as refused:
        coordinator.receive(_report(topology, 4))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert coordinator.members == (0, 1, 2, 3)
    for step, seconds in enumerate((3.0, 2.5)):  # rank 3 silent 5.5 s, past the timeout
        clock.now += seconds
        for sender in (0, 1, 2):
            coordinator.receive(_report(topology, sender, 20 + step))
        assert coordinator.members == ((0, 1, 2, 3), (0, 1, 2))[step]
    assert coordinator.published[-1].members == (0, 1, 2)
    assert coordinator.published[-1].effective_round > 20  # ahead of the furthest round


def test_a_member_saying_it_waits_is_admitted_again_once_and_only_holding_the_newest():
    """A member's `joining` report gets it a new schedule with the same members only when it
    holds the newest epoch (else the reply already brings it one naming it); repeating the
    word adds no epoch within the change interval, and one report speaks only for its sender."""
    topology = build_topology("ring", n=4, members=[0, 1, 2, 3])
    clock = Clock()
    liveness = MemberLiveness((0, 1, 2, 3), 30.0, min_interval=10.0, clock=clock)
    coordinator = Coordinator(topology, planner="per-tensor", liveness=liveness)
    for sender in range(4):
        coordinator.receive(_report(topology, sender, 3))
    before = len(coordinator.published)
    held = coordinator.published[-1].epoch  # the planner's first schedule
    # member 1 restarted and waits, holding the newest: admitted again by a new epoch
    coordinator.receive(_report(topology, 1, 3, schedule_epoch=held, joining=True))
    assert len(coordinator.published) == before + 1
    again = coordinator.published[-1]
    assert again.members == (0, 1, 2, 3) and coordinator.members == (0, 1, 2, 3)
    # 1 asks again before it holds the new schedule: the reply carries it, no other epoch
    asked = _report(topology, 1, 3, schedule_epoch=held, joining=True)
    assert coordinator.receive(asked) == (again,)
    clock.now = 5.0  # and holding it, within the change interval: none either
    for sender in (0, 2, 3):
        coordinator.receive(
            _report(topology, sender, again.effective_round, schedule_epoch=again.epoch)
        )
    coordinator.receive(
        _report(topology, 1, again.effective_round, schedule_epoch=again.epoch, joining=True)
    )
    assert len(coordinator.published) == before + 1


def test_a_joiners_round_does_not_hold_the_admission_back_in_the_members_past():
    """A joiner does no rounds before its admission: its report (round 0), the first a fresh
    coordinator gets, does not count toward the agreed round, so its admission takes effect
    after the round the members have reached, not in their past (where every member missed
    it and it came again as new epochs, more than the joiner could stage); and a joiner's
    claim of a round far ahead triggers no republication."""
    topology = build_topology("ring", n=5, members=[0, 1, 2, 3])
    clock = Clock()
    liveness = MemberLiveness((0, 1, 2, 3), 30.0, clock=clock)
    coordinator = Coordinator(topology, planner="per-tensor", liveness=liveness)
    margin = coordinator.margin
    coordinator.receive(_report(topology, 4, 0, joining=True))
    coordinator.receive(_report(topology, 4, 10**6, joining=True))  # not a member: a lie
    for sender in range(4):
        clock.now += 0.01
        coordinator.receive(_report(topology, sender, 110 + sender))
    (admission,) = coordinator.published  # published once: nothing taken for missed
    assert admission.members == (0, 1, 2, 3, 4) and coordinator.margin == margin
    assert admission.effective_round > 113, admission
    for sender in range(4):  # in force at the members; the joiner, still waiting, lies again
        coordinator.receive(
            _report(topology, sender, admission.effective_round, schedule_epoch=admission.epoch)
        )
    coordinator.receive(_report(topology, 4, 10**6, joining=True))
    assert list(coordinator.published) == [admission] and coordinator.margin == margin


def test_a_network_of_one_member_admits_a_joiner_after_its_round():
    """Two reports agree on a round, or the one member of a network of one: with the
    joiner's round counting for nothing, a quorum of two would never agree, and nobody would
    ever be admitted."""
    topology = build_topology("ring", n=3, members=[0])
    liveness = MemberLiveness((0,), 30.0, clock=Clock())
    coordinator = Coordinator(topology, planner="per-tensor", liveness=liveness)
    coordinator.receive(_report(topology, 1, 0, joining=True))
    coordinator.receive(_report(topology, 0, 50))
    assert coordinator.members == (0, 1)
    assert coordinator.published[-1].effective_round > 50


def test_a_removal_is_not_held_back_by_schedules_waiting_for_their_round():
    """Plans and levels wait while MAX_STAGED - 1 schedules wait for their round; a change
    of members does not: the round those are counted from stalls when members die, and a
    removal held back by them would never come."""
    topology = build_topology("ring", n=4, members=[0, 1, 2, 3])
    clock = Clock()
    coordinator = Coordinator(
        topology, planner="per-tensor", liveness=MemberLiveness((0, 1, 2, 3), 5.0, clock=clock)
    )
    for sender in range(4):
        coordinator.receive(_report(topology, sender, 10))
    while sum(s.effective_round > 10 for s in coordinator.published) < MAX_STAGED - 1:
        coordinator.publish((), "per-tensor")
    for now in (3.0, 6.0):  # rank 3 silent past the timeout; the others' round stalls
        clock.now = now
        for sender in (0, 1, 2):
            coordinator.receive(_report(topology, sender, 10))
    assert coordinator.members == (0, 1, 2)


def test_a_flood_of_joining_ranks_is_admitted_a_few_at_a_time():
    topology = build_topology("complete", n=12, members=[0, 1])
    clock = Clock()
    liveness = MemberLiveness((0, 1), 30.0, admit_per_change=2, min_interval=10.0, clock=clock)
    coordinator = Coordinator(topology, planner="per-tensor", liveness=liveness)
    for sender in [*range(2, 12), 0, 1]:  # ten ranks ask to join at once
        coordinator.receive(_report(topology, sender))
    assert coordinator.members == (0, 1, 2, 3)  # two admitted by the first change
    changes = len(coordinator.published)
    for sender in range(12):  # again within the interval: no change
        coordinator.receive(_report(topology, sender))
    assert len(coordinator.published) == changes
    clock.now = 10.0  # the interval has passed, but the last change is not in force yet
    coordinator.receive(_report(topology, 0, 5))
    assert len(coordinator.published) == changes
    held = coordinator.published[-1]
    for sender in (0, 1):  # the network passed the change's round: the next two come in
        at = held.effective_round
        coordinator.receive(_report(topology, sender, at, schedule_epoch=held.epoch))
    assert coordinator.members == (0, 1, 2, 3, 4, 5)


def test_liveness_is_refused_on_a_fixed_topology_and_bounds_are_checked():
    with pytest.raises(ValueError, match="fixed membership"):
        Coordinator(build_topology("ring", n=4), liveness=MemberLiveness((0, 1)))
    with pytest.raises(ValueError, match="member timeout"):
        MemberLiveness((0,), float("nan"))
    with pytest.raises(ValueError, match="admit_per_change"):
        MemberLiveness((0,), admit_per_change=0)
    with pytest.raises(ValueError, match=r"^admit_per_change: expected an integer in \[1, "):
        MemberLiveness((0,), admit_per_change=1.5)
    with pytest.raises(ValueError, match=r"^min_interval: expected a finite number in \[0, inf\)"):
        MemberLiveness((0,), min_interval=-1.0)
    with pytest.raises(ValueError, match=r"^min_interval: .* got inf$"):
        MemberLiveness((0,), min_interval=float("inf"))
