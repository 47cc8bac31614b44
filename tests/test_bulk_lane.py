"""The bulk lane (transport/bulk_lane.py): large envelopes' data on a connection of the
transport's own, bit-exact and counted alike at both ends, and every rule of its door tested
with the attack it stops: unknown, reused and late tickets, connections that never speak, too
many connections, poisoned, short and missing data, a receiver's nonsense ticket, and a lane
that cannot be reached (the sender falls back to gRPC streams and says so)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from conftest import run_in_threads

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import (
    DEFAULT_BULK_LANE_BYTES,
    Envelope,
    EnvelopeRejected,
    Identity,
    Payload,
)
from gossipcomp.transport.bulk_lane import (
    TICKET_ACCEPTED,
    TICKET_BYTES,
    LaneServer,
    checked_ticket,
)
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcOptions, GrpcTransport
from gossipcomp.transport.wire import envelope_chunks, envelope_wire_bytes, header_chunk

PHASE = "model"
BIG = DEFAULT_BULK_LANE_BYTES // 4  # float32 elements: exactly the lane's smallest envelope
# short deadlines, so the attacks that wait for one end within a test's time
QUICK = GrpcOptions(first_chunk_timeout=0.5, stream_timeout=2.0, max_lane_connections=4)
# a stream deadline far from the ticket's, so that which of the two ended a call shows
QUICK_TICKET = GrpcOptions(first_chunk_timeout=0.5, stream_timeout=5.0)
# a full lane of 4: ticket timeouts far beyond the eviction at once that the tests look for
CROWDED = GrpcOptions(first_chunk_timeout=5.0, stream_timeout=10.0, max_lane_connections=4)


def _payload(elements: int = BIG, value: float | None = None) -> tuple[Payload, list[torch.Tensor]]:
    weight = torch.randn(elements, generator=torch.Generator().manual_seed(elements))
    if value is not None:
        weight[elements // 2] = value
    bias = torch.arange(3, dtype=torch.float32)
    return (encode_raw("weight", weight), encode_raw("bias", bias)), [weight, bias]


def _expect(transports: tuple[GrpcTransport, ...], tensors: list[torch.Tensor]) -> None:
    spec = (tensor_spec("weight", tensors[0]), tensor_spec("bias", tensors[1]))
    for transport in transports:
        transport.inbox.expect(PHASE, spec)


@pytest.fixture
def pair(grpc_pair) -> Callable[..., tuple[GrpcTransport, GrpcTransport]]:
    """Two connected transports (ranks 0 and 1) expecting `_payload()`'s layout."""

    def make(options: GrpcOptions | None = None, elements: int = BIG):
        a, b = grpc_pair(options=options)
        _expect((a, b), _payload(elements)[1])
        return a, b

    return make


def _exchange(a: GrpcTransport, b: GrpcTransport, round_: int, payload: Payload):
    return run_in_threads(
        [
            lambda: a.exchange(round_, PHASE, {1: payload}, timeout=10),
            lambda: b.exchange(round_, PHASE, {0: payload}, timeout=10),
        ]
    )


def _data_bytes(payload: Payload) -> int:
    return sum(wire.nbytes for wire in payload)


def test_a_large_envelope_goes_on_the_lane_bit_exact_and_counted_alike_at_both_ends(pair):
    a, b = pair()
    payload, tensors = _payload()
    assert a.sends_on_lane(1, _data_bytes(payload))
    for round_ in range(3):  # a fresh connection and ticket each time
        at_a, at_b = _exchange(a, b, round_, payload)
        assert not at_a.failed and not at_b.failed
        got = at_b.received[0].tensors
        assert bytes(got[0].data) == tensors[0].numpy().tobytes()
        assert bytes(got[1].data) == tensors[1].numpy().tobytes()
        envelope = Envelope(0, round_, PHASE, payload)
        # the lane moves the header once and the data unframed: fewer bytes than a stream's
        lane_bytes = len(header_chunk(envelope)) + _data_bytes(payload)
        assert at_a.bytes_sent[1] == at_b.bytes_received[0] == lane_bytes
        assert lane_bytes < envelope_wire_bytes(envelope)


