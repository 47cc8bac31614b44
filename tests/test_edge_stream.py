"""An edge's link (`Gossip.Link`): small envelopes on one open stream, each checked as PushOne's,
refusals answered without closing it, idle links ended, and a neighbour's replies bounded."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from conftest import run_in_threads

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import Envelope, Identity
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.edge_stream import (
    MAX_LINK_DETAILS,
    EdgeStream,
    LinkRefusal,
    delivered_bytes,
    refusal_reply,
)
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcOptions, GrpcTransport
from gossipcomp.transport.wire import envelope_chunks


def _link(channel: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    return channel.stream_stream(
        f"/{SERVICE_NAME}/Link", response_deserializer=pb.LinkReply.FromString
    )


def _one_chunk(round: int, tensor: torch.Tensor) -> bytes:
    (chunk,) = envelope_chunks(Envelope(0, round, "p", (encode_raw("w", tensor),)))
    return chunk


def test_a_refusal_on_a_link_leaves_it_open_and_tells_a_stranger_nothing_of_our_rounds(grpc_pair):
    """Wrong shape: INVALID_ARGUMENT naming it; then a valid envelope on the same stream is
    stored; the same envelope again is refused as FAILED_PRECONDITION, not ALREADY_EXISTS (a
    caller without TLS must not learn which rounds arrived), and is not stored twice."""
    _, b = grpc_pair()
    b.inbox.expect("p", (tensor_spec("w", torch.zeros(4, 3)),))
    good = _one_chunk(0, torch.ones(4, 3))
    with grpc.insecure_channel(b.address) as channel:
        replies = _link(channel)(iter([_one_chunk(0, torch.zeros(3, 4)), good, good]), timeout=10)
        bad, accepted, again = list(replies)
    assert bad.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "shape: expected (4, 3), got (3, 4)" in bad.details
    assert (accepted.status, accepted.received_bytes) == (0, len(good))
    assert again.status == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert b.inbox.mailbox.pending() == 1


def _pair(options: GrpcOptions) -> tuple[GrpcTransport, GrpcTransport]:
    a = GrpcTransport(Identity(0, "topo", "model"), [1], options=options)
    b = GrpcTransport(Identity(1, "topo", "model"), [0], options=options)
    a.connect({1: b.address}, timeout=10)
    b.connect({0: a.address}, timeout=10)
    for transport in (a, b):
        transport.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    return a, b


def _exchange_round(a: GrpcTransport, b: GrpcTransport, round: int) -> None:
    payload = (encode_raw("w", torch.ones(2)),)
    results = run_in_threads(
        [
            lambda: a.exchange(round, "p", {1: payload}, 10.0),
            lambda: b.exchange(round, "p", {0: payload}, 10.0),
        ]
    )
    assert [r.failed for r in results] == [{}, {}], results
    assert [sorted(r.received) for r in results] == [[1], [0]]


def test_a_link_whose_first_envelope_does_not_come_is_ended_by_the_header_deadline():
    """first_chunk_timeout 0.3 s, stream_timeout 5 s: a link opened and left silent ends (OK)
    within 2 s, as a Push whose header does not come would; one half-closed at once ends too."""
    a, b = _pair(GrpcOptions(first_chunk_timeout=0.3, stream_timeout=5.0))
    try:
        with grpc.insecure_channel(b.address) as channel:
            started = time.monotonic()
            idle = _link(channel)(iter(()), timeout=5)
            assert list(idle) == [] and idle.code() == grpc.StatusCode.OK
            silent = _link(channel)(_never(), timeout=5)
            assert list(silent) == [] and silent.code() == grpc.StatusCode.OK
            assert time.monotonic() - started < 2.0
    finally:
        for transport in (a, b):
            transport.close()


def test_an_idle_link_is_ended_and_the_sender_opens_another():
    """stream_timeout 0.3 s: after each exchange the receiver ends the idle link (none left
    open); the next exchange goes through on a new one."""
    a, b = _pair(GrpcOptions(stream_timeout=0.3, first_chunk_timeout=0.3))
    try:
        for round in range(3):
            _exchange_round(a, b, round)
            time.sleep(0.8)
            assert not b._service._links and not a._service._links  # noqa: SLF001
    finally:
        for transport in (a, b):
            transport.close()


def test_a_hub_with_more_neighbours_in_this_process_than_a_connection_has_streams():
    """Every channel has connections of its own: with 2 streams per connection, a hub's 3
    spokes in this process each keep a link open to it and every round still goes through (on
    one shared connection the third link waited for a stream until its deadline)."""
    options = GrpcOptions(max_streams_per_connection=2)
    hub = GrpcTransport(Identity(0, "t", "m"), [1, 2, 3], options=options)
    spokes = [GrpcTransport(Identity(j, "t", "m"), [0], options=options) for j in (1, 2, 3)]
    everyone = [hub, *spokes]
    try:
        hub.connect({s.rank: s.address for s in spokes}, timeout=10)
        for spoke in spokes:
            spoke.connect({0: hub.address}, timeout=10)
        for transport in everyone:
            transport.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
        payload = (encode_raw("w", torch.ones(2)),)
        outgoing = {t.rank: {j: payload for j in t._neighbours} for t in everyone}  # noqa: SLF001
        for round in range(3):
            results = run_in_threads(
                [lambda t=t, r=round: t.exchange(r, "p", outgoing[t.rank], 5.0) for t in everyone]
            )
            assert [r.failed for r in results] == [{}] * 4, results
        assert len(hub._service._links) == 3  # noqa: SLF001
    finally:
        for transport in everyone:
            transport.close()


def _never():
    """A request iterator that sends nothing and never ends (until the call is cancelled)."""
    time.sleep(2)
    yield from ()


def test_closing_a_peer_does_not_wait_for_its_neighbours_open_links(grpc_pair):
    """Links stay open between rounds; closing must end them, not sit out the 0.5 s grace."""
    a, b = grpc_pair()
    for transport in (a, b):
        transport.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    payload = (encode_raw("w", torch.ones(2)),)
    run_in_threads(
        [
            lambda: a.exchange(0, "p", {1: payload}, 10.0),
            lambda: b.exchange(0, "p", {0: payload}, 10.0),
        ]
    )
    assert len(b._service._links) == 1  # noqa: SLF001  a's link to b, still open
    started = time.monotonic()
    b.close()
    assert time.monotonic() - started < 0.45
    assert not b._service._links  # noqa: SLF001


@pytest.mark.parametrize(
    ("status", "details", "code"),
    [
        (99, "no such code", grpc.StatusCode.INTERNAL),
        (3, "x" * (MAX_LINK_DETAILS + 1), grpc.StatusCode.INTERNAL),
        (3, "x" * 1_000_000, grpc.StatusCode.INTERNAL),
        (3, "shape: expected (4, 3)", grpc.StatusCode.INVALID_ARGUMENT),
        (10, "not yet due", grpc.StatusCode.ABORTED),
    ],
)
def test_a_neighbours_reply_is_believed_only_within_bounds(status, details, code):
    """A reply's status must be a gRPC code and its details at most MAX_LINK_DETAILS
    characters; what a refusal says is never echoed beyond a bounded length."""
    with pytest.raises(LinkRefusal) as caught:
        delivered_bytes(pb.LinkReply(status=status, details=details), 7)
    assert caught.value.code() == code
    assert len(str(caught.value)) < 2 * MAX_LINK_DETAILS
    if code is grpc.StatusCode.INTERNAL:
        assert "peer 7 answered on its link with status" in caught.value.details()
    else:
        assert caught.value.details() == details
    assert delivered_bytes(pb.LinkReply(received_bytes=123), 7) == 123


def test_a_refusal_is_cut_to_the_bound_before_it_is_sent():
    reply = refusal_reply(grpc.StatusCode.INVALID_ARGUMENT, "y" * 5000)
    assert len(reply.details) == MAX_LINK_DETAILS and reply.details.endswith("...")
    with pytest.raises(LinkRefusal) as caught:
        delivered_bytes(reply, 1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class _FakeCall:
    """A link that answers, never answers, has ended (its read gives EOF), refuses writes
    (`write_fails` times) or answers bytes that do not parse (gRPC reads them as None)."""

    def __init__(
        self, answers: bool, ended: bool = False, write_fails: int = 0, garbled: bool = False
    ) -> None:
        self.answers, self.ended, self.write_fails, self.garbled = (
            answers,
            ended,
            write_fails,
            garbled,
        )
        self.written: list[bytes] = []
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled

    async def write(self, chunk: bytes) -> None:
        if self.write_fails:
            self.write_fails -= 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "ended"
            )
        self.written.append(chunk)

    async def read(self) -> object:
        if self.ended:
            return grpc.aio.EOF
        if not self.answers:
            await asyncio.sleep(3600)
        if self.garbled:
            return None
        return pb.LinkReply(received_bytes=len(self.written[-1]))

    def cancel(self) -> None:
        self.cancelled = True


def test_a_send_not_answered_in_time_drops_its_link_so_a_late_reply_answers_nothing():
    """The first link never answers: the send fails with DEADLINE_EXCEEDED and that link is
    cancelled; the next send writes on a new link and is answered there."""
    calls = [_FakeCall(answers=False), _FakeCall(answers=True)]
    opened = iter(calls)
    stream = EdgeStream(3, lambda: next(opened))

    async def both() -> int:
        with pytest.raises(LinkRefusal) as caught:
            await stream.send(b"first", 0.05)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "peer 3" in caught.value.details()
        return await stream.send(b"second", 1.0)

    assert asyncio.run(both()) == len(b"second")
    assert calls[0].cancelled and calls[0].written == [b"first"]
    assert calls[1].written == [b"second"] and not calls[1].cancelled


def test_a_link_the_receiver_ended_is_replaced_once_per_send():
    """A link that gives EOF (the receiver ended it while idle; the envelope was not read):
    the send goes once more on a new link. Two ended links in a row fail the send as
    UNAVAILABLE, without a third try."""
    calls = [_FakeCall(answers=True, ended=True), _FakeCall(answers=True)]
    stream = EdgeStream(4, iter(calls).__next__)
    assert asyncio.run(stream.send(b"chunk", 1.0)) == len(b"chunk")
    assert [c.written for c in calls] == [[b"chunk"], [b"chunk"]]

    ended = [_FakeCall(answers=True, ended=True) for _ in range(3)]
    stream = EdgeStream(4, iter(ended).__next__)
    with pytest.raises(LinkRefusal) as caught:
        asyncio.run(stream.send(b"chunk", 1.0))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [len(c.written) for c in ended] == [1, 1, 0]


def test_a_write_refused_on_a_link_the_receiver_just_ended_goes_again_on_a_new_one():
    """The receiver ends an idle link as the sender writes on it: gRPC refuses the write
    (nothing was sent), so the envelope goes on a new link; a new link that refuses its
    first write is a real failure and raises."""
    reused, fresh = _FakeCall(answers=True, write_fails=1), _FakeCall(answers=True)
    opened = iter([reused, fresh])
    stream = EdgeStream(5, lambda: next(opened))

    async def twice() -> list[int]:
        reused.write_fails = 0
        first = await stream.send(b"one", 1.0)  # opens `reused`, answered
        reused.write_fails = 1  # the receiver ended it meanwhile
        return [first, await stream.send(b"two", 1.0)]

    assert asyncio.run(twice()) == [3, 3]
    assert reused.written == [b"one"] and fresh.written == [b"two"]

    broken = _FakeCall(answers=True, write_fails=1)
    stream = EdgeStream(5, lambda: broken)
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(stream.send(b"one", 1.0))
    assert broken.cancelled


def test_an_answer_that_is_no_link_reply_fails_the_send_and_drops_the_link():
    """A neighbour answering bytes that do not parse: INTERNAL naming it, the envelope sent
    once, and the link cancelled (its next answer would not be trusted to pair)."""
    garbled = _FakeCall(answers=True, garbled=True)
    stream = EdgeStream(6, lambda: garbled)
    with pytest.raises(LinkRefusal) as caught:
        asyncio.run(stream.send(b"envelope", 1.0))
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "peer 6" in caught.value.details() and "not a LinkReply" in caught.value.details()
    assert garbled.written == [b"envelope"] and garbled.cancelled


@pytest.mark.parametrize(
    ("streams", "ranks", "groups"),
    [(64, [0, 15, 16, 31, 63, 64], [0, 0, 1, 1, 3, 4]), (2, [0, 1, 2], [0, 1, 2])],
)
def test_peers_of_one_process_share_connections_in_groups_of_a_quarter_of_the_streams(
    streams, ranks, groups
):
    """With 64 streams a connection, ranks 0-15 share one to each server (links take at most
    16 of its streams), 16-31 the next; with 2, every peer has its own."""
    options = GrpcOptions(max_streams_per_connection=streams)
    assert [options.connection_group(rank) for rank in ranks] == groups
    assert ("gossipcomp.connection_group", groups[-1]) in options.channel_options(ranks[-1])


def test_a_link_past_its_age_ends_at_its_next_answer_and_the_sender_opens_another(monkeypatch):
    """MAX_LINK_SECONDS of 0: every link ends right after its first answer; each exchange still
    goes through (on a new link), and no link is left open on either server."""
    from gossipcomp.transport import grpc_service

    monkeypatch.setattr(grpc_service, "MAX_LINK_SECONDS", 0.0)
    a, b = _pair(GrpcOptions())
    try:
        for round in range(3):
            _exchange_round(a, b, round)
        deadline = time.monotonic() + 2.0
        while (b._service._links or a._service._links) and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.05)
        assert not b._service._links and not a._service._links  # noqa: SLF001
    finally:
        for transport in (a, b):
            transport.close()
