"""Schedules cannot freeze or split the peers (issue 23, findings 1 and 2, the peer side).

Observed: a schedule effective at round 9,007,199,254,740,055 was staged by every peer, which
then refused every later schedule (a restarted coordinator's too), and the checkpoints kept it;
a rogue coordinator locked the staging book with far schedules; a schedule given to one peer
only cut it off for good (its neighbours answered its handshakes "not ready" forever). Now a
schedule takes effect within SCHEDULE_HORIZON rounds of the peer's round, its epoch cannot use
up the epochs, a newer epoch supersedes what is staged, checkpoints hold to the same bounds, and
a peer behind fetches a neighbour's schedule (checked like a coordinator's) so the network
agrees again within a bounded number of rounds. Real gRPC peers and a real coordinator server.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
from conftest import grpc_network, run_in_threads
from helpers import stop_all
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.gossip import Choco
from gossipcomp.peer import Peer
from gossipcomp.peer.links import Backoff, LinkState
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.messages import schedule_to_proto
from gossipcomp.schedule.schedule import (
    EPOCH_ALLOWANCE,
    MAX_STAGED,
    SCHEDULE_HORIZON,
    Schedule,
    ScheduleBook,
    ScheduleRefused,
)
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.grpc_transport import GrpcTransport
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.throttled import LinkRates, ThrottledTransport

RING4 = build_topology("ring", n=4)
FAST_BACKOFF = Backoff(first=0.02, longest=0.1)
ROGUE_ROUND = 2**53 - 1001 + 30  # what the coordinator published from a forged report


def _model(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    return nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3))


def _names() -> list[str]:
    return [name for name, _ in _model(0).named_parameters()]


def _peers() -> list[Peer]:
    models = [_model(r) for r in range(4)]
    choco = partial(Choco, parse_spec("sign"), consensus_step=0.4)
    return grpc_network(RING4, models, choco, round_timeout=1.0, backoff=FAST_BACKOFF)


def _rounds(peers: list[Peer], count: int, clients: list[CoordinatorClient] = ()) -> None:
    """`count` rounds at every peer, each in its own thread; the clients report after each."""
    by_rank = {c.peer.rank: c for c in clients}

    def one(peer: Peer) -> None:
        for _ in range(count):
            peer.gossip()
            if peer.rank in by_rank:
                by_rank[peer.rank].after_round()

    run_in_threads([lambda p=p: one(p) for p in peers], timeout=120)


def _all_up(peers: list[Peer]) -> bool:
    return all(not p.links.not_up() for p in peers)


# --- the staging book ----------------------------------------------------------------------


def test_a_schedule_beyond_the_horizon_or_using_up_epochs_is_refused_and_changes_nothing():
    book = ScheduleBook(["a", "b"])
    with pytest.raises(ScheduleRefused, match="expected at most 20010"):
        book.stage(Schedule(1, ROGUE_ROUND), round=10)
    with pytest.raises(ScheduleRefused, match="expected at most 20010"):
        book.stage(Schedule(1, 10 + SCHEDULE_HORIZON + 1), round=10)
    with pytest.raises(ScheduleRefused, match="epochs cannot be used up"):
        book.stage(Schedule(2**31 - 1, 40), round=10)
    with pytest.raises(ScheduleRefused, match="epochs cannot be used up"):
        book.stage(Schedule(EPOCH_ALLOWANCE + 11, 40), round=10)  # one past the allowance
    assert book.staged == () and book.newest.epoch == 0
    book.stage(Schedule(EPOCH_ALLOWANCE + 10, 10 + SCHEDULE_HORIZON), round=10)  # at the bounds
    assert book.newest.epoch == EPOCH_ALLOWANCE + 10


def test_a_newer_epoch_supersedes_far_staged_schedules_so_a_full_book_never_locks():
    """A rogue coordinator fills the book with far schedules; an honest (restarted) one's next
    epoch, nearer, replaces every staged schedule at or after its round."""
    book = ScheduleBook(["a", "b"])
    for epoch in range(1, MAX_STAGED + 1):
        book.stage(Schedule(epoch, 15_000 + epoch), round=100)
    with pytest.raises(ScheduleRefused, match="already wait"):
        book.stage(Schedule(MAX_STAGED + 1, 19_000), round=100)  # after them all: full
    staged = book.stage(Schedule(MAX_STAGED + 1, 132), round=100)
    assert staged.effective_round == 132
    assert [s.epoch for s in book.staged] == [MAX_STAGED + 1]
    assert book.due(132) == staged
    # one staged before the new one's round stays, in order
    book.stage(Schedule(MAX_STAGED + 2, 200), round=140)
    book.stage(Schedule(MAX_STAGED + 3, 150), round=140)
    assert [(s.epoch, s.effective_round) for s in book.staged] == [(MAX_STAGED + 3, 150)]


def test_a_late_schedule_from_a_neighbour_takes_effect_at_the_next_round():
    book = ScheduleBook(["a", "b"])
    with pytest.raises(ScheduleRefused, match="in the past"):
        book.stage(Schedule(1, 20), round=25)  # from a coordinator: too late
    adopted = book.stage(Schedule(1, 20), round=25, late=True)  # a neighbour already in it
    assert adopted.effective_round == 26
    assert book.due(26) == adopted


def test_a_checkpoint_cannot_restore_an_out_of_bound_staged_schedule():
    peer = Peer.over_grpc(_model(0), RING4, 0, Choco(parse_spec("sign")), bind="127.0.0.1:0")
    try:
        state = peer.state_dict()
        state["round"] = 40
        far = Schedule(1, 40 + SCHEDULE_HORIZON + 1).to_dict()
        for staged, message in (
            ([Schedule(1, ROGUE_ROUND).to_dict()], "beyond what a peer at round 40 stages"),
            ([far], "beyond what a peer at round 40 stages"),
            ([Schedule(EPOCH_ALLOWANCE + 41, 60).to_dict()], "at most epoch"),
        ):
            state["schedules"] = {**peer.schedules.state_dict(), "staged": staged}
            with pytest.raises(ValueError, match=message):
                peer.load_state_dict(state)
            assert peer.round == 0 and peer.schedules.staged == ()
        state["schedules"] = {
            **peer.schedules.state_dict(),
            "staged": [Schedule(1, 40 + SCHEDULE_HORIZON).to_dict()],
        }
        peer.load_state_dict(state)  # at the bound: restored
        assert [s.epoch for s in peer.schedules.staged] == [1]
    finally:
        peer.close()


# --- over gRPC -----------------------------------------------------------------------------


def test_peers_refuse_a_far_schedule_and_a_restarted_coordinator_replaces_a_rogue_ones():
    """Every peer refuses the schedule of round 2^53-971; a rogue coordinator's three far
    schedules (within the horizon) are staged; a freshly started coordinator's first schedule
    then replaces them at every peer, which all switch to it at one round with no exchange
    refused for mismatched epochs."""
    peers = _peers()
    server = None
    clients: list[CoordinatorClient] = []
    try:
        _rounds(peers, 4)
        for peer in peers:
            with pytest.raises(ScheduleRefused, match="expected at most"):
                peer.apply(Schedule(1, ROGUE_ROUND))
            for epoch in (1, 2, 3):  # what a rogue coordinator's replies stage
                peer.apply(Schedule(epoch, 15_000 + epoch, (TensorGroup(tuple(_names()), "sign"),)))
        assert all(p.schedules.newest.epoch == 3 for p in peers)
        coordinator = Coordinator(RING4, planner="per-tensor", report_every=2)
        server = CoordinatorServer(coordinator, "127.0.0.1:0")
        clients = [CoordinatorClient(server.address, p, "sign", report_every=2) for p in peers]
        for _ in range(30):
            _rounds(peers, 4, clients)
            if all(p.schedules.current.epoch == 4 for p in peers):
                break
        assert [s.epoch for s in coordinator.published][:1] == [4]  # above what peers held
        assert all(p.schedules.current.epoch == 4 for p in peers)
        assert all(p.schedules.staged == () for p in peers)  # the far ones are gone
        switched = {p.schedules.current.effective_round for p in peers}
        assert len(switched) == 1 and switched.pop() < 200
        assert all(c.refused == [] for c in clients)
        assert all(p.stats.mismatched_epoch_exchanges == 0 for p in peers)
    finally:
        for client in clients:
            client.close()
        if server is not None:
            server.stop()
        for peer in peers:
            peer.close()


def test_a_schedule_that_reaches_a_peer_just_before_its_round_switches_it_with_the_others():
    """Three peers hold a schedule from round 6 well before it; the fourth gets it between
    its rounds 5 and 6 (its coordinator's reply read after round 5, as a busy machine delays
    it). Round 6 has not begun there, so it switches at round 6 with the others: no exchange
    fails or mismatches, no edge goes down. Before (CI at stop 47), it took the schedule from
    round 7, every edge of it failed at round 6 on mismatched epochs, and it trained alone for
    15 rounds and then moved back 11."""
    peers = _peers()
    names = _names()
    schedule = Schedule(
        1, 6, (TensorGroup(tuple(names[:2]), "sign"), TensorGroup(tuple(names[2:]), "fp16"))
    )
    try:
        _rounds(peers, 3)
        for peer in (peers[0], peers[2], peers[3]):
            peer.apply(schedule)
        _rounds(peers, 3)
        assert [p.round for p in peers] == [6] * 4
        staged = peers[1].apply(schedule, late=True)  # the coordinator client's way
        assert staged.effective_round == 6 and peers[1].schedules.taken_late == set()
        _rounds(peers, 6)
        assert all(p.schedules.current.epoch == 1 for p in peers)
        assert {p.schedules.current.effective_round for p in peers} == {6}
        assert [sum(p.stats.failed_exchanges.values()) for p in peers] == [0] * 4
        assert all(p.stats.mismatched_epoch_exchanges == 0 for p in peers)
        assert _all_up(peers)
    finally:
        for peer in peers:
            peer.close()


AGREEMENT_ROUNDS = 40  # rounds after the effective round by which every edge exchanges again


def test_a_coordinator_killed_mid_publication_leaves_no_peer_cut_off():
    """The coordinator publishes a schedule, answers peer 0's report with it, and dies before
    the other peers report. At its round peer 0 switches alone; its neighbours fetch the
    schedule from it (and then from each other), and within AGREEMENT_ROUNDS rounds every
    peer is in the new epoch and every edge exchanges again."""
    peers = _peers()
    coordinator = Coordinator(RING4, planner="per-tensor", report_every=2, replan_every=10**6)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    clients = [CoordinatorClient(server.address, p, "sign", report_every=2) for p in peers]
    try:
        _rounds(peers, 14, clients)
        assert all(p.schedules.current.epoch == 1 for p in peers)  # the coordinator's first
        names = _names()
        published = coordinator.publish(
            [TensorGroup(tuple(names[:2]), "sign"), TensorGroup(tuple(names[2:]), "fp16")],
            "hand",
        )
        for _ in range(10):  # only peer 0 reports; the others train on
            _rounds(peers, 1, clients[:1])
            if peers[0].schedules.newest.epoch == published.epoch:
                break
        server.stop()  # dies before answering anyone else
        assert peers[0].schedules.newest.epoch == published.epoch
        assert all(p.schedules.newest.epoch < published.epoch for p in peers[1:])
        _rounds(peers, published.effective_round + 1 - peers[0].round)
        assert peers[0].schedules.current.epoch == published.epoch
        deadline = published.effective_round + AGREEMENT_ROUNDS
        while not (
            _all_up(peers) and all(p.schedules.current.epoch == published.epoch for p in peers)
        ):
            assert max(p.round for p in peers) < deadline, [
                (p.rank, p.round, p.schedules.current.epoch, p.links.not_up()) for p in peers
            ]
            _rounds(peers, 1)
        failures = [sum(p.stats.failed_exchanges.values()) for p in peers]
        _rounds(peers, 10)
        assert [sum(p.stats.failed_exchanges.values()) for p in peers] == failures
        assert all(p.links.state(j) is LinkState.UP for p in peers for j in RING4.neighbors(p.rank))
    finally:
        stop_all(clients, server, peers)


def test_a_neighbours_schedule_is_checked_like_a_coordinators():
    """A neighbour that offers a schedule this peer cannot use (an unknown parameter) gets it
    refused, and the peer keeps its own."""
    peers = _peers()
    try:
        bad = Schedule(1, 50, (TensorGroup(("nope",), "sign"),))
        with pytest.raises(ScheduleRefused, match="nope"):
            peers[1].adopt(bad)
        assert peers[1].schedules.newest.epoch == 0
        assert not peers[1].adopt(Schedule(0, 0))  # an epoch it has: nothing to do
        hostile = pb.ScheduleList(  # what a lying neighbour answers: an empty group, then 7
            schedules=[
                cpb.Schedule(
                    epoch=1,
                    effective_round=50,
                    planner="x",
                    groups=[cpb.ScheduleGroup(compressor="s")],
                ),
                *(cpb.Schedule(epoch=e, effective_round=60, planner="x") for e in range(2, 9)),
            ]
        ).SerializeToString()
        peers[0].transport.set_schedule_source(lambda sender, epoch: hostile)
        peers[1]._want_schedules(0)
        peers[1]._fetch_schedules()  # asks
        time.sleep(1.0)
        peers[1]._fetch_schedules()  # takes the answer: the malformed one is refused, logged
        # each superseded the one before at the same round
        assert [s.epoch for s in peers[1].schedules.staged] == [8]
    finally:
        for peer in peers:
            peer.close()


def test_schedules_are_fetched_through_throttled_links_too():
    """Shaped links (ThrottledTransport) pass a neighbour's schedules on to its gRPC transport;
    over an in-memory one the fetch fails (the peer logs it) instead of raising."""
    rates = LinkRates(100.0)
    a = ThrottledTransport(GrpcTransport(Identity(0, "t", "m"), [1]), rates)
    b = ThrottledTransport(GrpcTransport(Identity(1, "t", "m"), [0]), rates)
    held = [schedule_to_proto(Schedule(3, 40))]
    served = pb.ScheduleList(schedules=held).SerializeToString()
    try:
        b.set_schedule_source(lambda sender, epoch: served if sender == 0 and epoch == 0 else b"")
        a.connect({1: b.address}, timeout=10)
        assert list(a.fetch_schedules(1).result(timeout=10)) == held
        memory = ThrottledTransport(
            InMemoryTransport(Identity(0, "t", "m"), [1], InMemoryHub()), rates
        )
        assert memory.fetch_schedules(1).exception(timeout=1) is not None
    finally:
        a.close()
        b.close()
