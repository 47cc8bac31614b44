"""The real transport: one gRPC server per peer, envelopes client-streamed to each neighbour.

Each peer serves `Gossip.Hello` (handshake), `Gossip.Push` (receive one envelope) and
`Gossip.Link` (an edge's small envelopes on one open stream) plus the standard gRPC health
service (grpc_service.py, the server side), and pushes its own envelopes to its neighbours
(this module, the client side: channels, handshakes, exchanges): an envelope of one chunk on
the edge's link (edge_stream.py), a larger one as a stream of its own, and, between plaintext
peers, one of `bulk_lane_bytes` or more by a Bulk call whose data goes on the receiver's bulk
lane (bulk_lane.py; a neighbour whose lane cannot be reached gets its envelopes by stream, and
a warning says so). Every call has a deadline; message size limits are set on both ends;
every envelope is validated (header before data, values after) before it reaches the Inbox, so
nothing invalid is ever handed to an algorithm. Options and their checks: grpc_options.py.

With `GrpcOptions.tls` set, the server and every channel use mutual TLS (gossipcomp.security):
only peers holding a certificate from the network's CA can connect. Plaintext is the default.
With `GrpcOptions.keys` as well, every envelope and handshake is signed by its sender and
checked by its receiver (gossipcomp.transport.authentication) before anything else is looked at;
authentication without TLS is refused at start.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import replace
from functools import partial
from typing import Any

import grpc

from gossipcomp.inputs.text import quoted
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.proto.v1 import gossip_pb2_grpc as pb_grpc
from gossipcomp.security.tls import channel_credentials, server_credentials
from gossipcomp.transport.allocator import keep_heap_warm
from gossipcomp.transport.authentication import Authenticator
from gossipcomp.transport.backpressure import pauses_until
from gossipcomp.transport.base import (
    MAX_SCHEDULE_EPOCH,
    Envelope,
    EnvelopeRejected,
    ExchangeResult,
    Greeting,
    HandshakeError,
    HelloAnswer,
    HelloHandler,
    Identity,
    Outgoing,
    Payload,
    PeerUnreachableError,
    RejectCode,
)
from gossipcomp.transport.bulk_lane import LaneServer, checked_ticket, open_lane, send_on_lane
from gossipcomp.transport.edge_stream import EdgeStream
from gossipcomp.transport.grpc_options import (  # re-exported: the names' old home
    WHY_AUTHENTICATION_NEEDS_TLS,
    WHY_PLAINTEXT_STAYS_ON_LOOPBACK,
    GrpcOptions,
    is_loopback,
)
from gossipcomp.transport.grpc_service import SERVICE_NAME, GossipService, handlers, serving_limits
from gossipcomp.transport.inbox import Inbox
from gossipcomp.transport.mailbox import Mailbox
from gossipcomp.transport.schedules import MAX_SHARED_SCHEDULES, ScheduleSource
from gossipcomp.transport.serving import PROCESS_LOOP, AsyncServer
from gossipcomp.transport.wire import (
    content_sha256,
    envelope_chunks,
    header_chunk,
    header_of,
    with_header,
)

log = logging.getLogger("gossipcomp.transport")
LANE_RETRY_SECONDS = 60.0  # a neighbour's lane that could not be opened is tried again after

__all__ = [
    "SERVICE_NAME",
    "WHY_AUTHENTICATION_NEEDS_TLS",
    "WHY_PLAINTEXT_STAYS_ON_LOOPBACK",
    "GrpcOptions",
    "GrpcTransport",
    "is_loopback",
]


class _Pushes:
    """One exchange's pushes, run together on the loop: each one's outcome (bytes sent, or
    the error), when each was delivered, and the mailbox told at once of a refused push. A
    push refused as not yet due is sent again until `deadline` (transport/backpressure.py)."""

    def __init__(
        self, mailbox: Mailbox, round: int, phase: str, start: float, deadline: float
    ) -> None:
        self._mailbox, self._round, self._phase, self._start = mailbox, round, phase, start
        self._deadline = deadline
        self.outcomes: dict[int, int | BaseException] = {}
        self.delivered: dict[int, float] = {}  # neighbour -> seconds until it acknowledged

    async def run(self, pushes: Mapping[int, Callable[[], Coroutine[Any, Any, int]]]) -> None:
        """Start and await every push. Each is a coroutine function, called only here: a batch
        cancelled before the loop got to it (its deadline passed on a busy loop, the transport
        closed) leaves no coroutine that was created and never awaited."""
        await asyncio.gather(*(self._one(j, push) for j, push in pushes.items()))

    async def _one(self, neighbour: int, push: Callable[[], Coroutine[Any, Any, int]]) -> None:
        try:
            self.outcomes[neighbour] = await self._pushed_when_due(push)
            self.delivered[neighbour] = time.monotonic() - self._start
        except asyncio.CancelledError:
            self._mailbox.abandon(self._round, self._phase, neighbour)
            raise
        except Exception as error:  # the exchange reports it (or raises what is not gRPC's)
            self.outcomes[neighbour] = error
            self._mailbox.abandon(self._round, self._phase, neighbour)

    async def _pushed_when_due(self, push: Callable[[], Coroutine[Any, Any, int]]) -> int:
        pauses = pauses_until(self._deadline)
        while True:
            try:
                return await push()
            except grpc.RpcError as error:  # a call's status, or a refusal on a link
                pause = next(pauses, None) if error.code() is grpc.StatusCode.ABORTED else None
                if pause is None:
                    raise
            await asyncio.sleep(pause)


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


class GrpcTransport:
    """A peer's gRPC endpoint: serves its neighbours and pushes envelopes to them."""

    def __init__(
        self,
        identity: Identity,
        neighbours: Collection[int],
        bind: str = "127.0.0.1:0",
        options: GrpcOptions | None = None,
        address_source: Callable[[int], str | None] | None = None,
    ) -> None:
        """`address_source`: where a neighbour's current address is read before it is probed,
        and before anything is pushed to it until the source has named one (None: unknown yet),
        for networks whose peers announce their addresses as they come
        (rendezvous.StoreAddresses); without it the addresses given to connect() stay."""
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
        self._lane = (
            LaneServer(
                f"peer {self.rank}",
                self._options.max_lane_connections,
                self._options.first_chunk_timeout,
            )
            if self._options.uses_bulk_lane
            else None
        )
        self._service = GossipService(
            identity,
            self.inbox,
            self._auth,
            self._options,
            callers_verified=tls is not None,
            lane=self._lane,
        )
        limits = serving_limits(self._options)
        self._server = AsyncServer(
            f"peer {self.rank}",
            bind,
            (handlers(self._service, limits),),
            limits,
            credentials,
            health_services=("", SERVICE_NAME),
        )
        self.address = self._server.address
        if self._lane is not None:
            try:
                self._server.run(self._lane.start(_host(bind)))
            except BaseException:
                self._server.stop(grace=0)
                raise
        # the client side runs on the same process-wide loop as the server: a push is a
        # coroutine there, not a thread (docs/benchmarks.md, "Engine, one process")
        self._loop = PROCESS_LOOP.lease()
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._channel_addresses: dict[int, str] = {}
        self._address_source = address_source
        # neighbours whose address the source has not named yet (looked up before a push)
        self._unnamed = set(self._neighbours) if address_source is not None else set()
        self._stubs: dict[int, pb_grpc.GossipStub] = {}
        self._pushers: dict[int, grpc.aio.StreamUnaryMultiCallable] = {}
        self._bulkers: dict[int, grpc.aio.StreamStreamMultiCallable] = {}
        # neighbour -> until when (time.monotonic) its lane is not tried: it could not be used
        self._lane_off_until: dict[int, float] = {}
        self._links: dict[int, EdgeStream] = {}
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
        self, addresses: Mapping[int, str], timeout: float, greeting: Greeting | None = None
    ) -> dict[int, HelloAnswer]:
        """Open channels to every neighbour and handshake, retrying until `timeout` seconds.

        Neighbours may start in any order: unreachable ones are retried with backoff. A
        mismatching neighbour raises HandshakeError at once; still unreachable ones at the end
        raise PeerUnreachableError naming them and their addresses. The mailbox opens at the
        `greeting`'s round before anyone is greeted; its proposals ask given neighbours to
        resume their edge at (at least) a round. Returns each neighbour's answer (its round,
        and a resume round if the edge must be resynchronised).
        """
        missing = [j for j in self._neighbours if j not in addresses]
        if missing:
            raise ValueError(f"peer {self.rank}: no address for neighbours {missing}")
        self._loop.run(self._open_channels(addresses))
        greeting = greeting or Greeting()
        self.inbox.open_round(greeting.round)
        answers: dict[int, HelloAnswer] = {}
        deadline = time.monotonic() + timeout
        among = greeting.among
        pending = {j for j in self._neighbours if among is None or j in among}
        last_error: dict[int, str] = {}
        backoff = 0.05
        while pending:
            for j in sorted(pending):
                attempt = min(self._options.hello_timeout, max(0.05, deadline - time.monotonic()))
                try:
                    request = self._hello_request(
                        j, greeting.round, greeting.proposals.get(j, 0), greeting.alone
                    )
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
            if j in self._channels or j not in addresses:
                continue
            channel = self._channel(addresses[j])
            self._channels[j] = channel
            self._channel_addresses[j] = addresses[j]
            self._stubs[j] = pb_grpc.GossipStub(channel)
            self._pushers[j] = channel.stream_unary(  # chunks arrive serialised already
                f"/{SERVICE_NAME}/Push", response_deserializer=pb.PushReply.FromString
            )
            self._bulkers[j] = channel.stream_stream(
                f"/{SERVICE_NAME}/Bulk", response_deserializer=pb.BulkReply.FromString
            )
            self._links[j] = EdgeStream(
                j,
                channel.stream_stream(  # chunks arrive serialised already
                    f"/{SERVICE_NAME}/Link", response_deserializer=pb.LinkReply.FromString
                ),
            )

    def _channel(self, address: str) -> grpc.aio.Channel:
        options = self._options.channel_options(self.rank)
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
        self._follow_address(neighbour)
        request = self._hello_request(neighbour, round, proposed, alone)
        stub, timeout = self._stubs[neighbour], self._options.hello_timeout

        async def ask() -> HelloAnswer:
            return self._answer(neighbour, request, await stub.Hello(request, timeout=timeout))

        return self._loop.submit(ask())  # refused, unanswered, cancelled: the future fails

    def _follow_address(self, neighbour: int) -> None:
        """With an address source: the channel to `neighbour` moves to the address the source
        gives now when it differs (a peer that joined, or came back at another port); the old
        channel is closed."""
        if self._address_source is None:
            return
        address = self._address_source(neighbour)
        if address is not None:
            self._unnamed.discard(neighbour)
        if address is None or address == self._channel_addresses.get(neighbour):
            return
        old = self._channels.pop(neighbour)
        self._lane_off_until.pop(neighbour, None)  # a new address: its lane may work
        self._loop.run(self._open_channels({neighbour: address}))
        self._loop.run(_close_channels([old]))

    def send(self, neighbour: int, envelope: Envelope, deadline: float) -> int:
        """Send one envelope to a neighbour before `deadline` (time.monotonic), as a stream or
        on its bulk lane; return its bytes.

        Raises grpc.RpcError with the receiver's status when it refuses the envelope or the
        call's deadline passes, TimeoutError when a bulk push runs past `deadline`, and
        EnvelopeRejected when the receiver's Bulk answers make no sense.
        """
        return self._loop.run(self._push_envelope(neighbour, envelope, deadline))

    def sends_on_lane(self, neighbour: int, data_bytes: int) -> bool:
        """Whether an envelope of `data_bytes` goes to `neighbour` on its bulk lane."""
        return (
            self._options.uses_bulk_lane
            and data_bytes >= self._options.bulk_lane_bytes
            and time.monotonic() >= self._lane_off_until.get(neighbour, 0.0)
        )

    async def _push_envelope(self, neighbour: int, envelope: Envelope, deadline: float) -> int:
        """`envelope` to `neighbour` on its bulk lane, or as a stream of chunks."""
        if self.sends_on_lane(neighbour, _data_bytes(envelope.tensors)):
            return await self._bulk_push(neighbour, envelope, deadline)
        return await self._stream_envelope(neighbour, envelope, deadline)

    async def _bulk_push(self, neighbour: int, envelope: Envelope, deadline: float) -> int:
        """The header by a Bulk call, the data on the ticket's lane connection, all before
        `deadline` (TimeoutError after it); the bytes moved. A lane that cannot be opened
        within the handshake timeout (nothing listens, the ticket is not accepted) is not
        tried again for LANE_RETRY_SECONDS, one whose peer serves none until its address
        changes; a warning says so, and the envelope goes as a stream instead."""
        first = header_chunk(envelope)
        data = [memoryview(tensor.data).cast("B") for tensor in envelope.tensors]
        call = self._bulkers[neighbour](
            iter((first,)), timeout=max(0.001, deadline - time.monotonic())
        )
        finished = False
        try:
            async with asyncio.timeout_at(deadline):  # the loop's clock is time.monotonic
                try:
                    ticket = checked_ticket(await call.read(), neighbour)
                except grpc.RpcError as error:
                    if error.code() is not grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    self._give_up_lane(neighbour, "it serves none", math.inf)
                    return await self._stream_envelope(neighbour, envelope, deadline)
                lane = await self._open_lane(neighbour, ticket, deadline)
                if lane is None:
                    return await self._stream_envelope(neighbour, envelope, deadline)
                with lane:
                    try:
                        await send_on_lane(lane, data)
                    except OSError:
                        pass  # the receiver closed the lane first: its answer says why
                answer = await call.read()  # the receiver's refusal raises here
                finished = True
        finally:
            if not finished:
                call.cancel()  # a call left open would hold the receiver's slot
        if not isinstance(answer, pb.BulkReply) or answer.WhichOneof("answer") != "done":
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"bulk reply from peer {neighbour}: expected done after the data",
            )
        return len(first) + sum(len(view) for view in data)

    async def _open_lane(
        self, neighbour: int, ticket: pb.BulkTicket, deadline: float
    ) -> socket.socket | None:
        """The lane connection `ticket` names, its ticket accepted; None when it cannot be
        opened within the handshake timeout (the lane is given up for a while). When the
        exchange's own deadline comes first, TimeoutError: the push is late, not the lane."""
        host = _host(self._channel_addresses[neighbour])
        left = deadline - time.monotonic()
        within = min(self._options.hello_timeout, left)
        try:
            return await open_lane(host, ticket.port, ticket.ticket, max(0.001, within))
        except OSError as error:
            if isinstance(error, TimeoutError) and within >= left:
                raise
            why = "no answer" if isinstance(error, TimeoutError) else str(error)
            self._give_up_lane(
                neighbour, f"{host}:{ticket.port} cannot be opened ({why})", LANE_RETRY_SECONDS
            )
            return None

    def _give_up_lane(self, neighbour: int, why: str, seconds: float) -> None:
        self._lane_off_until[neighbour] = time.monotonic() + seconds
        until = f"for {seconds:g} s" if math.isfinite(seconds) else "until its address changes"
        log.warning(
            "peer %d: the bulk lane to peer %d is not used %s: %s; its large envelopes go by "
            "gRPC stream",
            self.rank,
            neighbour,
            until,
            why,
        )

    def _lazy_chunks(self, neighbour: int, envelope: Envelope) -> Iterator[bytes]:
        """The envelope's chunks for `neighbour`, each built as gRPC asks for it."""
        header = None
        if self._auth is not None:
            header = _signed_header(self._auth, envelope, neighbour, content_sha256(envelope))
        return envelope_chunks(envelope, self._options.chunk_bytes, header)

    async def _stream_envelope(self, neighbour: int, envelope: Envelope, deadline: float) -> int:
        """`envelope` streamed to `neighbour` as its chunks are built (again on each attempt)."""
        return await self._stream(neighbour, self._lazy_chunks(neighbour, envelope), deadline)

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
        return await self._links[neighbour].send(chunk, max(0.001, deadline - time.monotonic()))

    def exchange(
        self, round: int, phase: str, outgoing: Outgoing, timeout: float, schedule_epoch: int = 0
    ) -> ExchangeResult:
        if not self._stubs:
            raise RuntimeError(f"peer {self.rank}: exchange before connect()")
        start = time.monotonic()
        deadline = start + timeout
        self.inbox.open_round(round)
        for j in self._unnamed.intersection(outgoing):  # an edge that came up by its probe
            self._follow_address(j)
        # One payload sent to several neighbours is chunked (and hashed) once; when peers
        # authenticate, only its first chunk is rebuilt per receiver, with a signed header. A
        # payload of several chunks for one neighbour only is streamed as its chunks are built
        # (`send`): building all 64 MiB first cost as much as sending them.
        receivers = Counter(id(payload) for payload in outgoing.values())
        chunked: dict[int, tuple[Envelope, list[bytes], bytes]] = {}
        pushes: dict[int, Callable[[], Coroutine[Any, Any, int]]] = {}
        sizes: dict[int, int] = {}
        for j, payload in outgoing.items():
            notice = self.inbox.notice_for(j)
            data_bytes = _data_bytes(payload)
            if self.sends_on_lane(j, data_bytes):  # each attempt decides again (lane may be off)
                envelope = Envelope(self.rank, round, phase, payload, schedule_epoch, notice=notice)
                pushes[j] = partial(self._push_envelope, j, envelope, deadline)
                continue
            if receivers[id(payload)] == 1 and data_bytes > self._options.chunk_bytes:
                envelope = Envelope(self.rank, round, phase, payload, schedule_epoch, notice=notice)
                pushes[j] = partial(self._stream_envelope, j, envelope, deadline)
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
            if len(chunks) == 1:  # one message on the edge's link
                pushes[j] = partial(self._push_one, j, chunks[0], deadline)
            else:
                pushes[j] = partial(self._stream, j, chunks, deadline)
        # every push of the exchange goes to the loop at once (one wake-up, not one per push);
        # a push refused for good means the neighbour has moved on or gone: stop waiting for
        # it; one refused as not yet due is sent again (backpressure.py)
        pushed = _Pushes(self.inbox.mailbox, round, phase, start, deadline)
        batch = self._loop.submit(pushed.run(pushes))
        arrivals = self.inbox.collect(round, phase, outgoing.keys(), deadline, schedule_epoch)
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
            elif isinstance(outcome, EnvelopeRejected):  # the receiver's answer made no sense
                result.failed[j] = f"push failed: {outcome}"
            elif isinstance(outcome, TimeoutError):  # a bulk push that ran out of time
                result.failed[j] = f"push not finished within {timeout:g} s"
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result.bytes_sent[j] = sizes.get(j, outcome)
                result.send_seconds[j] = pushed.delivered[j]
        arrivals.report(result, outgoing, timeout)
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.inbox.mailbox.shut()  # a thread waiting in exchange() goes on at once
        try:
            self._server.run(self._service.end_links())  # open links would hold the grace period
        finally:
            self._server.stop(grace=0.5)  # bulk data in flight may land within the grace
            try:
                if self._lane is not None:
                    self._loop.run(self._lane.close())
                self._loop.run(_close_channels(list(self._channels.values())))
            finally:
                self._loop.close()

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host(address: str) -> str:
    """The host of a `host:port` address (an IPv6 one without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")


def _data_bytes(payload: Payload) -> int:
    """Bytes of tensor data in a payload (its envelope's header comes on top)."""
    return sum(wire.nbytes for wire in payload)
