"""The real transport: one gRPC server per peer, envelopes client-streamed to each neighbour.

Each peer serves `Gossip.Hello` (handshake) and `Gossip.Push` (receive one envelope) plus the
standard gRPC health service, and pushes its own envelopes to its neighbours. Every call has a
deadline; message size limits are set on both ends; every envelope is validated (header before
data, values after) before it reaches the mailbox, so nothing invalid is ever handed to an
algorithm.

With `GrpcOptions.tls` set, the server and every channel use mutual TLS (gossipcomp.security):
only peers holding a certificate from the network's CA can connect. Plaintext is the default.
With `GrpcOptions.keys` as well, every envelope and handshake is signed by its sender and
checked by its receiver (gossipcomp.security.authentication) before anything else is looked at;
authentication without TLS is refused at start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.proto.v1 import gossip_pb2_grpc as pb_grpc
from gossipcomp.security.authentication import DEFAULT_CLOCK_TOLERANCE, Authenticator
from gossipcomp.security.signing_keys import PeerKeys
from gossipcomp.security.tls import TlsFiles, channel_credentials, server_credentials
from gossipcomp.transport.base import (
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
    no_rejoin,
)
from gossipcomp.transport.inbox import Inbox
from gossipcomp.transport.mailbox import Mailbox
from gossipcomp.transport.wire import (
    DEFAULT_CHUNK_BYTES,
    content_sha256,
    envelope_chunks,
    header_of,
    read_envelope,
    with_header,
)

SERVICE_NAME = "gossipcomp.v1.Gossip"
WHY_AUTHENTICATION_NEEDS_TLS = (
    "signatures prove who sent a message but hide nothing, and without TLS anyone on the path "
    "can read the models and capture messages to replay"
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

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]


_STATUS = {code.name: code for code in grpc.StatusCode}


class _GossipService(pb_grpc.GossipServicer):
    """Server side: handshake checks, rejoin requests and validated delivery into the inbox."""

    def __init__(
        self, identity: Identity, inbox: Inbox, authenticator: Authenticator | None
    ) -> None:
        self._identity = identity
        self._inbox = inbox
        self._auth = authenticator
        self.on_hello: HelloHandler = no_rejoin

    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloReply:
        mine = self._identity
        if self._auth is not None:  # before anything else: strangers learn nothing
            try:
                self._auth.check_hello(request)
            except EnvelopeRejected as refused:
                context.abort(_STATUS[refused.code.value], str(refused))
        checks = [
            ("protocol_version", mine.protocol_version, request.protocol_version),
            ("topology_hash", mine.topology_hash, request.topology_hash),
            ("model_signature", mine.model_signature, request.model_signature),
        ]
        for field, ours, theirs in checks:
            if ours != theirs:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{field} mismatch: peer {mine.rank} has {ours!r}, "
                    f"peer {request.sender} sent {theirs!r}",
                )
        if request.sender not in self._inbox.neighbours:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"sender: peer {request.sender} is not a neighbour of peer {mine.rank} "
                f"(expected one of {sorted(self._inbox.neighbours)})",
            )
        for field, value in (
            ("round", request.round),
            ("proposed_resume_round", request.proposed_resume_round),
        ):
            if value < 0:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{field}: expected >= 0, got {value}"
                )
        try:
            answer = self.on_hello(
                request.sender, request.round, request.proposed_resume_round, request.alone
            )
        except PeerNotReady as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        reply = pb.HelloReply(
            protocol_version=mine.protocol_version,
            receiver=mine.rank,
            topology_hash=mine.topology_hash,
            model_signature=mine.model_signature,
            round=answer.round,
            resume_round=answer.resume_round,
            alone=answer.alone,
        )
        if self._auth is not None:
            self._auth.prove_reply(reply, request)
        return reply

    def Push(
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.PushReply:
        return self._deliver(request_iterator, context)

    def PushOne(self, request: bytes, context: grpc.ServicerContext) -> pb.PushReply:
        return self._deliver((request,), context)

    def _check_header(self, header: pb.EnvelopeHeader) -> PayloadSpec:
        if self._auth is not None:  # who sent it first; what it holds only then
            self._auth.check_envelope(header)
        return self._inbox.check_header(header)

    def _deliver(self, chunks: Iterable[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        check_content = self._auth.check_content if self._auth is not None else None
        try:
            envelope, spec, wire_bytes = read_envelope(chunks, self._check_header, check_content)
            self._inbox.accept(envelope, spec, wire_bytes, values_checked=True)
        except EnvelopeRejected as rejected:
            context.abort(_STATUS[rejected.code.value], str(rejected))
        return pb.PushReply(received_bytes=wire_bytes)


def _abandon_on_failure(
    mailbox: Mailbox, round: int, phase: str, neighbour: int
) -> Callable[[futures.Future[int] | grpc.Future], None]:
    """A push callback: when the neighbour refused our envelope (or could not be reached), it
    has moved on or gone, so the round stops waiting for its envelope."""

    def callback(push: futures.Future[int] | grpc.Future) -> None:
        if push.cancelled() or push.exception() is not None:
            mailbox.abandon(round, phase, neighbour)

    return callback


def _signed_header(
    auth: Authenticator, envelope: Envelope, receiver: int, content: bytes
) -> pb.EnvelopeHeader:
    """The envelope's header with a proof for `receiver` (`content`: its data's SHA-256)."""
    header = header_of(envelope)
    auth.prove_envelope(header, receiver, content)
    return header


def _handlers(service: _GossipService) -> grpc.GenericRpcHandler:
    """The Gossip service with Push reading serialised chunks (parsed in wire.py, not by gRPC)."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Hello": grpc.unary_unary_rpc_method_handler(
                service.Hello,
                request_deserializer=pb.HelloRequest.FromString,
                response_serializer=pb.HelloReply.SerializeToString,
            ),
            "Push": grpc.stream_unary_rpc_method_handler(
                service.Push, response_serializer=pb.PushReply.SerializeToString
            ),
            "PushOne": grpc.unary_unary_rpc_method_handler(
                service.PushOne, response_serializer=pb.PushReply.SerializeToString
            ),
        },
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
        self._identity = identity
        self._neighbours = sorted(neighbours)
        self._options = options or GrpcOptions()
        tls, keys = self._options.tls, self._options.keys
        if keys is not None and tls is None:
            raise ValueError(
                f"peer {self.rank}: signing keys (GrpcOptions.keys) need mutual TLS "
                f"(GrpcOptions.tls): {WHY_AUTHENTICATION_NEEDS_TLS}"
            )
        credentials = server_credentials(tls) if tls else None  # files checked before starting
        self._channel_credentials = channel_credentials(tls) if tls else None
        self._auth = Authenticator(self.rank, keys, self._options.clock_tolerance) if keys else None
        self._inbox = Inbox(
            self.rank, neighbours, self._options.max_envelope_bytes, self._options.mailbox_window
        )
        self._service = _GossipService(identity, self._inbox, self._auth)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=2 * len(self._neighbours) + 4,
                thread_name_prefix=f"gossip-server-{self.rank}",
            ),
            options=self._options.channel_options(),
        )
        self._server.add_generic_rpc_handlers((_handlers(self._service),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        host = bind.rsplit(":", 1)[0]
        if credentials is None:
            port = self._server.add_insecure_port(bind)
        else:
            port = self._server.add_secure_port(bind, credentials)
        if port == 0:
            raise OSError(f"peer {self.rank}: cannot bind gRPC server to {bind}")
        self.address = f"{host}:{port}"
        self._server.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._pool = futures.ThreadPoolExecutor(
            max_workers=max(2, len(self._neighbours)), thread_name_prefix=f"gossip-push-{self.rank}"
        )
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.GossipStub] = {}
        self._pushers: dict[int, grpc.StreamUnaryMultiCallable] = {}
        self._push_ones: dict[int, grpc.UnaryUnaryMultiCallable] = {}
        self._closed = False

    def expect(self, phase: str, specs: Mapping[int, PayloadSpec] | PayloadSpec) -> None:
        self._inbox.expect(phase, specs)

    def open_round(self, round: int) -> None:
        self._inbox.mailbox.open_round(round)

    def rewind_round(self, round: int) -> None:
        self._inbox.mailbox.rewind(round)

    def allow_round(self, neighbour: int, round: int) -> None:
        self._inbox.mailbox.allow(neighbour, round)

    def set_hello_handler(self, handler: HelloHandler) -> None:
        self._service.on_hello = handler

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
        for j in self._neighbours:
            if j not in self._channels:
                channel = self._channel(addresses[j])
                self._channels[j] = channel
                self._stubs[j] = pb_grpc.GossipStub(channel)
                self._pushers[j] = channel.stream_unary(  # chunks arrive serialised already
                    f"/{SERVICE_NAME}/Push", response_deserializer=pb.PushReply.FromString
                )
                self._push_ones[j] = channel.unary_unary(
                    f"/{SERVICE_NAME}/PushOne", response_deserializer=pb.PushReply.FromString
                )
        self._inbox.mailbox.open_round(round)
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
                    reply = self._stubs[j].Hello(request, timeout=attempt)
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

    def _channel(self, address: str) -> grpc.Channel:
        options = self._options.channel_options()
        if self._channel_credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._channel_credentials, options=options)

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
        return HelloAnswer(reply.round, reply.resume_round, reply.alone)

    def probe(
        self, neighbour: int, round: int, proposed: int, alone: bool
    ) -> futures.Future[HelloAnswer]:
        """Ask a lost neighbour, without blocking, to resume the edge (a Hello with our round and
        a proposed resume round); the future fails if it does not answer within hello_timeout."""
        if neighbour not in self._stubs:
            raise RuntimeError(f"peer {self.rank}: probe before connect()")
        request = self._hello_request(neighbour, round, proposed, alone)
        call = self._stubs[neighbour].Hello.future(request, timeout=self._options.hello_timeout)
        answer: futures.Future[HelloAnswer] = futures.Future()

        def done(finished: grpc.Future) -> None:
            try:
                answer.set_result(self._answer(neighbour, request, finished.result()))
            except BaseException as error:  # refused, unanswered, cancelled: the probe failed
                answer.set_exception(error)

        call.add_done_callback(done)
        return answer

    def send(self, neighbour: int, envelope: Envelope, deadline: float) -> int:
        """Stream one envelope to a neighbour before `deadline` (time.monotonic); return its bytes.

        Raises grpc.RpcError with the receiver's status when it refuses the envelope.
        """
        header = None
        if self._auth is not None:
            header = _signed_header(self._auth, envelope, neighbour, content_sha256(envelope))
        chunks = envelope_chunks(envelope, self._options.chunk_bytes, header)
        return self._send_chunks(neighbour, chunks, deadline)

    def _send_chunks(self, neighbour: int, chunks: Iterable[bytes], deadline: float) -> int:
        sent = 0

        def counted() -> Iterator[bytes]:
            nonlocal sent
            for chunk in chunks:
                sent += len(chunk)
                yield chunk

        timeout = max(0.001, deadline - time.monotonic())
        self._pushers[neighbour](counted(), timeout=timeout)
        return sent

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
        deadline = time.monotonic() + timeout
        self._inbox.mailbox.open_round(round)
        # One payload sent to several neighbours is chunked (and hashed) once; when peers
        # authenticate, only its first chunk is rebuilt per receiver, with a signed header.
        chunked: dict[int, tuple[Envelope, list[bytes], bytes]] = {}
        for payload in outgoing.values():
            if id(payload) not in chunked:
                envelope = Envelope(self.rank, round, phase, payload, schedule_epoch)
                chunks = list(envelope_chunks(envelope, self._options.chunk_bytes))
                content = content_sha256(envelope) if self._auth is not None else b""
                chunked[id(payload)] = (envelope, chunks, content)
        pushes: dict[int, futures.Future[int] | grpc.Future] = {}
        sizes: dict[int, int] = {}
        mailbox = self._inbox.mailbox
        for j, payload in outgoing.items():
            envelope, chunks, content = chunked[id(payload)]
            if self._auth is not None:
                header = _signed_header(self._auth, envelope, j, content)
                chunks = [with_header(chunks[0], header), *chunks[1:]]
            sizes[j] = sum(len(c) for c in chunks)
            if len(chunks) == 1:  # one unary call, issued asynchronously: no thread per push
                remaining = max(0.001, deadline - time.monotonic())
                pushes[j] = self._push_ones[j].future(chunks[0], timeout=remaining)
            else:
                pushes[j] = self._pool.submit(self._send_chunks, j, chunks, deadline)
            # a refused push means the neighbour has moved on or gone: stop waiting for it
            pushes[j].add_done_callback(_abandon_on_failure(mailbox, round, phase, j))
        arrived = self._inbox.mailbox.collect(round, phase, outgoing.keys(), deadline)
        result = ExchangeResult()
        for j, push in pushes.items():
            try:
                push.result(timeout=max(0.0, deadline - time.monotonic()))
                result.bytes_sent[j] = sizes[j]
            except grpc.RpcError as error:
                result.failed[j] = f"push failed: {error.code().name}: {error.details()}"
            except (futures.TimeoutError, grpc.FutureTimeoutError):
                push.cancel()
                result.failed[j] = f"push not finished within {timeout:g} s"
        for j in outgoing:
            if j in result.failed:
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
        self._health.enter_graceful_shutdown()
        self._server.stop(grace=0.5).wait()
        for channel in self._channels.values():
            channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
