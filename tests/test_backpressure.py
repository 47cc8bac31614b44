"""Back-pressure (transport/backpressure.py): a push its receiver is not ready for yet is sent
again until the receiver opens that round, in both transports; late and hostile pushes are not.

On a graph that changes every round a peer can run many rounds ahead of its next partner; these
tests put the sender 10 rounds ahead of a receiver whose mailbox holds 4."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from gossipcomp.transport.backpressure import FIRST_PAUSE_S, LONGEST_PAUSE_S, pauses_until
from gossipcomp.transport.base import Envelope, EnvelopeRejected, Identity, RejectCode
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcTransport
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from tests.conftest import run_in_threads

AHEAD = 10  # the sender's round; the receiver starts at 0 with a window of 4
Pair = tuple[object, object]


@pytest.fixture(params=["memory", "grpc"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Peers 0 and 1, neighbours, expecting one 2-value tensor in phase "p"."""
    if request.param == "memory":
        hub = InMemoryHub()
        a = InMemoryTransport(Identity(0, "t", "m"), [1], hub)
        b = InMemoryTransport(Identity(1, "t", "m"), [0], hub)
    else:
        a = GrpcTransport(Identity(0, "t", "m"), [1])
        b = GrpcTransport(Identity(1, "t", "m"), [0])
        a.connect({1: b.address}, timeout=10)
        b.connect({0: a.address}, timeout=10)
    for t in (a, b):
        t.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    yield a, b
    for t in (a, b):
        t.close()


def _payload(value: float) -> tuple:
    return (encode_raw("w", torch.full((2,), value)),)


def _later(seconds: float, work: Callable[[], object]) -> Callable[[], object]:
    def delayed() -> object:
        time.sleep(seconds)
        return work()

    return delayed


def test_a_push_ahead_of_the_window_waits_for_the_receiver_and_is_delivered(pair: Pair) -> None:
    """Peer 0 is at round 10, peer 1 still at 0: 0's push is refused as not yet due, sent
    again, and taken once 1 opens round 10; both exchanges succeed. (Before back-pressure the
    push failed at once and 0 gave the edge up for that round.)"""
    a, b = pair
    ahead, behind = run_in_threads(
        [
            lambda: a.exchange(AHEAD, "p", {1: _payload(1.0)}, timeout=20.0),
            _later(0.5, lambda: b.exchange(AHEAD, "p", {0: _payload(2.0)}, timeout=20.0)),
        ]
    )
    assert not ahead.failed and not behind.failed
    assert torch.equal(decode_raw(ahead.received[1].tensor("w")), torch.full((2,), 2.0))
    assert torch.equal(decode_raw(behind.received[0].tensor("w")), torch.full((2,), 1.0))
    assert ahead.send_seconds[1] >= 0.4  # delivered only once the receiver got there


def test_a_receiver_that_never_gets_there_fails_the_push_at_the_deadline_holding_nothing(
    pair: Pair,
) -> None:
    a, b = pair
    start = time.monotonic()
    result = a.exchange(AHEAD, "p", {1: _payload(1.0)}, timeout=1.0)
    elapsed = time.monotonic() - start
    assert set(result.failed) == {1}
    # refused as not yet due, or (on a loaded machine) its last attempt still unanswered
    assert "ABORTED" in result.failed[1] or "not finished within" in result.failed[1]
    assert 0.8 <= elapsed < 5.0  # retried until the deadline, not given up at once
    assert b.inbox.mailbox.pending() == 0  # the receiver's memory holds nothing of it


def test_a_late_push_is_given_up_at_once_not_retried(pair: Pair) -> None:
    """Late means the receiver went on without it: waiting would only cost the sender."""
    a, b = pair
    b.inbox.open_round(5)
    start = time.monotonic()
    result = a.exchange(2, "p", {1: _payload(1.0)}, timeout=10.0)
    assert set(result.failed) == {1} and "FAILED_PRECONDITION" in result.failed[1]
    assert time.monotonic() - start < 5.0  # abandoned on the refusal, not at the deadline


def test_the_mailbox_refuses_not_yet_due_at_the_header_with_its_own_code() -> None:
    hub = InMemoryHub()
    b = InMemoryTransport(Identity(1, "t", "m"), [0], hub)
    b.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    with pytest.raises(EnvelopeRejected) as early:
        b.receive(Envelope(0, AHEAD, "p", _payload(1.0)))
    assert early.value.code is RejectCode.ABORTED
    assert early.value.public == f"round {AHEAD}: not accepted yet"  # no round of ours in it
    b.inbox.open_round(3)
    with pytest.raises(EnvelopeRejected) as late:
        b.receive(Envelope(0, 2, "p", _payload(1.0)))
    assert late.value.code is RejectCode.FAILED_PRECONDITION


def test_a_stranger_pushing_far_ahead_over_grpc_is_told_not_yet_and_nothing_is_held() -> None:
    """The refusal a plaintext caller sees carries the code (the sender needs it to hold back)
    but not the receiver's round."""
    b = GrpcTransport(Identity(1, "t", "m"), [0])
    a = GrpcTransport(Identity(0, "t", "m"), [1])
    try:
        a.connect({1: b.address}, timeout=10)
        b.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
        with pytest.raises(grpc.RpcError) as caught:
            a.send(1, Envelope(0, 10**6, "p", _payload(1.0)), time.monotonic() + 5)
        assert caught.value.code() is grpc.StatusCode.ABORTED
        assert caught.value.details() == f"round {10**6}: not accepted yet"
        assert b.inbox.mailbox.pending() == 0
    finally:
        a.close()
        b.close()


