"""The real transport: one gRPC server per peer, envelopes client-streamed to each neighbour.

Each peer serves `Gossip.Hello` (handshake) and `Gossip.Push` (receive one envelope) plus the
standard gRPC health service, and pushes its own envelopes to its neighbours. Every call has a
deadline; message size limits are set on both ends; every envelope is validated (header before
data, values after) before it reaches the mailbox, so nothing invalid is ever handed to an
algorithm.

With `GrpcOptions.tls` set, the server and every channel use mutual TLS (gossipcomp.security):
only peers holding a certificate from the network's CA can connect. Plaintext is the default.
With `GrpcOptions.keys` as well, every envelope and handshake is signed by its sender and
checked by its receiver (gossipcomp.transport.authentication) before anything else is looked at;
authentication without TLS is refused at start.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Collection,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
)
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any

import grpc

from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.proto.v1 import gossip_pb2_grpc as pb_grpc
from gossipcomp.security.signing_keys import PeerKeys
from gossipcomp.security.tls import TlsFiles, channel_credentials, server_credentials
from gossipcomp.text import quoted
from gossipcomp.transport.allocator import keep_heap_warm
from gossipcomp.transport.authentication import DEFAULT_CLOCK_TOLERANCE, Authenticator
from gossipcomp.transport.base import (
    MAX_SCHEDULE_EPOCH,
    MAX_WIRE_ROUND,
    Envelope,
    EnvelopeRejected,
    ExchangeResult,
    HandshakeError,
    HelloAnswer,
    HelloHandler,
    Identity,
    Payload,
    PayloadSpec,
    PeerNotReady,
    PeerUnreachableError,
    RejectCode,
    epoch_mismatch,
    no_rejoin,
)
from gossipcomp.transport.buffers import BufferPool
from gossipcomp.transport.inbox import Inbox
from gossipcomp.transport.mailbox import Mailbox
from gossipcomp.transport.schedules import (
    MAX_SHARED_SCHEDULES,
    SCHEDULE_CALLS_PER_CALLER,
    ScheduleSource,
)
from gossipcomp.transport.serving import (
    DEFAULT_READ_CHUNK_BYTES,
    PROCESS_LOOP,
    AsyncServer,
    CallerSlots,
    Method,
    ServingLimits,
    bounded_handler,
    check_read_chunk,
    read_chunk_options,
)
from gossipcomp.transport.wire import (
    DEFAULT_CHUNK_BYTES,
    ContentCheck,
    EnvelopeReader,
    content_sha256,
    envelope_chunks,
    header_of,
    with_header,
)

SERVICE_NAME = "gossipcomp.v1.Gossip"
WHY_AUTHENTICATION_NEEDS_TLS = (
    "signatures prove who sent a message but hide nothing, and without TLS anyone on the path "
    "can read the models and capture messages to replay"
)
WHY_PLAINTEXT_STAYS_ON_LOOPBACK = (
    "plaintext trusts everyone who can reach the port: any process that connects can claim to "
    "be a neighbour, forge envelopes and poison the model"
)


@dataclass(frozen=True)
class GrpcOptions:
    """Limits, timings and security of the gRPC transport."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # data bytes per streamed chunk
    max_message_bytes: int = 16 << 20  # one gRPC message (a chunk plus its header), both ends
    max_envelope_bytes: int = 1 << 30  # a whole envelope, checked from its header
    hello_timeout: float = 2.0  # deadline of one handshake attempt
    mailbox_window: int = 4  # rounds a neighbour may run ahead
    tls: TlsFiles | None = None  # mutual TLS with these files; None: plaintext
    keys: PeerKeys | None = None  # sign and check every message with these keys (needs tls)
    clock_tolerance: float = DEFAULT_CLOCK_TOLERANCE  # seconds a signed timestamp may be off
    insecure: bool = False  # allow plaintext on an address other than loopback
    # seconds a stream has to send its header (never beyond the stream's own deadline): on a
    # slow link a header waits behind the previous envelope's bytes in the connection's
    # buffers (10 Mbit/s and 4.5 MB envelopes: over 2 s, so 2 s failed exchanges there)
    first_chunk_timeout: float = 10.0
    stream_timeout: float = 30.0  # seconds a stream has to deliver its whole envelope
    max_streams_per_caller: int = 8  # envelopes in flight per (sender, connection)
    max_streams_per_connection: int = 64  # HTTP/2 streams one connection may have open
    # receive buffers (>= 1 MiB) reused once nothing refers to them, at most this many bytes
    # in all; 0: a fresh buffer per envelope (faulted and zeroed by the kernel every time)
    receive_pool_bytes: int = 256 << 20
    # glibc serves gRPC's megabyte buffers from a warm heap instead of fresh pages, for the
    # whole process (transport/allocator.py); False leaves the C library's defaults
    warm_heap: bool = True
    read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES  # socket reads, both ends (0: gRPC's own)

    def __post_init__(self) -> None:
        for name in ("hello_timeout", "first_chunk_timeout", "stream_timeout", "clock_tolerance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"GrpcOptions.{name}: expected seconds > 0, got {value}")
        for name in (
            "chunk_bytes",
            "max_message_bytes",
            "max_envelope_bytes",
            "mailbox_window",
            "max_streams_per_caller",
            "max_streams_per_connection",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"GrpcOptions.{name}: expected >= 1, got {getattr(self, name)}")
        check_read_chunk(self.read_chunk_bytes, "GrpcOptions")
        if self.receive_pool_bytes < 0:
            raise ValueError(
                f"GrpcOptions.receive_pool_bytes: expected >= 0, got {self.receive_pool_bytes}"
            )

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            *read_chunk_options(self.read_chunk_bytes),
        ]