def test_below_the_lane_size_and_with_the_lane_off_envelopes_go_as_streams(pair):
    small = BIG - 1000  # with the bias, just under the lane's size
    a, b = pair(options=GrpcOptions(chunk_bytes=1 << 20), elements=small)
    payload, _ = _payload(small)
    assert not a.sends_on_lane(1, _data_bytes(payload))
    at_a, at_b = _exchange(a, b, 0, payload)
    stream_bytes = envelope_wire_bytes(Envelope(0, 0, PHASE, payload), 1 << 20)
    assert at_a.bytes_sent[1] == at_b.bytes_received[0] == stream_bytes
    assert not GrpcOptions(bulk_lane_bytes=0).uses_bulk_lane


def test_with_tls_no_lane_is_served_and_envelopes_stay_on_grpc(tmp_path):
    from gossipcomp.security import new_ca, new_peer_certificate

    ca_cert, ca_key = new_ca(tmp_path)
    files = [
        new_peer_certificate(tmp_path, f"peer{i}", ["127.0.0.1"], ca_cert, ca_key) for i in range(2)
    ]
    a = GrpcTransport(Identity(0, "t", "m"), [1], options=GrpcOptions(tls=files[0]))
    b = GrpcTransport(Identity(1, "t", "m"), [0], options=GrpcOptions(tls=files[1]))
    try:
        run_in_threads(
            [lambda: a.connect({1: b.address}, 10), lambda: b.connect({0: a.address}, 10)]
        )
        payload, tensors = _payload()
        _expect((a, b), tensors)
        assert not a.sends_on_lane(1, _data_bytes(payload))
        at_a, at_b = _exchange(a, b, 0, payload)
        assert bytes(at_b.received[0].tensors[0].data) == tensors[0].numpy().tobytes()
        assert at_a.bytes_sent[1] == envelope_wire_bytes(Envelope(0, 0, PHASE, payload))
    finally:
        a.close()
        b.close()


def test_lane_options_out_of_range_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="bulk_lane_bytes: expected >= 0"):
        GrpcOptions(bulk_lane_bytes=-1)
    with pytest.raises(ValueError, match="max_lane_connections: expected >= 1"):
        GrpcOptions(max_lane_connections=0)


# --- the door, attacked by hand: a Bulk call and a raw lane connection ------------------------


class _Caller:
    """A plaintext stranger claiming to be rank 0: Bulk calls and lane connections by hand."""

    def __init__(self, receiver: GrpcTransport) -> None:
        self.receiver = receiver
        self.channel = grpc.insecure_channel(receiver.address)
        self.bulk = self.channel.stream_stream(
            f"/{SERVICE_NAME}/Bulk", response_deserializer=pb.BulkReply.FromString
        )

    def call(self, payload: Payload, round_: int = 0, sender: int = 0) -> Iterator[pb.BulkReply]:
        first = header_chunk(Envelope(sender, round_, PHASE, payload))
        return self.bulk(iter((first,)), timeout=10)

    def lane(self, port: int | None = None) -> socket.socket:
        """A connection to the receiver's lane (at the port its tickets name by default)."""
        port = port or self.receiver._lane.port
        return socket.create_connection(("127.0.0.1", port), timeout=5)

    def show(self, ticket: pb.BulkTicket) -> socket.socket:
        """A lane connection that showed `ticket` and was told it may send its data."""
        lane = self.lane(ticket.port)
        lane.sendall(ticket.ticket)
        assert _read_exactly(lane, len(TICKET_ACCEPTED)) == TICKET_ACCEPTED
        return lane

    def close(self) -> None:
        self.channel.close()


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    got = b""
    while len(got) < count:
        more = sock.recv(count - len(got))
        if not more:
            break
        got += more
    return got


@pytest.fixture
def caller(pair) -> Iterator[Callable[..., tuple[_Caller, GrpcTransport]]]:
    made: list[_Caller] = []

    def make(options: GrpcOptions | None = None) -> tuple[_Caller, GrpcTransport]:
        _, b = pair(options=options)
        made.append(_Caller(b))
        return made[-1], b

    yield make
    for one in made:
        one.close()


