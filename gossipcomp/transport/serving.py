"""One way to serve gRPC: every gossipcomp service (peer, coordinator, any later one) is built here.

Learned twice: a synchronous server with a few worker threads is stopped by a handful of streams
that send their headers and never their request. So every server is a grpc.aio server on an
event loop of its own thread (driven from synchronous code): a waiting call holds no thread.
Each method is wrapped by `bounded_handler`:

- header deadline: a unary request must arrive within `header_timeout` seconds of the call's
  headers (the method is read as a stream for this; on the wire a unary call is a stream of one
  message), else DEADLINE_EXCEEDED;
- completion deadline: the whole call ends within `call_timeout` seconds, else DEADLINE_EXCEEDED;
- a request that does not parse is INVALID_ARGUMENT naming the message expected, not INTERNAL;
- per-caller limits: HTTP/2 lets one connection open at most `max_streams_per_connection`
  streams, and every method of the service shares one `CallerSlots` of
  `max_calls_per_caller` calls in flight per connection (`context.peer()`), counted from the
  call's headers, so strangers' calls never take the capacity of the members' own connections.
  A method may bound a checked identity on one connection further with a `CallerSlots` of its
  own (the coordinator's reports, the peer's envelopes).

A method whose request is a stream (the peer's Push) bounds its own reads (its first chunk and its
whole envelope have deadlines of their own, so it reads chunks without a timer each): it is
served with the completion deadline only when `bound_streams` is set. A method whose answer is a
stream too (the peer's Link, open for as long as its edge is busy) bounds each read and write
by itself and is never given the completion deadline.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

_T = TypeVar("_T")
Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


# How much gRPC reads from a socket at a time, servers and channels alike. With gRPC's own
# sizes a megabyte chunk arrives in many small reads (each a syscall and a slice to join);
# reading up to megabytes at a time took a raw loopback stream of 1 MiB messages from 0.63-0.85
# to 0.84-1.54 GiB/s (docs/benchmarks.md, "Transport"). The minimum stays small so that the
# many small envelopes of a round do not each take a large buffer.
DEFAULT_READ_CHUNK_BYTES = 4 << 20


def read_chunk_options(read_chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC's socket read sizes for `read_chunk_bytes` (0: gRPC's own)."""
    if read_chunk_bytes == 0:
        return []
    return [
        ("grpc.experimental.tcp_read_chunk_size", read_chunk_bytes),
        ("grpc.experimental.tcp_min_read_chunk_size", min(256 << 10, read_chunk_bytes)),
        ("grpc.experimental.tcp_max_read_chunk_size", 2 * read_chunk_bytes),
    ]


