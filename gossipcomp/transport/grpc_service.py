"""The gRPC transport's server side: the Gossip service every peer serves to its neighbours.

Hello (handshake and rejoin requests), Push and PushOne (one envelope, streamed or in one
message), Link (an edge's small envelopes, one message each, on a stream that stays open), Bulk
(a large envelope whose data comes on the bulk lane, bulk_lane.py) and Schedules, each checked
before anything is used: a signed caller's proof first (when peers authenticate), then the
handshake's identity and ranges, or the envelope's header before its data and its values
before the Inbox stores it. Apart from grpc_transport.py (the
client side: channels, handshakes and pushes) because the two share only the Inbox and the
options, and a reader auditing what a stranger can make a peer do reads this file alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import grpc

from gossipcomp.inputs.text import quoted
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.authentication import Authenticator
from gossipcomp.transport.base import (
    MAX_SCHEDULE_EPOCH,
    MAX_WIRE_ROUND,
    EnvelopeRejected,
    HelloAnswer,
    HelloHandler,
    Identity,
    PayloadSpec,
    PeerNotReady,
    RejectCode,
    no_rejoin,
)
from gossipcomp.transport.buffers import BufferPool
from gossipcomp.transport.bulk_lane import LaneServer
from gossipcomp.transport.edge_stream import refusal_reply
from gossipcomp.transport.grpc_options import GrpcOptions
from gossipcomp.transport.inbox import Inbox
from gossipcomp.transport.schedules import SCHEDULE_CALLS_PER_CALLER, ScheduleSource
from gossipcomp.transport.serving import CallerSlots, Method, ServingLimits, bounded_handler
from gossipcomp.transport.wire import ContentCheck, EnvelopeReader

SERVICE_NAME = "gossipcomp.v1.Gossip"
# seconds a Link call may last: it is ended after the answer that passes this (the sender opens
# another), so no call, however busy, holds its connection's slot for good
MAX_LINK_SECONDS = 600.0
_STATUS = {code.name: code for code in grpc.StatusCode}
NO_BULK_LANE = "bulk lane: this peer serves none (it uses TLS, or its lane is off)"


class GossipService:
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
        lane: LaneServer | None = None,
    ) -> None:
        """`lane`: where Bulk calls' data arrives (None: Bulk is refused as UNIMPLEMENTED)."""
        self._identity = identity
        self._inbox = inbox
        self._auth = authenticator
        self._options = options
        self._lane = lane
        self._callers_verified = callers_verified
        # envelopes in flight per caller (a sender whose header was checked, on one connection)
        self._envelopes = CallerSlots(options.max_streams_per_caller, "envelopes")
        self._buffers = BufferPool(options.receive_pool_bytes)
        self.on_hello: HelloHandler = no_rejoin
        self.on_schedules: ScheduleSource = lambda sender, epoch: b""  # none until a peer says
        # Schedules answers in flight per caller (claimed sender on one connection)
        self._schedule_calls = CallerSlots(SCHEDULE_CALLS_PER_CALLER, "Schedules calls")
        self._links: set[asyncio.Timeout] = set()  # the timers of the Link calls being served
        self._ending = False  # the peer is closing: no new links

    def _refusal(self, refused: EnvelopeRejected) -> tuple[grpc.StatusCode, str]:
        """The status and details a caller is told for `refused`."""
        code, details = refused.code.value, str(refused)
        if not self._callers_verified:  # strangers learn nothing of our state
            details = refused.public
            if code == "ALREADY_EXISTS":  # would say which rounds arrived, hence ours
                code = "FAILED_PRECONDITION"
        return _STATUS[code], details

    async def _refuse(self, context: grpc.aio.ServicerContext, refused: EnvelopeRejected) -> None:
        await context.abort(*self._refusal(refused))

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
        reader = await self._open(first, context)
        rest = partial(self._read_rest, request_iterator, reader, context, deadline)
        return pb.PushReply(received_bytes=await self._deliver(reader, context, rest))

    async def Bulk(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """An envelope whose header comes here and whose data comes on the bulk lane: the
        header is checked as Push checks it and holds the same per-caller slot; then a ticket
        is answered, and `done` once the data has arrived on the ticket's connection with
        its values checked, all within Push's deadlines. Refused as Push is."""
        if self._lane is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_BULK_LANE)
        assert self._lane is not None
        if self._lane.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "bulk lane: this peer is closing")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._options.stream_timeout
        header_deadline = min(deadline, loop.time() + self._options.first_chunk_timeout)
        first = await self._next_chunk(requests, context, header_deadline)
        if await self._next_chunk(requests, context, header_deadline) is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Bulk: expected the envelope's first chunk alone, then the end of the requests",
            )
        reader = await self._open(first, context)
        if not reader.missing:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Bulk: expected data to come on the lane; an envelope whose first chunk holds "
                "all its data goes by Push",
            )
        wire_bytes = await self._deliver(
            reader, context, partial(self._await_lane, reader, context, deadline)
        )
        await context.write(pb.BulkReply(done=pb.PushReply(received_bytes=wire_bytes)))

    async def _open(self, first: bytes | None, context: grpc.aio.ServicerContext) -> EnvelopeReader:
        """A reader for the envelope whose first chunk is `first`, its header checked; the
        call is refused when it is not valid (Push and Bulk)."""
        try:
            return EnvelopeReader(
                first, self._check_header, self._check_content(), self._buffers.take
            )
        except EnvelopeRejected as refused:
            await self._refuse(context, refused)
            raise  # abort raises; this keeps type checkers aware

    async def _deliver(
        self,
        reader: EnvelopeReader,
        context: grpc.aio.ServicerContext,
        data: Callable[[], Awaitable[None]],
    ) -> int:
        """Holding one of the sender's envelope slots, await `data` (the rest of the
        envelope's bytes into `reader`), then check and store the envelope; its wire bytes.
        The call is refused when it is not valid (Push and Bulk)."""
        async with self._envelopes.hold((reader.sender, context.peer()), context):
            try:
                await data()
                envelope, spec, wire_bytes = reader.finish()
                self._inbox.accept(envelope, spec, wire_bytes, values_checked=True)
                return wire_bytes
            except EnvelopeRejected as refused:
                await self._refuse(context, refused)
                raise  # abort raises; this keeps type checkers aware

    async def _await_lane(
        self, reader: EnvelopeReader, context: grpc.aio.ServicerContext, deadline: float
    ) -> None:
        """Issue a ticket for `reader`'s missing data and wait until it has come on the lane:
        the ticket must be shown within the lane's ticket timeout, the data be in by
        `deadline` (the loop's clock), else DEADLINE_EXCEEDED."""
        assert self._lane is not None
        loop = asyncio.get_running_loop()
        with self._lane.expecting(reader) as ticket:
            answer = pb.BulkReply(ticket=pb.BulkTicket(ticket=ticket.ticket, port=self._lane.port))
            try:
                async with asyncio.timeout_at(
                    min(deadline, loop.time() + self._lane.ticket_timeout)
                ):
                    await context.write(answer)
                    await ticket.claimed
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "bulk lane: the ticket was not shown in time (within "
                    f"{self._lane.ticket_timeout:g} s, and the call's deadline)",
                )
            try:
                async with asyncio.timeout_at(deadline):
                    await ticket.arrived
            except TimeoutError:
                await self._abort_late(context)

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
            wire_bytes = self._accept_one(request)
        except EnvelopeRejected as refused:
            await self._refuse(context, refused)
        return pb.PushReply(received_bytes=wire_bytes)

    def _accept_one(self, message: bytes) -> int:
        """An envelope in one message, checked and stored (PushOne and Link); its bytes."""
        reader = EnvelopeReader(message, self._check_header, self._check_content())
        envelope, spec, wire_bytes = reader.finish()
        self._inbox.accept(envelope, spec, wire_bytes, values_checked=True)
        return wire_bytes

    async def Link(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """An edge's small envelopes, each checked as PushOne's and answered in order, the
        link kept open after a refusal. Its first envelope must come within
        `first_chunk_timeout`; a link that then carries nothing, or whose caller reads no
        answer, for `stream_timeout` seconds is ended (status OK), as is one older than
        MAX_LINK_SECONDS at its next answer, and every link when the peer closes
        (`end_links`). The sender opens a new link when it next sends."""
        if self._ending:
            return
        loop = asyncio.get_running_loop()
        idle = self._options.stream_timeout
        retire = loop.time() + MAX_LINK_SECONDS
        timer = asyncio.timeout(min(self._options.first_chunk_timeout, idle))
        self._links.add(timer)  # one timer for the link, pushed on at every step
        try:
            async with timer:
                while True:
                    message = await anext(requests, None)
                    if message is None or self._ending:
                        return
                    try:
                        reply = pb.LinkReply(received_bytes=self._accept_one(message))
                    except EnvelopeRejected as refused:
                        reply = refusal_reply(*self._refusal(refused))
                    timer.reschedule(loop.time() + idle)
                    await context.write(reply)
                    if self._ending or loop.time() > retire:
                        return
                    timer.reschedule(loop.time() + idle)
        except TimeoutError:
            return  # idle, or the peer closes: the link ends with OK
        finally:
            self._links.discard(timer)

    async def end_links(self) -> None:
        """End every link being served, and refuse new ones (the peer closes: its server
        need not sit out its grace period for links that would stay open)."""
        self._ending = True
        now = asyncio.get_running_loop().time()
        for timer in self._links:  # each link waits in a read or a write: it ends there
            if not timer.expired():  # one whose timer fired already is ending
                timer.reschedule(now)

    def _check_content(self) -> ContentCheck | None:
        return self._auth.check_content if self._auth is not None else None

    def _check_header(self, header: pb.EnvelopeHeader) -> PayloadSpec:
        if self._auth is not None:  # who sent it first; what it holds only then
            self._auth.check_envelope(header)
        return self._inbox.check_header(header)


def handlers(service: GossipService, limits: ServingLimits) -> grpc.GenericRpcHandler:
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
                "Link",
                service.Link,
                pb.LinkReply.SerializeToString,
                streaming_request=True,
                streaming_response=True,
            ),
            Method(
                "Bulk",
                service.Bulk,
                pb.BulkReply.SerializeToString,
                streaming_request=True,
                streaming_response=True,
            ),
            Method(
                "Schedules",
                service.Schedules,
                bytes,  # served already serialised (ScheduleSource)
                request=pb.HelloRequest.FromString,
            ),
        ),
        limits,
    )


def serving_limits(options: GrpcOptions) -> ServingLimits:
    """The server's limits from the transport's options (Push bounds its own stream)."""
    return ServingLimits(
        max_message_bytes=options.max_message_bytes,
        max_streams_per_connection=options.max_streams_per_connection,
        header_timeout=options.first_chunk_timeout,
        call_timeout=options.stream_timeout,
        # every method together, per connection (up to 16 peers of one process share one)
        max_calls_per_caller=options.max_streams_per_connection,
        read_chunk_bytes=options.read_chunk_bytes,
    )