def _closed_by_peer(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the other end closes `sock` within `within` seconds (reads nothing but EOF)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _eventually(condition: Callable[[], bool], within: float = 3.0) -> bool:
    """Whether `condition` holds within `within` seconds (checked every 10 ms)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _delivered(b: GrpcTransport, round_: int = 0) -> bool:
    arrivals = b.inbox.collect(round_, PHASE, [0], time.monotonic() + 0.2, 0)
    return 0 in arrivals.envelopes


def test_a_ticket_delivers_once_and_an_unknown_or_used_one_is_cut_off_unread(caller):
    me, b = caller()
    payload, tensors = _payload()
    call = me.call(payload)
    ticket = checked_ticket(next(call), 1)
    with me.show(ticket) as lane:
        for wire in payload:
            lane.sendall(wire.data)
        assert _closed_by_peer(lane)  # closed once the data is complete
    done = next(call)
    assert done.done.received_bytes == len(header_chunk(Envelope(0, 0, PHASE, payload))) + (
        _data_bytes(payload)
    )
    assert _delivered(b)
    for forged in (ticket.ticket, secrets.token_bytes(TICKET_BYTES)):  # used, then unknown
        with me.lane(ticket.port) as lane:
            lane.sendall(forged + tensors[0].numpy().tobytes()[:4096])
            assert _closed_by_peer(lane)
    assert b._lane.open_connections == 0


def test_a_connection_that_never_shows_a_ticket_is_closed_in_time(caller):
    me, b = caller(QUICK)
    with me.lane() as lane:
        started = time.monotonic()
        lane.sendall(b"\x00" * (TICKET_BYTES - 1))  # one byte short, then silence
        assert _closed_by_peer(lane, within=5.0)
        assert time.monotonic() - started < QUICK.first_chunk_timeout + 2.0


def test_beyond_the_limit_the_oldest_silent_connection_makes_room(caller):
    me, b = caller(CROWDED)
    held = [me.lane() for _ in range(CROWDED.max_lane_connections)]
    try:
        deadline = time.monotonic() + 5
        while b._lane.open_connections < len(held) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b._lane.open_connections == len(held)
        with me.lane():
            assert _closed_by_peer(held[0], within=2.0)  # long before the 5 s ticket deadline
            assert not _closed_by_peer(held[1], within=0.1)
            assert b._lane.open_connections == len(held)
    finally:
        for lane in held:
            lane.close()


def test_when_every_lane_connection_carries_data_a_new_one_is_refused(caller):
    me, b = caller(CROWDED)
    payload, _ = _payload()
    calls = [me.call(payload) for _ in range(CROWDED.max_lane_connections)]
    lanes = [me.show(checked_ticket(next(call), 1)) for call in calls]
    try:
        with me.lane() as extra:
            assert _closed_by_peer(extra, within=2.0)  # long before the 5 s ticket deadline
        assert all(not _closed_by_peer(lane, within=0.01) for lane in lanes)
    finally:
        for lane in lanes:
            lane.close()


def test_a_nan_in_lane_data_refuses_the_envelope_and_stores_nothing(caller):
    me, b = caller()
    payload, _ = _payload(value=float("nan"))
    call = me.call(payload)
    ticket = checked_ticket(next(call), 1)
    with me.show(ticket) as lane:
        try:
            for wire in payload:
                lane.sendall(wire.data)
        except OSError:
            pass  # cut off at the bad value
    with pytest.raises(grpc.RpcError) as refused:
        next(call)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "NaN/Inf" in refused.value.details()
    assert not _delivered(b)


def test_data_cut_short_refuses_the_envelope_naming_the_bytes(caller):
    me, b = caller()
    payload, _ = _payload()
    call = me.call(payload)
    ticket = checked_ticket(next(call), 1)
    with me.show(ticket) as lane:
        lane.sendall(bytes(payload[0].data)[:1000])
    with pytest.raises(grpc.RpcError) as refused:
        next(call)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"header declared {_data_bytes(payload)}" in refused.value.details()
    assert "closed after 1000" in refused.value.details()
    assert not _delivered(b)


def test_a_ticket_never_shown_ends_its_call_after_the_ticket_timeout_and_dies_with_it(caller):
    me, b = caller(QUICK_TICKET)
    payload, _ = _payload()
    call = me.call(payload)
    ticket = checked_ticket(next(call), 1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as late:
        next(call)
    assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ticket was not shown in time (within 0.5 s" in late.value.details()
    assert time.monotonic() - started < QUICK_TICKET.stream_timeout - 2.0  # not the stream's
    # the ticket, the caller's envelope slot and the buffer it held are all let go (the
    # handler lets go as it ends, which may be just after the caller hears its status)
    assert _eventually(lambda: not b._lane._tickets and not b._service._envelopes._in_flight)
    with me.lane(ticket.port) as lane:  # the ticket died with its call
        lane.sendall(ticket.ticket)
        assert _closed_by_peer(lane)
    assert not _delivered(b)


def test_data_that_never_comes_ends_the_call_at_its_deadline(caller):
    me, b = caller(QUICK)
    payload, _ = _payload()
    call = me.call(payload)
    ticket = checked_ticket(next(call), 1)
    started = time.monotonic()
    with me.show(ticket) as lane:
        with pytest.raises(grpc.RpcError) as late:
            next(call)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < QUICK.stream_timeout + 2.0
        assert _closed_by_peer(lane)
    assert not _delivered(b)


def test_a_bulk_call_with_more_than_the_header_is_refused(caller):
    me, b = caller()
    payload, _ = _payload()
    first = header_chunk(Envelope(0, 0, PHASE, payload))
    with pytest.raises(grpc.RpcError) as refused:
        next(me.bulk(iter((first, first)), timeout=10))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "first chunk alone" in refused.value.details()


def test_a_bulk_call_whose_first_chunk_holds_all_the_data_is_refused(caller):
    me, b = caller()
    payload, _ = _payload()
    (whole,) = envelope_chunks(Envelope(0, 0, PHASE, payload), chunk_bytes=1 << 30)
    with pytest.raises(grpc.RpcError) as refused:
        next(me.bulk(iter((whole,)), timeout=10))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "goes by Push" in refused.value.details()
    assert not _delivered(b)


def test_connections_held_silent_cannot_keep_an_honest_sender_off_the_lane(pair, caplog):
    a, b = pair(options=CROWDED)
    payload, tensors = _payload()
    held = [socket.create_connection(("127.0.0.1", b._lane.port)) for _ in range(4)]
    try:
        deadline = time.monotonic() + 5
        while b._lane.open_connections < len(held) and time.monotonic() < deadline:
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="gossipcomp.transport"):
            at_a, at_b = _exchange(a, b, 0, payload)
        assert not at_a.failed and not at_b.failed
        assert bytes(at_b.received[0].tensors[0].data) == tensors[0].numpy().tobytes()
        lane_bytes = len(header_chunk(Envelope(0, 0, PHASE, payload))) + _data_bytes(payload)
        assert at_a.bytes_sent[1] == lane_bytes  # on the lane, not a stream
        assert _closed_by_peer(held[0], within=1.0)  # the oldest silent one made room
        assert any("bulk lane full (4 connections)" in r.getMessage() for r in caplog.records)
    finally:
        for sock in held:
            sock.close()


def test_a_header_refused_gets_no_ticket(caller):
    me, b = caller()
    payload, _ = _payload()
    with pytest.raises(grpc.RpcError) as refused:
        next(me.call(payload, sender=7))  # not a neighbour of peer 1
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert b._lane.open_connections == 0


@pytest.mark.parametrize(
    "reply, expected",
    [
        (pb.BulkReply(done=pb.PushReply(received_bytes=1)), "expected a ticket first"),
        (pb.BulkReply(ticket=pb.BulkTicket(ticket=b"x" * 15, port=5000)), "got 15 bytes"),
        (pb.BulkReply(ticket=pb.BulkTicket(ticket=b"x" * 16, port=0)), "port 0"),
        (pb.BulkReply(ticket=pb.BulkTicket(ticket=b"x" * 16, port=70000)), "port 70000"),
        (grpc.aio.EOF, "expected a ticket first"),
    ],
)
def test_a_receivers_nonsense_ticket_is_refused_naming_the_field(reply, expected):
    with pytest.raises(EnvelopeRejected, match=expected):
        checked_ticket(reply, 3)


def test_a_lane_that_cannot_be_reached_falls_back_to_streams_and_says_so_once(pair, caplog):
    a, b = pair()
    payload, tensors = _payload()
    with socket.socket() as spare:  # a port nothing listens on
        spare.bind(("127.0.0.1", 0))
        dead_port = spare.getsockname()[1]
    b._lane.port = dead_port  # every ticket names it now
    with caplog.at_level(logging.WARNING, logger="gossipcomp.transport"):
        for round_ in range(2):
            at_a, at_b = _exchange(a, b, round_, payload)
            assert not at_a.failed and not at_b.failed
            assert bytes(at_b.received[0].tensors[0].data) == tensors[0].numpy().tobytes()
            assert at_a.bytes_sent[1] == envelope_wire_bytes(Envelope(0, round_, PHASE, payload))
    warnings = [r.getMessage() for r in caplog.records if "bulk lane" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{dead_port} cannot be opened" in warnings[0]
    assert not a.sends_on_lane(1, _data_bytes(payload))


def test_a_lane_port_that_never_accepts_the_ticket_gets_no_data_and_a_stream_instead(pair, caplog):
    a, b = pair(options=GrpcOptions(hello_timeout=0.5))
    payload, tensors = _payload()
    with socket.create_server(("127.0.0.1", 0)) as unrelated:  # accepts, never answers
        b._lane.port = unrelated.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="gossipcomp.transport"):
            at_a, at_b = _exchange(a, b, 0, payload)
        assert not at_a.failed and not at_b.failed
        assert bytes(at_b.received[0].tensors[0].data) == tensors[0].numpy().tobytes()
        connection, _ = unrelated.accept()
        with connection:
            connection.settimeout(1)
            received = b""
            while more := connection.recv(1 << 20):
                received += more
        assert len(received) == TICKET_BYTES  # the ticket, never the model
    assert any("cannot be opened (no answer)" in r.getMessage() for r in caplog.records)


def test_a_lane_on_every_interface_serves_both_address_families():
    async def serve() -> list[bool]:
        lane = LaneServer("peer 0", 4, 1.0)
        port = await lane.start("0.0.0.0")
        reached = []
        try:
            for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                if family == socket.AF_INET6 and not socket.has_ipv6:
                    continue
                try:
                    _, writer = await asyncio.open_connection(host, port)
                except OSError:
                    reached.append(family == socket.AF_INET6 and not _ipv6_loopback())
                    continue
                writer.close()
                reached.append(True)
        finally:
            await lane.close()
        return reached

    assert all(asyncio.run(serve()))


def _ipv6_loopback() -> bool:
    """Whether this machine has an IPv6 loopback at all."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_peer_without_a_lane_gets_large_envelopes_as_streams(grpc_pair, caplog):
    a = GrpcTransport(Identity(0, "t", "m"), [1])
    b = GrpcTransport(Identity(1, "t", "m"), [0], options=GrpcOptions(bulk_lane_bytes=0))
    try:
        run_in_threads(
            [lambda: a.connect({1: b.address}, 10), lambda: b.connect({0: a.address}, 10)]
        )
        payload, tensors = _payload()
        _expect((a, b), tensors)
        with caplog.at_level(logging.WARNING, logger="gossipcomp.transport"):
            at_a, at_b = _exchange(a, b, 0, payload)
        assert not at_a.failed and not at_b.failed
        assert bytes(at_b.received[0].tensors[0].data) == tensors[0].numpy().tobytes()
        warnings = [r.getMessage() for r in caplog.records if "bulk lane" in r.getMessage()]
        assert len(warnings) == 1 and "until its address changes: it serves none" in warnings[0]
        assert not a.sends_on_lane(1, _data_bytes(payload))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "flag, expected", [([], DEFAULT_BULK_LANE_BYTES), (["0"], 0), (["16"], 16 << 20)]
)
def test_the_peer_command_sets_the_lane_size_it_is_given(monkeypatch, flag, expected):
    import gossipcomp.experiment.simulation as simulation
    from gossipcomp import cli

    given: dict[str, object] = {}

    def run_peer(*args: object, **kwargs: object) -> None:
        given.update(kwargs)
        raise KeyboardInterrupt  # stop before any training

    monkeypatch.setattr(simulation, "run_peer", run_peer)
    argv = ["peer", "--topology", "ring4", "--rank", "0", "--rounds", "1", "--quiet"]
    assert cli.main([*argv, *(["--bulk-lane-mib", *flag] if flag else [])]) != 0  # stopped
    assert given["bulk_lane_bytes"] == expected