@dataclass(frozen=True)
class ServingLimits:
    """Sizes, deadlines and per-caller limits of one server."""

    max_message_bytes: int = 16 << 20  # one gRPC message, received or sent
    max_streams_per_connection: int = 64  # HTTP/2 streams one connection may have open
    header_timeout: float = 10.0  # seconds from a call's headers to its (first) request message
    call_timeout: float = 30.0  # seconds a whole call may take
    max_calls_per_caller: int = 8  # calls in flight of one connection, every method together
    read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES  # socket reads (0: gRPC's own sizes)

    def __post_init__(self) -> None:
        for name in ("header_timeout", "call_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"ServingLimits.{name}: expected seconds > 0, got {value!r}")
        for name in (
            "max_message_bytes",
            "max_streams_per_connection",
            "max_calls_per_caller",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServingLimits.{name}: expected an integer >= 1, got {value!r}")
        check_read_chunk(self.read_chunk_bytes, "ServingLimits")

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            *read_chunk_options(self.read_chunk_bytes),
        ]


def check_read_chunk(value: object, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 30:
        raise ValueError(
            f"{owner}.read_chunk_bytes: expected an integer in [0, 2**30] (0: gRPC's own "
            f"sizes), got {value!r}"
        )


@dataclass(frozen=True)
class Method:
    """One RPC of a service: its behaviour and how its messages are (de)serialised.

    `request`: parses the request bytes (a protobuf message's FromString); None hands the
    behaviour the raw bytes (it parses them itself). `streaming_request`: the behaviour takes
    an async iterator of requests and bounds its own reads (module docstring);
    `streaming_response` as well: it writes its answers with `context.write` and bounds them.
    """

    name: str
    behavior: Behavior
    response: Callable[[Any], bytes]
    request: Callable[[bytes], Any] | None = None
    streaming_request: bool = False
    streaming_response: bool = False

    def __post_init__(self) -> None:
        if self.streaming_response and not self.streaming_request:
            raise ValueError(f"Method {self.name}: a streamed answer needs a streamed request")


class CallerSlots:
    """Calls in flight per caller, at most `limit` each (one event loop's calls: not locked).

    `hold(key, context)` is an async context manager that aborts the call with
    RESOURCE_EXHAUSTED when the caller `key` already has `limit` calls in flight.
    """

    def __init__(self, limit: int, what: str = "calls") -> None:
        if limit < 1:
            raise ValueError(f"CallerSlots: expected a limit >= 1, got {limit}")
        self.limit = limit
        self._what = what
        self._in_flight: dict[Hashable, int] = {}

    def in_flight(self, key: Hashable) -> int:
        return self._in_flight.get(key, 0)

    def hold(self, key: Hashable, context: grpc.aio.ServicerContext) -> _Slot:
        return _Slot(self, key, context)


class _Slot:
    def __init__(self, slots: CallerSlots, key: Hashable, context: grpc.aio.ServicerContext):
        self._slots, self._key, self._context = slots, key, context

    async def __aenter__(self) -> None:
        slots = self._slots
        held = slots._in_flight.get(self._key, 0)
        if held >= slots.limit:
            await self._context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{slots._what}: at most {slots.limit} in flight per caller",
            )
        slots._in_flight[self._key] = held + 1

    async def __aexit__(self, *exc: object) -> None:
        left = self._slots._in_flight.pop(self._key) - 1
        if left:
            self._slots._in_flight[self._key] = left


def bounded_handler(
    service: str, methods: Sequence[Method], limits: ServingLimits, bound_streams: bool = False
) -> grpc.GenericRpcHandler:
    """The generic handler of `service`, every method bounded as the module docstring says."""
    slots = CallerSlots(limits.max_calls_per_caller, f"{service} calls")
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in methods:
        if method.streaming_response:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _per_connection(method.behavior, slots),
                request_deserializer=method.request,
                response_serializer=method.response,
            )
        elif method.streaming_request:
            behavior = method.behavior
            if bound_streams:
                behavior = _with_call_deadline(behavior, limits)
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _per_connection(behavior, slots),
                request_deserializer=method.request,
                response_serializer=method.response,
            )
        else:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _per_connection(_unary_with_deadlines(method, limits), slots),
                response_serializer=method.response,
            )
    return grpc.method_handlers_generic_handler(service, handlers)


def _per_connection(behavior: Behavior, slots: CallerSlots) -> Behavior:
    """`behavior` holding one of its connection's slots for the whole call."""

    async def served(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async with slots.hold(context.peer(), context):
            return await behavior(requests, context)

    return served


def _unary_with_deadlines(method: Method, limits: ServingLimits) -> Behavior:
    """A unary behaviour served as a stream: its request must come within the header deadline,
    parse, and the call must end within the completion deadline."""
    parse, behavior = method.request, method.behavior
    expected = _message_name(parse)

    async def served(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        loop = asyncio.get_running_loop()
        started = loop.time()
        header_deadline = started + min(limits.header_timeout, limits.call_timeout)
        try:
            async with asyncio.timeout_at(header_deadline) as scope:
                raw = await anext(requests, None)
        except TimeoutError:
            if not scope.expired():
                raise
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request: not received within {limits.header_timeout:g} s of the call's headers",
            )
        if raw is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: expected {expected}")
        request: Any = raw
        if parse is not None:
            try:
                request = parse(raw)
            except DecodeError:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"request: expected {expected}"
                )
        try:
            async with asyncio.timeout_at(started + limits.call_timeout) as scope:
                return await behavior(request, context)
        except TimeoutError:
            if not scope.expired():
                raise
            await _abort_late(context, limits)

    return served


