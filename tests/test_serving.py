"""The one way gossipcomp serves gRPC (transport/serving.py), over real gRPC on loopback.

What every service gets from it: a call that sends its headers and never its request is cut
at the header deadline and holds nothing meanwhile, a call that runs too long is cut at the
completion deadline, a request that does not parse is INVALID_ARGUMENT naming the message, and
one caller's calls in flight are bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import Identity
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcOptions, GrpcTransport
from gossipcomp.transport.serving import (
    AsyncServer,
    CallerSlots,
    Method,
    ServingLimits,
    bounded_handler,
)

SERVICE = "test.Echo"  # a service of the test's own


def _idle(stop: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until `stop`: headers only."""
    yield from ()
    stop.wait()


class _Echo:
    def __init__(self, slots: CallerSlots) -> None:
        self.slots = slots
        self.release = asyncio.Event()
        self.waiting = 0  # Wait calls begun

    async def echo(self, request: pb.PushReply, context: grpc.aio.ServicerContext) -> pb.PushReply:
        return pb.PushReply(received_bytes=request.received_bytes + 1)

    async def slow(self, request: pb.PushReply, context: grpc.aio.ServicerContext) -> pb.PushReply:
        await asyncio.sleep(60)
        return request

    async def held(self, request: pb.PushReply, context: grpc.aio.ServicerContext) -> pb.PushReply:
        async with self.slots.hold(context.peer(), context):
            await self.release.wait()
        return request

    async def wait(self, request: pb.PushReply, context: grpc.aio.ServicerContext) -> pb.PushReply:
        self.waiting += 1
        await self.release.wait()
        return request


def _serve_echo(limits: ServingLimits) -> tuple[AsyncServer, _Echo]:
    echo = _Echo(CallerSlots(2, "echoes"))
    methods = [
        Method(name, behaviour, pb.PushReply.SerializeToString, pb.PushReply.FromString)
        for name, behaviour in (
            ("Echo", echo.echo),
            ("Slow", echo.slow),
            ("Held", echo.held),
            ("Wait", echo.wait),
        )
    ]
    handler = bounded_handler(SERVICE, methods, limits)
    return AsyncServer("test", "127.0.0.1:0", [handler], limits), echo


def _serve(limits: ServingLimits) -> AsyncServer:
    return _serve_echo(limits)[0]


def _release(server: AsyncServer, echo: _Echo) -> None:
    async def release() -> None:
        echo.release.set()

    server.run(release())


def _until_done(calls: list, count: int, within: float = 30.0) -> list:
    """The calls done once `count` of them are (the others still in flight), or all done ones
    when `within` seconds pass first."""
    deadline = time.monotonic() + within
    while sum(call.done() for call in calls) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [call for call in calls if call.done()]