def test_pauses_double_up_to_the_longest_and_leave_the_last_attempt_time() -> None:
    deadline = time.monotonic() + 0.5
    pauses = []
    for pause in pauses_until(deadline):
        time.sleep(pause)
        pauses.append(pause)
    assert pauses[0] == FIRST_PAUSE_S and max(pauses) == LONGEST_PAUSE_S
    assert all(b == min(2 * a, LONGEST_PAUSE_S) for a, b in itertools.pairwise(pauses))
    # no pause after which the attempt would have less than a pause's time left
    assert list(pauses_until(time.monotonic() + 2 * FIRST_PAUSE_S)) == []


def test_a_push_under_a_schedule_not_yet_received_waits_for_it(pair: Pair) -> None:
    """Peer 0 already switched to schedule epoch 1 at round 1; peer 1, still before round 1,
    receives that schedule 0.5 s later. The push is not yet acceptable, not wrong: it is taken
    once epoch 1 is staged."""
    a, b = pair
    spec = (tensor_spec("w", torch.zeros(2)),)
    a.inbox.expect("p", spec, schedule_epoch=1)

    def behind() -> object:
        time.sleep(0.5)
        b.inbox.expect("p", spec, schedule_epoch=1)
        return b.exchange(1, "p", {0: _payload(2.0)}, timeout=20.0, schedule_epoch=1)

    ahead, late = run_in_threads(
        [lambda: a.exchange(1, "p", {1: _payload(1.0)}, timeout=20.0, schedule_epoch=1), behind]
    )
    assert not ahead.failed and not late.failed
    assert torch.equal(decode_raw(late.received[0].tensor("w")), torch.full((2,), 1.0))


def test_a_push_under_a_replaced_schedule_is_refused_at_once(pair: Pair) -> None:
    a, b = pair
    spec = (tensor_spec("w", torch.zeros(2)),)
    b.inbox.expect("p", spec, schedule_epoch=2)
    b.inbox.forget_epochs_before(2)
    start = time.monotonic()
    result = a.exchange(0, "p", {1: _payload(1.0)}, timeout=10.0, schedule_epoch=0)
    assert set(result.failed) == {1} and "FAILED_PRECONDITION" in result.failed[1]
    assert "long replaced" in result.failed[1]
    assert time.monotonic() - start < 5.0


def test_a_push_under_a_schedule_the_receiver_received_too_late_fails_both_ends_at_once(
    pair: Pair,
) -> None:
    """Peer 0 switched to schedule epoch 1 at round 0; peer 1 is already in round 0 under epoch
    0 (the schedule reached it too late: it refused it as taking effect in its past). Epoch 1
    can never come to peer 1 for round 0, so peer 0's push is refused at once, not pushed again
    until the deadline, and peer 1 stops waiting for peer 0's envelope: both ends fail the edge
    for the round within seconds. Pushed again as not yet due, both waited the whole 20 s (60 s
    in the adaptive benchmark of docs/benchmarks.md, issue 24)."""
    a, b = pair
    a.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),), schedule_epoch=1)
    start = time.monotonic()
    behind, ahead = run_in_threads(
        [
            lambda: b.exchange(0, "p", {0: _payload(2.0)}, timeout=20.0, schedule_epoch=0),
            _later(
                0.3,
                lambda: a.exchange(0, "p", {1: _payload(1.0)}, timeout=20.0, schedule_epoch=1),
            ),
        ]
    )
    assert time.monotonic() - start < 5.0
    assert set(ahead.failed) == {1} and "FAILED_PRECONDITION" in ahead.failed[1]
    assert set(behind.failed) == {0}  # it waited for peer 0 no longer
    assert not ahead.received and not behind.received


def test_an_unknown_newer_epoch_is_not_yet_for_a_round_not_reached_and_final_for_one_reached():
    """The mailbox's reached round decides: before a peer opens round 3, an envelope of round 3
    under an epoch newer than any held may still become acceptable (ABORTED); once round 3 is
    open it cannot (FAILED_PRECONDITION, told to strangers without the round)."""
    hub = InMemoryHub()
    receiver = InMemoryTransport(Identity(1, "t", "m"), [0], hub)
    receiver.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    envelope = Envelope(0, 3, "p", _payload(1.0), schedule_epoch=1)
    with pytest.raises(EnvelopeRejected) as early:
        receiver.receive(envelope)
    assert early.value.code is RejectCode.ABORTED
    receiver.inbox.open_round(3)
    with pytest.raises(EnvelopeRejected) as reached:
        receiver.receive(envelope)
    assert reached.value.code is RejectCode.FAILED_PRECONDITION
    assert "round" not in reached.value.public
    receiver.close()


def test_headers_naming_finished_rounds_under_an_unknown_epoch_keep_nothing():
    """A neighbour (or one posing as it over plaintext) sending headers for every finished
    round under an epoch this peer never held: each is refused, and nothing is remembered for
    rounds already finished; only the current round's wait for that sender ends."""
    hub = InMemoryHub()
    receiver = InMemoryTransport(Identity(1, "t", "m"), [0], hub)
    receiver.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    receiver.inbox.open_round(100)
    for round in range(101):
        with pytest.raises(EnvelopeRejected) as refused:
            receiver.receive(Envelope(0, round, "p", _payload(1.0), schedule_epoch=1))
        assert refused.value.code is RejectCode.FAILED_PRECONDITION
    assert receiver.inbox.mailbox._abandoned == {(100, "p", 0)}
    receiver.close()