def _with_call_deadline(behavior: Behavior, limits: ServingLimits) -> Behavior:
    async def served(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async with asyncio.timeout(limits.call_timeout) as scope:
                return await behavior(requests, context)
        except TimeoutError:
            if not scope.expired():
                raise
            await _abort_late(context, limits)

    return served


async def _abort_late(context: grpc.aio.ServicerContext, limits: ServingLimits) -> None:
    await context.abort(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"call: not finished within {limits.call_timeout:g} s",
    )


def _message_name(parse: Callable[[bytes], Any] | None) -> str:
    owner = getattr(parse, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    name = getattr(descriptor, "name", None)
    return f"a {name} message" if name else "one request message"


class ServerLoop:
    """An asyncio event loop on a thread of its own, driven from synchronous code."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> futures.Future[_T]:
        """Schedule `coroutine` on the loop; its result comes in the returned future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run `coroutine` on the loop and wait for its result (never from the loop's own
        thread: that would wait forever, so it raises RuntimeError instead)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("ServerLoop.run called from its own loop: it would never return")
        return self.submit(coroutine).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class SharedLoop:
    """The one event loop thread that serves every gRPC server and client channel of this
    process, handed out as leases (`lease`); the thread starts with the first lease and stops
    when the last one is closed.

    Why one: grpc.aio hands every completion from its poller thread to the event loop that
    owns the call. With a loop thread per peer, each envelope woke its receiver's loop alone,
    and a process running 32 peers had a hundred threads handing one interpreter lock around
    (docs/benchmarks.md, "Engine, one process"). One loop takes a batch of completions per
    wake-up, for every peer. Nothing on it may block: handlers and client calls are
    coroutines, and blocking work goes to `BlockingWork`.
    """

    def __init__(self, name: str = "gossipcomp-grpc-loop") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: ServerLoop | None = None
        self._leases = 0
        self._pid = os.getpid()

    def lease(self) -> LoopLease:
        """A lease on the loop (started if none is running); close it when done."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._loop, self._leases, self._pid = None, 0, os.getpid()
            if self._loop is None:
                self._loop = ServerLoop(self._name)
            self._leases += 1
            return LoopLease(self, self._loop)

    def _release(self) -> None:
        with self._lock:
            self._leases -= 1
            if self._leases or self._loop is None:
                return
            loop, self._loop = self._loop, None
        loop.close()


class LoopLease:
    """One user's hold on the `SharedLoop`: run coroutines on it; `close` once, when done."""

    def __init__(self, shared: SharedLoop, loop: ServerLoop) -> None:
        self._shared: SharedLoop | None = shared
        self._loop = loop

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> futures.Future[_T]:
        """Schedule `coroutine` on the loop; its result comes in the returned future."""
        return self._loop.submit(coroutine)

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run `coroutine` on the loop and wait for its result."""
        return self._loop.run(coroutine)

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared._release()


PROCESS_LOOP = SharedLoop()  # every server and transport of this process runs on this loop


class AsyncServer:
    """A started grpc.aio server with the health service, on a lease of `shared` (the
    process's one loop unless told otherwise).

    `handlers` come from `bounded_handler`; `health_services` are reported SERVING once the
    server listens. Raises OSError when `bind` cannot be listened on, naming `who`.
    """

    def __init__(
        self,
        who: str,
        bind: str,
        handlers: Sequence[grpc.GenericRpcHandler],
        limits: ServingLimits,
        credentials: grpc.ServerCredentials | None = None,
        health_services: Sequence[str] = ("",),
        shared: SharedLoop = PROCESS_LOOP,
    ) -> None:
        self.limits = limits
        self._loop = shared.lease()
        self._stopped = False
        try:
            port = self._loop.run(self._start(bind, handlers, credentials, tuple(health_services)))
        except BaseException:
            self._close_loop()
            raise
        if port == 0:
            self._close_loop()
            raise OSError(f"{who}: cannot listen on {bind!r}")
        self.port = port
        self.address = f"{bind.rsplit(':', 1)[0]}:{port}"

    async def _start(
        self,
        bind: str,
        handlers: Sequence[grpc.GenericRpcHandler],
        credentials: grpc.ServerCredentials | None,
        health_services: tuple[str, ...],
    ) -> int:
        """Create, bind and start the server on the loop (grpc.aio objects belong to it)."""
        self._server = grpc.aio.server(options=self.limits.server_options())
        self._server.add_generic_rpc_handlers(tuple(handlers))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if credentials is None:
            port = self._server.add_insecure_port(bind)
        else:
            port = self._server.add_secure_port(bind, credentials)
        if port:
            await self._server.start()
            for service in health_services:
                await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return port

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run `coroutine` on the server's loop and wait for its result."""
        return self._loop.run(coroutine)

    async def _stop(self, grace: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace=grace)

    def stop(self, grace: float = 0.5) -> None:
        """Stop serving (calls in flight get `grace` seconds) and end the loop's thread."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._loop.run(self._stop(grace))
        finally:
            self._close_loop()

    def wait(self) -> None:
        """Block until the server stops."""
        self._loop.run(self._server.wait_for_termination())

    def _close_loop(self) -> None:
        self._loop.close()


class BlockingWork:
    """A few threads for handlers' blocking work, so it never stalls the server's event loop;
    only calls whose request has arrived (and was checked) take one."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"BlockingWork: expected workers >= 1, got {workers}")
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    async def run(self, work: Callable[[], _T]) -> _T:
        """Run `work` on one of the threads (from a handler on the server's loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