def test_headers_without_a_request_are_cut_and_hold_nothing_meanwhile():
    """Stalled means held until the idle streams are cut (12 s); the honest calls must be
    answered well before that, however slow a loaded machine is."""
    limits = ServingLimits(header_timeout=12.0, call_timeout=20.0, max_calls_per_caller=32)
    server = _serve(limits)
    stop = threading.Event()
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(server.address, own) for _ in range(4)]
    try:
        idle = [
            channels[i % 4].stream_unary(f"/{SERVICE}/Echo").future(_idle(stop), timeout=60)
            for i in range(100)
        ]
        time.sleep(0.3)
        with grpc.insecure_channel(server.address) as channel:
            echo = channel.unary_unary(
                f"/{SERVICE}/Echo",
                request_serializer=pb.PushReply.SerializeToString,
                response_deserializer=pb.PushReply.FromString,
            )
            started = time.monotonic()
            for i in range(20):
                assert echo(pb.PushReply(received_bytes=i), timeout=8).received_bytes == i + 1
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=8
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - started < 8.0
        errors = [call.exception(40) for call in idle]
        assert {e and e.code() for e in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert "not received within 12 s" in errors[0].details()
    finally:
        stop.set()
        for channel in channels:
            channel.close()
        server.stop()


def test_a_call_that_runs_past_its_deadline_is_cut():
    server = _serve(ServingLimits(header_timeout=1.0, call_timeout=0.5))
    try:
        with grpc.insecure_channel(server.address) as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary(f"/{SERVICE}/Slow")(b"", timeout=30)
            assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "not finished within 0.5 s" in raised.value.details()
            assert time.monotonic() - started < 5
    finally:
        server.stop()


def test_a_request_that_does_not_parse_is_invalid_argument_naming_the_message():
    server = _serve(ServingLimits())
    try:
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary(f"/{SERVICE}/Echo")(b"\xff\xff\xff", timeout=5)
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert raised.value.details() == "request: expected a PushReply message"
    finally:
        server.stop()


def test_one_caller_has_a_bounded_number_of_calls_in_flight():
    """A method's own CallerSlots: the calls held wait until the test releases them, so the
    third is refused however slowly the calls arrive."""
    server, echo = _serve_echo(ServingLimits())
    try:
        with grpc.insecure_channel(server.address) as channel:
            held = channel.unary_unary(f"/{SERVICE}/Held")
            calls = [held.future(b"", timeout=60) for _ in range(3)]
            done = _until_done(calls, 1)
            assert len(done) == 1 and sum(call.done() for call in calls) == 1
            refused = done[0].exception()
            assert refused is not None and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "echoes: at most 2 in flight per caller" in refused.details()
            _release(server, echo)
            assert [call.exception(30) for call in calls if call is not done[0]] == [None, None]
            assert held(b"", timeout=10) == b""  # slots come back when calls end
    finally:
        server.stop()


def test_every_method_shares_one_bound_per_connection():
    """`max_calls_per_caller` bounds one connection's calls in flight, every method together
    (it was a field nothing read: a method without slots of its own had no per-caller bound),
    and it takes nothing from another connection."""
    server, echo = _serve_echo(ServingLimits(max_calls_per_caller=3))
    own = [("grpc.use_local_subchannel_pool", 1)]
    mine, other = (grpc.insecure_channel(server.address, own) for _ in range(2))
    try:
        waiting = [mine.unary_unary(f"/{SERVICE}/Wait").future(b"", timeout=60) for _ in range(3)]
        deadline = time.monotonic() + 30
        while echo.waiting < 3 and time.monotonic() < deadline:  # all 3 in flight first
            time.sleep(0.05)
        extra = mine.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=60)
        done = _until_done([*waiting, extra], 1)
        assert done == [extra]
        refused = extra.exception()
        assert refused is not None and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{SERVICE} calls: at most 3 in flight per caller" in refused.details()
        assert other.unary_unary(f"/{SERVICE}/Echo")(b"", timeout=10) == b"\x08\x01"
        _release(server, echo)
        assert [call.exception(30) for call in waiting] == [None] * 3
        assert mine.unary_unary(f"/{SERVICE}/Echo")(b"", timeout=10) == b"\x08\x01"
    finally:
        mine.close()
        other.close()
        server.stop()


@pytest.mark.parametrize(
    ("field", "value"),
    [("header_timeout", 0), ("call_timeout", float("inf")), ("max_calls_per_caller", 0)],
)
def test_limits_that_would_not_bound_anything_are_refused(field, value):
    with pytest.raises(ValueError, match=f"ServingLimits.{field}"):
        ServingLimits(**{field: value})


def test_the_peers_server_is_built_this_way_too():
    """The peer's transport serves through transport/serving.py: a Hello that sends its headers
    and never its request is cut at the header deadline (first_chunk_timeout), where its old
    server waited for as long as the connection lived."""
    options = GrpcOptions(first_chunk_timeout=0.5, stream_timeout=2.0)
    stop = threading.Event()
    with GrpcTransport(Identity(0, "t", "m"), [1], options=options) as transport:
        with grpc.insecure_channel(transport.address) as channel:
            hello = channel.stream_unary(f"/{SERVICE_NAME}/Hello").future(_idle(stop), timeout=30)
            try:
                error = hello.exception(10)
            finally:
                stop.set()
            assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "not received within 0.5 s" in error.details()


@pytest.mark.parametrize("hostile", [-1, True, 1.5, (1 << 30) + 1, "4194304"])
def test_socket_read_sizes_out_of_range_are_refused(hostile):
    """read_chunk_bytes comes from options a caller builds: a negative, huge or mistyped value is
    refused, naming the field, before any server or channel is made from it."""
    with pytest.raises(ValueError, match=r"ServingLimits.read_chunk_bytes: expected an integer"):
        ServingLimits(read_chunk_bytes=hostile)
    with pytest.raises(ValueError, match=r"GrpcOptions.read_chunk_bytes: expected an integer"):
        GrpcOptions(read_chunk_bytes=hostile)


def test_socket_read_sizes_reach_servers_and_channels_and_zero_keeps_grpcs_own():
    read = "grpc.experimental.tcp_read_chunk_size"
    assert (read, 1 << 20) in ServingLimits(read_chunk_bytes=1 << 20).server_options()
    assert (read, 1 << 20) in GrpcOptions(read_chunk_bytes=1 << 20).channel_options()
    assert not any(name == read for name, _ in GrpcOptions(read_chunk_bytes=0).channel_options())