def test_an_address_the_machine_lacks_is_left_out_of_the_lane():
    """A wildcard bind on a machine without IPv6 (or an address not assigned here) must not
    stop the lane from serving the addresses that exist."""
    tcp = (socket.SOCK_STREAM, socket.IPPROTO_TCP, "")

    async def serve() -> tuple[int, int]:
        lane = LaneServer("peer 0", 4, 1.0)
        try:
            servers = await lane._bind_all(
                [
                    (socket.AF_INET6, *tcp, ("2001:db8::1", 0, 0, 0)),  # documentation prefix
                    (socket.AF_INET, *tcp, ("127.0.0.1", 0)),
                ]
            )
            _, writer = await asyncio.open_connection("127.0.0.1", lane.port)
            writer.close()
            return len(servers), lane.port
        finally:
            await lane.close()

    count, port = asyncio.run(serve())
    assert count == 1 and port > 0


def test_a_nan_found_on_the_lane_fails_the_senders_push_and_stores_nothing(pair):
    a, b = pair()
    poisoned, _ = _payload(value=float("inf"))
    clean, _ = _payload()

    def timed_exchange() -> tuple[float, object]:
        started = time.monotonic()
        result = a.exchange(0, PHASE, {1: poisoned}, timeout=5)
        return time.monotonic() - started, result

    (seconds, at_a), at_b = run_in_threads(
        [timed_exchange, lambda: b.exchange(0, PHASE, {0: clean}, timeout=5)]
    )
    assert seconds < 4.0  # the sender is told at once, not left to its deadline
    assert "INVALID_ARGUMENT" in at_a.failed[1] and "NaN/Inf" in at_a.failed[1]
    assert 0 not in at_b.received and 0 in at_b.failed  # nothing stored; the edge fails