_STATUS = {code.name: code for code in grpc.StatusCode}


def is_loopback(bind: str) -> bool:
    """Whether a `host:port` address only accepts connections from this machine."""
    host = bind.rsplit(":", 1)[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or 0.0.0.0 / [::] (every interface)


class _GossipService:
    """Server side: handshake checks, rejoin requests and validated delivery into the inbox.

    Runs on the transport's asyncio event loop, so a stream that waits holds no thread: no
    number of idle or trickling streams can starve the neighbours or the health service. Each
    stream must deliver its header within `first_chunk_timeout` and its whole envelope within
    `stream_timeout`, and one caller (claimed sender on one connection) may have at most
    `max_streams_per_caller` envelopes in flight. Callers that are not authenticated (no TLS)
    are told nothing of this peer's state in refusals (EnvelopeRejected.public).
    """

    def __init__(
        self,
        identity: Identity,
        inbox: Inbox,
        authenticator: Authenticator | None,
        options: GrpcOptions,
        callers_verified: bool,
    ) -> None:
        self._identity = identity
        self._inbox = inbox
        self._auth = authenticator
        self._options = options
        self._callers_verified = callers_verified
        # envelopes in flight per caller (a sender whose header was checked, on one connection)
        self._envelopes = CallerSlots(options.max_streams_per_caller, "envelopes")
        self._buffers = BufferPool(options.receive_pool_bytes)
        self.on_hello: HelloHandler = no_rejoin
        self.on_schedules: ScheduleSource = lambda sender, epoch: b""  # none until a peer says
        # Schedules answers in flight per caller (claimed sender on one connection)
        self._schedule_calls = CallerSlots(SCHEDULE_CALLS_PER_CALLER, "Schedules calls")

    async def _refuse(self, context: grpc.aio.ServicerContext, refused: EnvelopeRejected) -> None:
        code, details = refused.code.value, str(refused)
        if not self._callers_verified:  # strangers learn nothing of our state
            details = refused.public
            if code == "ALREADY_EXISTS":  # would say which rounds arrived, hence ours
                code = "FAILED_PRECONDITION"
        await context.abort(_STATUS[code], details)

    async def Hello(
        self, request: pb.HelloRequest, context: grpc.aio.ServicerContext
    ) -> pb.HelloReply:
        try:
            answer = self._answer_hello(request)
        except EnvelopeRejected as refused:
            await self._refuse(context, refused)
        except PeerNotReady as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        reply = pb.HelloReply(
            protocol_version=self._identity.protocol_version,
            receiver=self._identity.rank,
            topology_hash=self._identity.topology_hash,
            model_signature=self._identity.model_signature,
            round=answer.round,
            resume_round=answer.resume_round,
            alone=answer.alone,
            schedule_epoch=answer.schedule_epoch,
        )
        if self._auth is not None:
            self._auth.prove_reply(reply, request)
        return reply

    async def Schedules(self, request: pb.HelloRequest, context: grpc.aio.ServicerContext) -> bytes:
        """The schedules this peer holds past the asking neighbour's epoch: a handshake's
        checks, then the peer's own serialised list (built when its schedules change, never
        per request; changes nothing here). One caller has at most SCHEDULE_CALLS_PER_CALLER
        answers in flight."""
        try:
            self._check_hello(request)
        except EnvelopeRejected as refused:
            await self._refuse(context, refused)
        async with self._schedule_calls.hold((request.sender, context.peer()), context):
            return self.on_schedules(request.sender, request.schedule_epoch)

    def _answer_hello(self, request: pb.HelloRequest) -> HelloAnswer:
        """Check a handshake and answer it; raises EnvelopeRejected naming the field."""
        self._check_hello(request)
        return self.on_hello(
            request.sender,
            request.round,
            request.proposed_resume_round,
            request.alone,
            request.schedule_epoch,
        )

    def _check_hello(self, request: pb.HelloRequest) -> None:
        """Check a handshake (proof, identity, sender, ranges); raises EnvelopeRejected
        naming the field."""
        mine = self._identity
        if self._auth is not None:  # before anything else: strangers learn nothing
            self._auth.check_hello(request)
        for field, ours, theirs in (
            ("protocol_version", mine.protocol_version, request.protocol_version),
            ("topology_hash", mine.topology_hash, request.topology_hash),
            ("model_signature", mine.model_signature, request.model_signature),
        ):
            if ours != theirs:
                raise EnvelopeRejected(
                    RejectCode.FAILED_PRECONDITION,
                    f"{field} mismatch: peer {mine.rank} has {ours!r}, "
                    f"peer {request.sender} sent {quoted(theirs)}",
                    public=f"{field} mismatch: peer {request.sender} sent {quoted(theirs)}, "
                    f"which is not peer {mine.rank}'s",
                )
        if request.sender not in self._inbox.neighbours:
            raise EnvelopeRejected(
                RejectCode.PERMISSION_DENIED,
                f"sender: peer {request.sender} is not a neighbour of peer {mine.rank} "
                f"(expected one of {sorted(self._inbox.neighbours)})",
            )
        for field, value, limit, shown in (
            ("round", request.round, MAX_WIRE_ROUND, "2^53"),
            ("proposed_resume_round", request.proposed_resume_round, MAX_WIRE_ROUND, "2^53"),
            ("schedule_epoch", request.schedule_epoch, MAX_SCHEDULE_EPOCH + 1, "2^31"),
        ):
            if not 0 <= value < limit:
                raise EnvelopeRejected(
                    RejectCode.INVALID_ARGUMENT,
                    f"{field}: expected 0 <= {field} < {shown}, got {value}",
                )
        if request.proposed_resume_round and request.proposed_resume_round <= request.round:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"proposed_resume_round: expected 0 (none) or more than round {request.round}, "
                f"got {request.proposed_resume_round}",
            )

    async def Push(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.PushReply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._options.stream_timeout
        first = await self._next_chunk(
            request_iterator,
            context,
            min(deadline, loop.time() + self._options.first_chunk_timeout),
        )
        try:
            reader = EnvelopeReader(
                first, self._check_header, self._check_content(), self._buffers.take
            )
        except EnvelopeRejected as refused:
            await self._refuse(context, refused)
        async with self._envelopes.hold((reader.sender, context.peer()), context):
            try:
                await self._read_rest(request_iterator, reader, context, deadline)
                envelope, spec, wire_bytes = reader.finish()
                self._inbox.accept(envelope, spec, wire_bytes, values_checked=True)
            except EnvelopeRejected as refused:
                await self._refuse(context, refused)
        return pb.PushReply(received_bytes=wire_bytes)

    async def _next_chunk(
        self,
        chunks: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
        deadline: float,
    ) -> bytes | None:
        """The stream's next chunk, None at its end; aborts the call with DEADLINE_EXCEEDED
        if it does not come by `deadline` (the event loop's clock)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(chunks)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            await self._abort_late(context)
            raise  # abort raises; this keeps type checkers aware

    async def _read_rest(
        self,
        chunks: AsyncIterator[bytes],
        reader: EnvelopeReader,
        context: grpc.aio.ServicerContext,
        deadline: float,
    ) -> None:
        """Feed the stream's remaining chunks to `reader`, aborting the call with
        DEADLINE_EXCEEDED if the stream has not ended by `deadline`: one timer for the whole
        stream (a timer per chunk cost a task per chunk)."""
        try:
            async with asyncio.timeout_at(deadline):
                async for raw in chunks:
                    reader.add(raw)
        except TimeoutError:
            await self._abort_late(context)

    async def _abort_late(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "stream: header or data not received in time (a stream must send its header "
            f"within {self._options.first_chunk_timeout:g} s and finish within "
            f"{self._options.stream_timeout:g} s)",
        )

    async def PushOne(self, request: bytes, context: grpc.aio.ServicerContext) -> pb.PushReply:
        try:
            reader = EnvelopeReader(request, self._check_header, self._check_content())
            envelope, spec, wire_bytes = reader.finish()
            self._inbox.accept(envelope, spec, wire_bytes, values_checked=True)
        except EnvelopeRejected as refused:
            await self._refuse(context, refused)
        return pb.PushReply(received_bytes=wire_bytes)

    def _check_content(self) -> ContentCheck | None:
        return self._auth.check_content if self._auth is not None else None

    def _check_header(self, header: pb.EnvelopeHeader) -> PayloadSpec:
        if self._auth is not None:  # who sent it first; what it holds only then
            self._auth.check_envelope(header)
        return self._inbox.check_header(header)


class _Pushes:
    """One exchange's pushes, run together on the loop: each one's outcome (bytes sent, or
    the error), when each was delivered, and the mailbox told at once of a refused push."""

    def __init__(self, mailbox: Mailbox, round: int, phase: str, start: float) -> None:
        self._mailbox, self._round, self._phase, self._start = mailbox, round, phase, start
        self.outcomes: dict[int, int | BaseException] = {}
        self.delivered: dict[int, float] = {}  # neighbour -> seconds until it acknowledged

    async def run(self, pushes: Mapping[int, Coroutine[Any, Any, int]]) -> None:
        await asyncio.gather(*(self._one(j, push) for j, push in pushes.items()))

    async def _one(self, neighbour: int, push: Coroutine[Any, Any, int]) -> None:
        try:
            self.outcomes[neighbour] = await push
            self.delivered[neighbour] = time.monotonic() - self._start
        except asyncio.CancelledError:
            self._mailbox.abandon(self._round, self._phase, neighbour)
            raise
        except Exception as error:  # the exchange reports it (or raises what is not gRPC's)
            self.outcomes[neighbour] = error
            self._mailbox.abandon(self._round, self._phase, neighbour)


async def _unary(method: grpc.aio.UnaryUnaryMultiCallable, request: Any, timeout: float) -> Any:
    """One unary call made on the loop (a grpc.aio call belongs to the loop it starts on)."""
    return await method(request, timeout=timeout)


async def _close_channels(channels: Collection[grpc.aio.Channel]) -> None:
    for channel in channels:
        await channel.close()


def _signed_header(
    auth: Authenticator, envelope: Envelope, receiver: int, content: bytes
) -> pb.EnvelopeHeader:
    """The envelope's header with a proof for `receiver` (`content`: its data's SHA-256)."""
    header = header_of(envelope)
    auth.prove_envelope(header, receiver, content)
    return header


def _handlers(service: _GossipService, limits: ServingLimits) -> grpc.GenericRpcHandler:
    """The Gossip service with Push reading serialised chunks (parsed in wire.py, not by gRPC);
    a malformed HelloRequest is INVALID_ARGUMENT (serving.py parses it), not UNKNOWN."""
    return bounded_handler(
        SERVICE_NAME,
        (
            Method(
                "Hello",
                service.Hello,
                pb.HelloReply.SerializeToString,
                request=pb.HelloRequest.FromString,
            ),
            Method("Push", service.Push, pb.PushReply.SerializeToString, streaming_request=True),
            Method("PushOne", service.PushOne, pb.PushReply.SerializeToString),
            Method(
                "Schedules",
                service.Schedules,
                bytes,  # served already serialised (ScheduleSource)
                request=pb.HelloRequest.FromString,
            ),
        ),
        limits,
    )


def _serving_limits(options: GrpcOptions) -> ServingLimits:
    """The server's limits from the transport's options (Push bounds its own stream)."""
    return ServingLimits(
        max_message_bytes=options.max_message_bytes,
        max_streams_per_connection=options.max_streams_per_connection,
        header_timeout=options.first_chunk_timeout,
        call_timeout=options.stream_timeout,
        # every method together, per connection: in-process peers share one connection
        max_calls_per_caller=options.max_streams_per_connection,
        read_chunk_bytes=options.read_chunk_bytes,
    )


class GrpcTransport:
    """A peer's gRPC endpoint: serves its neighbours and pushes envelopes to them."""

    def __init__(
        self,
        identity: Identity,
        neighbours: Collection[int],
        bind: str = "127.0.0.1:0",
        options: GrpcOptions | None = None,
    ) -> None:
        self.rank = identity.rank
        self.schedule_epoch = 0
        self._identity = identity
        self._neighbours = sorted(neighbours)
        self._options = options or GrpcOptions()
        tls, keys = self._options.tls, self._options.keys
        if keys is not None and tls is None:
            raise ValueError(
                f"peer {self.rank}: signing keys (GrpcOptions.keys) need mutual TLS "
                f"(GrpcOptions.tls): {WHY_AUTHENTICATION_NEEDS_TLS}"
            )
        if tls is None and not self._options.insecure and not is_loopback(bind):
            raise ValueError(
                f"peer {self.rank}: refusing to serve plaintext on {quoted(bind)}, which is not "
                f"a loopback address: {WHY_PLAINTEXT_STAYS_ON_LOOPBACK}. Use mutual TLS "
                "(--tls-cert/--tls-key/--tls-ca; GrpcOptions.tls), or accept the risk with "
                "--insecure (GrpcOptions.insecure)"
            )
        if self._options.warm_heap:
            keep_heap_warm()
        credentials = server_credentials(tls) if tls else None  # files checked before starting
        self._channel_credentials = channel_credentials(tls) if tls else None
        self._auth = Authenticator(self.rank, keys, self._options.clock_tolerance) if keys else None
        self.inbox = Inbox(
            self.rank, neighbours, self._options.max_envelope_bytes, self._options.mailbox_window
        )
        self._service = _GossipService(
            identity, self.inbox, self._auth, self._options, callers_verified=tls is not None
        )
        limits = _serving_limits(self._options)
        self._server = AsyncServer(
            f"peer {self.rank}",
            bind,
            (_handlers(self._service, limits),),
            limits,
            credentials,
            health_services=("", SERVICE_NAME),
        )
        self.address = self._server.address
        # the client side runs on the same process-wide loop as the server: a push is a
        # coroutine there, not a thread (docs/benchmarks.md, "Engine, one process")
        self._loop = PROCESS_LOOP.lease()
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, pb_grpc.GossipStub] = {}
        self._pushers: dict[int, grpc.aio.StreamUnaryMultiCallable] = {}
        self._push_ones: dict[int, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._closed = False

    def set_hello_handler(self, handler: HelloHandler) -> None:
        self._service.on_hello = handler

    def set_schedule_source(self, source: ScheduleSource) -> None:
        self._service.on_schedules = source

    def fetch_schedules(self, neighbour: int) -> futures.Future[list[cpb.Schedule]]:
        """See transport/schedules.py: a handshake-proved request to `neighbour`'s address."""
        if neighbour not in self._stubs:
            raise RuntimeError(f"peer {self.rank}: schedules asked before connect()")
        request = self._hello_request(neighbour, 0, 0, False)
        stub, timeout = self._stubs[neighbour], self._options.hello_timeout

        async def fetch() -> list[cpb.Schedule]:
            held = list((await stub.Schedules(request, timeout=timeout)).schedules)
            if len(held) > MAX_SHARED_SCHEDULES:
                raise EnvelopeRejected(
                    RejectCode.INVALID_ARGUMENT,
                    f"schedules from peer {neighbour}: {len(held)}, at most {MAX_SHARED_SCHEDULES}",
                )
            return held

        return self._loop.submit(fetch())  # refused, unanswered, too many: the future fails

    def connect(
        self,
        addresses: Mapping[int, str],
        timeout: float,
        round: int = 0,
        proposals: Mapping[int, int] | None = None,
        alone: bool = False,
    ) -> dict[int, HelloAnswer]:
        """Open channels to every neighbour and handshake, retrying until `timeout` seconds.

        Neighbours may start in any order: unreachable ones are retried with backoff. A
        mismatching neighbour raises HandshakeError at once; still unreachable ones at the end
        raise PeerUnreachableError naming them and their addresses. `round` is this peer's
        round (non-zero when restored from a checkpoint): the mailbox opens at it before anyone
        is greeted; `proposals` asks given neighbours to resume their edge at (at least) a round.
        Returns each neighbour's answer (its round, and a resume round if the edge must be
        resynchronised).
        """
        missing = [j for j in self._neighbours if j not in addresses]
        if missing:
            raise ValueError(f"peer {self.rank}: no address for neighbours {missing}")
        self._loop.run(self._open_channels(addresses))
        self.inbox.open_round(round)
        proposals = proposals or {}
        answers: dict[int, HelloAnswer] = {}
        deadline = time.monotonic() + timeout
        pending = set(self._neighbours)
        last_error: dict[int, str] = {}
        backoff = 0.05
        while pending:
            for j in sorted(pending):
                attempt = min(self._options.hello_timeout, max(0.05, deadline - time.monotonic()))
                try:
                    request = self._hello_request(j, round, proposals.get(j, 0), alone)
                    reply = self._loop.run(_unary(self._stubs[j].Hello, request, attempt))
                    answers[j] = self._answer(j, request, reply)
                    pending.discard(j)
                except EnvelopeRejected as refused:
                    raise HandshakeError(
                        f"peer {self.rank}: handshake reply from peer {j} at {addresses[j]} "
                        f"not accepted: {refused}"
                    ) from None
                except grpc.RpcError as error:
                    code = error.code()
                    if code in (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.UNAUTHENTICATED,
                    ):
                        raise HandshakeError(
                            f"peer {self.rank}: handshake with peer {j} at {addresses[j]} refused: "
                            f"{error.details()}"
                        ) from None
                    last_error[j] = f"{code.name}: {error.details()}"
            if not pending:
                break
            if time.monotonic() >= deadline:
                described = ", ".join(
                    f"peer {j} at {addresses[j]} ({last_error.get(j, 'no answer')})"
                    for j in sorted(pending)
                )
                raise PeerUnreachableError(
                    f"peer {self.rank}: neighbours not reachable within {timeout:g} s: {described}"
                )
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 1.0)
        return answers

    async def _open_channels(self, addresses: Mapping[int, str]) -> None:
        """A channel per neighbour not yet connected, made on the loop (grpc.aio channels
        belong to the loop they are made on)."""
        for j in self._neighbours:
            if j in self._channels:
                continue
            channel = self._channel(addresses[j])
            self._channels[j] = channel
            self._stubs[j] = pb_grpc.GossipStub(channel)
            self._pushers[j] = channel.stream_unary(  # chunks arrive serialised already
                f"/{SERVICE_NAME}/Push", response_deserializer=pb.PushReply.FromString
            )
            self._push_ones[j] = channel.unary_unary(
                f"/{SERVICE_NAME}/PushOne", response_deserializer=pb.PushReply.FromString
            )

    def _channel(self, address: str) -> grpc.aio.Channel:
        options = self._options.channel_options()
        if self._channel_credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._channel_credentials, options=options)

    def _hello_request(
        self, neighbour: int, round: int, proposed: int, alone: bool
    ) -> pb.HelloRequest:
        request = pb.HelloRequest(
            protocol_version=self._identity.protocol_version,
            sender=self.rank,
            topology_hash=self._identity.topology_hash,
            model_signature=self._identity.model_signature,
            round=round,
            proposed_resume_round=proposed,
            alone=alone,
            schedule_epoch=self.schedule_epoch,
        )
        if self._auth is not None:
            self._auth.prove_hello(request, neighbour)
        return request

    def _answer(
        self, neighbour: int, request: pb.HelloRequest, reply: pb.HelloReply
    ) -> HelloAnswer:
        """A neighbour's handshake reply, once its proof (when peers authenticate) is checked;
        raises EnvelopeRejected when it is not from that neighbour or not for this request."""
        if self._auth is not None:
            self._auth.check_reply(reply, request, neighbour)
        if not 0 <= reply.schedule_epoch <= MAX_SCHEDULE_EPOCH:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"reply schedule_epoch: expected 0..{MAX_SCHEDULE_EPOCH}, got "
                f"{reply.schedule_epoch}",
            )
        return HelloAnswer(reply.round, reply.resume_round, reply.alone, reply.schedule_epoch)

    def probe(
        self, neighbour: int, round: int, proposed: int, alone: bool
    ) -> futures.Future[HelloAnswer]:
        """Ask a lost neighbour, without blocking, to resume the edge (a Hello with our round and
        a proposed resume round); the future fails if it does not answer within hello_timeout."""
        if neighbour not in self._stubs:
            raise RuntimeError(f"peer {self.rank}: probe before connect()")
        request = self._hello_request(neighbour, round, proposed, alone)
        stub, timeout = self._stubs[neighbour], self._options.hello_timeout

        async def ask() -> HelloAnswer:
            return self._answer(neighbour, request, await stub.Hello(request, timeout=timeout))

        return self._loop.submit(ask())  # refused, unanswered, cancelled: the future fails

    def send(self, neighbour: int, envelope: Envelope, deadline: float) -> int:
        """Stream one envelope to a neighbour before `deadline` (time.monotonic); return its bytes.

        Raises grpc.RpcError with the receiver's status when it refuses the envelope.
        """
        chunks = self._lazy_chunks(neighbour, envelope)
        return self._loop.run(self._stream(neighbour, chunks, deadline))

    def _lazy_chunks(self, neighbour: int, envelope: Envelope) -> Iterator[bytes]:
        """The envelope's chunks for `neighbour`, each built as gRPC asks for it."""
        header = None
        if self._auth is not None:
            header = _signed_header(self._auth, envelope, neighbour, content_sha256(envelope))
        return envelope_chunks(envelope, self._options.chunk_bytes, header)

    async def _stream(self, neighbour: int, chunks: Iterable[bytes], deadline: float) -> int:
        sent = 0

        def counted() -> Iterator[bytes]:
            nonlocal sent
            for chunk in chunks:
                sent += len(chunk)
                yield chunk

        timeout = max(0.001, deadline - time.monotonic())
        await self._pushers[neighbour](counted(), timeout=timeout)
        return sent

    async def _push_one(self, neighbour: int, chunk: bytes, deadline: float) -> int:
        timeout = max(0.001, deadline - time.monotonic())
        await self._push_ones[neighbour](chunk, timeout=timeout)
        return len(chunk)

    def exchange(
        self,
        round: int,
        phase: str,
        outgoing: Mapping[int, Payload],
        timeout: float,
        schedule_epoch: int = 0,
    ) -> ExchangeResult:
        if not self._stubs:
            raise RuntimeError(f"peer {self.rank}: exchange before connect()")
        start = time.monotonic()
        deadline = start + timeout
        self.inbox.open_round(round)
        # One payload sent to several neighbours is chunked (and hashed) once; when peers
        # authenticate, only its first chunk is rebuilt per receiver, with a signed header. A
        # payload of several chunks for one neighbour only is streamed as its chunks are built
        # (`send`): building all 64 MiB first cost as much as sending them.
        receivers = Counter(id(payload) for payload in outgoing.values())
        chunked: dict[int, tuple[Envelope, list[bytes], bytes]] = {}
        pushes: dict[int, Coroutine[Any, Any, int]] = {}
        sizes: dict[int, int] = {}
        for j, payload in outgoing.items():
            notice = self.inbox.notice_for(j)
            if receivers[id(payload)] == 1 and _data_bytes(payload) > self._options.chunk_bytes:
                envelope = Envelope(self.rank, round, phase, payload, schedule_epoch, notice=notice)
                pushes[j] = self._stream(j, self._lazy_chunks(j, envelope), deadline)
                continue
            if id(payload) not in chunked:
                envelope = Envelope(self.rank, round, phase, payload, schedule_epoch)
                chunks = list(envelope_chunks(envelope, self._options.chunk_bytes))
                content = content_sha256(envelope) if self._auth is not None else b""
                chunked[id(payload)] = (envelope, chunks, content)
            envelope, chunks, content = chunked[id(payload)]
            if notice is not None:  # this neighbour's own header: the edge's level notice
                envelope = replace(envelope, notice=notice)
            if self._auth is not None:
                header = _signed_header(self._auth, envelope, j, content)
                chunks = [with_header(chunks[0], header), *chunks[1:]]
            elif notice is not None:
                chunks = [with_header(chunks[0], header_of(envelope)), *chunks[1:]]
            sizes[j] = sum(len(c) for c in chunks)
            if len(chunks) == 1:  # one unary call
                pushes[j] = self._push_one(j, chunks[0], deadline)
            else:
                pushes[j] = self._stream(j, chunks, deadline)
        # every push of the exchange goes to the loop at once (one wake-up, not one per push);
        # a refused push means the neighbour has moved on or gone: stop waiting for it
        pushed = _Pushes(self.inbox.mailbox, round, phase, start)
        batch = self._loop.submit(pushed.run(pushes))
        arrived, mismatched = self.inbox.collect(
            round, phase, outgoing.keys(), deadline, schedule_epoch
        )
        try:
            batch.result(timeout=max(0.0, deadline - time.monotonic()))
        except futures.TimeoutError:
            batch.cancel()
        result = ExchangeResult()
        for j in pushes:
            outcome = pushed.outcomes.get(j)
            if outcome is None:
                result.failed[j] = f"push not finished within {timeout:g} s"
            elif isinstance(outcome, grpc.RpcError):
                result.failed[j] = f"push failed: {outcome.code().name}: {outcome.details()}"
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result.bytes_sent[j] = sizes.get(j, outcome)
                result.send_seconds[j] = pushed.delivered[j]
        for j in outgoing:
            if j in result.failed:
                continue
            if j in mismatched:
                result.failed[j] = epoch_mismatch(round, mismatched[j], schedule_epoch)
                result.epoch_mismatches.append(j)
                continue
            if j not in arrived:
                result.failed[j] = f"no envelope for round {round} phase {phase!r} in {timeout:g} s"
                continue
            envelope, wire_bytes = arrived[j]
            result.received[j] = envelope
            result.bytes_received[j] = wire_bytes
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.stop(grace=0.5)
        try:
            self._loop.run(_close_channels(list(self._channels.values())))
        finally:
            self._loop.close()

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _data_bytes(payload: Payload) -> int:
    """Bytes of tensor data in a payload (its envelope's header comes on top)."""
    return sum(wire.nbytes for wire in payload)