def test_a_lane_given_up_is_tried_again_after_the_retry_time(pair, monkeypatch):
    import gossipcomp.transport.grpc_transport as grpc_transport

    monkeypatch.setattr(grpc_transport, "LANE_RETRY_SECONDS", 0.3)
    a, b = pair()
    payload, _ = _payload()
    real_port = b._lane.port
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        b._lane.port = spare.getsockname()[1]  # nothing listens there once it is closed
    at_a, _ = _exchange(a, b, 0, payload)
    assert not at_a.failed and not a.sends_on_lane(1, _data_bytes(payload))
    b._lane.port = real_port
    time.sleep(0.4)
    assert a.sends_on_lane(1, _data_bytes(payload))
    at_a, at_b = _exchange(a, b, 1, payload)
    lane_bytes = len(header_chunk(Envelope(0, 1, PHASE, payload))) + _data_bytes(payload)
    assert at_a.bytes_sent[1] == at_b.bytes_received[0] == lane_bytes  # on the lane again


def test_a_receiver_that_accepts_the_ticket_and_never_reads_cannot_hold_a_push_past_its_deadline(
    pair,
):
    a, b = pair(options=QUICK_TICKET)
    payload, _ = _payload()
    held: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as stalling:

        def accept_and_stall() -> None:
            connection, _ = stalling.accept()
            held.append(connection)
            _read_exactly(connection, TICKET_BYTES)
            connection.sendall(TICKET_ACCEPTED)  # then reads nothing more

        acceptor = threading.Thread(target=accept_and_stall, daemon=True)
        acceptor.start()
        b._lane.port = stalling.getsockname()[1]
        started = time.monotonic()
        at_a = a.exchange(0, PHASE, {1: payload}, timeout=1.5)
        assert time.monotonic() - started < 1.5 + 1.0
        assert "not finished within 1.5 s" in at_a.failed[1]
        acceptor.join(5)
        for connection in held:
            connection.close()
