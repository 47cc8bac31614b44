"""The bulk lane: a large envelope's data on a TCP connection of the transport's own, not gRPC's.

Why: grpcio copies every message in user space on both ends (into a slice when sending; on
receipt a bytes object per HTTP/2 frame, then a join), and a 64 MiB envelope through it cost
twice the CPU of the same bytes on a socket (docs/benchmarks.md, "CPU per envelope on each
end"). On the lane the sender's tensors go to the kernel as they are and the receiver reads
them straight into the envelope's buffer: the only copies are the kernel's.

How (grpc_service.py serves the gRPC half): the sender calls Bulk with the envelope's header;
the receiver checks it exactly as Push does, takes the buffer, and answers a ticket (random
bytes) and its lane's port. The sender connects to that port on the host of the receiver's
gRPC address, writes the ticket, then exactly the data the header declared; the receiver
checks values as they land and answers `done` on the Bulk call, or refuses it as Push would.
What a stranger who reaches the port can do is bounded here:

- at most `max_connections` lane connections are open at once; more are closed at once;
- a connection must present a ticket within `ticket_timeout` seconds, or it is closed;
- a ticket is TICKET_BYTES from `secrets`, told only to the Bulk caller whose header was
  checked, good for one connection and only while that call lasts; an unknown, used or expired
  ticket closes the connection, and nothing is said back;
- the data lands only in the buffer of a header already checked, whose size, caller slot and
  deadline the Bulk call bounds; bytes beyond the declared count are never read (the
  connection is closed once the data is complete), and one that ends early refuses the envelope.

Plaintext only: the lane has no TLS of its own, so a transport with TLS keeps every envelope on
gRPC (grpc_transport.py), and authentication (which needs TLS) never meets the lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import EnvelopeRejected, RejectCode
from gossipcomp.transport.wire import EnvelopeReader

TICKET_BYTES = 16
MAX_PORT = 65535
MAX_BIND_ATTEMPTS = 8  # ports tried for a host of several addresses (LaneServer.start)


@dataclass
class _Expected:
    """An envelope whose data the lane awaits: its reader, the future its Bulk call awaits, and
    the connection that claimed its ticket (None until one does)."""

    reader: EnvelopeReader
    arrived: asyncio.Future[None]
    connection: asyncio.Transport | None = field(default=None)


class LaneServer:
    """The receiving end: one listener on the transport's event loop, the tickets it issued."""

    def __init__(self, max_connections: int, ticket_timeout: float) -> None:
        if max_connections < 1:
            raise ValueError(f"LaneServer: expected max_connections >= 1, got {max_connections}")
        if not 0 < ticket_timeout < float("inf"):
            raise ValueError(f"LaneServer: expected ticket_timeout > 0 s, got {ticket_timeout}")
        self._max_connections = max_connections
        self._ticket_timeout = ticket_timeout
        self._tickets: dict[bytes, _Expected] = {}
        self._connections: set[_LaneConnection] = set()
        self._servers: list[asyncio.Server] = []
        self.port = 0

    async def start(self, host: str) -> int:
        """Listen on one unused port at every address of `host` (on the running loop: a name
        such as localhost may stand for an IPv6 and an IPv4 address, and a sender may reach
        either); return the port. Raises OSError when no port is free at all of them."""
        loop = asyncio.get_running_loop()
        addresses = await loop.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for _ in range(MAX_BIND_ATTEMPTS):
            try:
                self._servers = await self._bind_all(addresses)
                return self.port
            except OSError:  # the port taken at another address: try another one
                await self.close()
        raise OSError(f"bulk lane: no port free at every address of {host!r}")

    async def _bind_all(self, addresses: list[tuple]) -> list[asyncio.Server]:
        loop = asyncio.get_running_loop()
        servers: list[asyncio.Server] = []
        self._servers = servers
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], self.port, *address[2:]) if servers else address)
            except OSError:
                sock.close()
                raise
            servers.append(
                await loop.create_server(
                    lambda: _LaneConnection(self), sock=sock, backlog=self._max_connections
                )
            )
            if len(servers) == 1:
                self.port = sock.getsockname()[1]
        return servers

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    @contextlib.contextmanager
    def expecting(self, reader: EnvelopeReader) -> Iterator[tuple[bytes, asyncio.Future[None]]]:
        """A ticket for `reader`'s missing data and a future done when it has all arrived
        (failed with EnvelopeRejected when it cannot). On leaving, the ticket is void and a
        connection still writing to the reader is closed."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        expected = _Expected(reader, asyncio.get_running_loop().create_future())
        self._tickets[ticket] = expected
        try:
            yield ticket, expected.arrived
        finally:
            self._tickets.pop(ticket, None)
            if not expected.arrived.done():
                expected.arrived.cancel()  # nobody awaits it any more
            if expected.connection is not None:
                expected.connection.abort()

    async def close(self) -> None:
        """Stop listening and close every lane connection."""
        servers, self._servers, self.port = self._servers, [], 0
        for server in servers:
            server.close()
        for connection in list(self._connections):
            connection.close()
        for server in servers:
            await server.wait_closed()

    def _admit(self, connection: _LaneConnection) -> bool:
        if len(self._connections) >= self._max_connections:
            return False
        self._connections.add(connection)
        return True

    def _claim(self, ticket: bytes, transport: asyncio.Transport) -> _Expected | None:
        """The envelope `ticket` was issued for, now bound to `transport` (None: no such
        ticket, or it was used or has expired)."""
        expected = self._tickets.pop(ticket, None)
        if expected is not None:
            expected.connection = transport
        return expected

    def _release(self, connection: _LaneConnection) -> None:
        self._connections.discard(connection)


class _LaneConnection(asyncio.BufferedProtocol):
    """One lane connection: its ticket, then its data read in place into the envelope's buffer."""

    def __init__(self, lane: LaneServer) -> None:
        self._lane = lane
        self._ticket = bytearray(TICKET_BYTES)
        self._ticket_got = 0
        self._expected: _Expected | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._lane._admit(self):
            transport.abort()
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._lane._ticket_timeout, transport.abort)

    def close(self) -> None:
        """Drop the connection at once (the lane closes)."""
        if self._transport is not None:
            self._transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._expected is None:
            return memoryview(self._ticket)[self._ticket_got :]
        return self._expected.reader.free_space()

    def buffer_updated(self, nbytes: int) -> None:
        assert self._transport is not None
        if self._expected is None:
            self._ticket_got += nbytes
            if self._ticket_got < TICKET_BYTES:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._expected = self._lane._claim(bytes(self._ticket), self._transport)
            if self._expected is None or self._expected.arrived.done():
                self._expected = None
                self._transport.abort()
            return
        expected = self._expected
        try:
            expected.reader.received(nbytes)
        except EnvelopeRejected as refused:  # NaN or Inf: the rest is not read
            if not expected.arrived.done():
                expected.arrived.set_exception(refused)
            self._transport.abort()
            return
        if not expected.reader.missing:
            if not expected.arrived.done():  # (done: its call ended, and with it the ticket)
                expected.arrived.set_result(None)
            self._transport.close()  # nothing beyond the declared bytes is read

    def eof_received(self) -> bool:
        return False  # the sender is done writing: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane._release(self)
        if self._timer is not None:
            self._timer.cancel()
        expected = self._expected
        if expected is not None and not expected.arrived.done():
            reader = expected.reader
            expected.arrived.set_exception(
                EnvelopeRejected(
                    RejectCode.INVALID_ARGUMENT,
                    f"data bytes: header declared {reader.declared}, the bulk lane connection "
                    f"closed after {reader.declared - reader.missing}",
                )
            )


def checked_ticket(reply: object, neighbour: int) -> pb.BulkTicket:
    """The ticket in a Bulk call's first answer, its fields checked (a receiver's word is
    hostile too); raises EnvelopeRejected naming what is wrong."""
    if not isinstance(reply, pb.BulkReply) or reply.WhichOneof("answer") != "ticket":
        raise EnvelopeRejected(
            RejectCode.INVALID_ARGUMENT,
            f"bulk reply from peer {neighbour}: expected a ticket first",
        )
    ticket = reply.ticket
    if len(ticket.ticket) != TICKET_BYTES or not 0 < ticket.port <= MAX_PORT:
        raise EnvelopeRejected(
            RejectCode.INVALID_ARGUMENT,
            f"bulk ticket from peer {neighbour}: expected {TICKET_BYTES} bytes and a port in "
            f"1..{MAX_PORT}, got {len(ticket.ticket)} bytes and port {ticket.port}",
        )
    return ticket


async def connect_lane(host: str, port: int) -> socket.socket:
    """A non-blocking TCP connection to the lane at `host`:`port`; raises OSError when none
    can be made."""
    loop = asyncio.get_running_loop()
    error: OSError = OSError(f"no address for {host!r}")
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
    raise error


async def send_on_lane(sock: socket.socket, ticket: bytes, data: Sequence[memoryview]) -> None:
    """Write `ticket` and then `data` on a lane connection, each view as it is (the kernel's
    copy is the only one); raises OSError when the receiver closes it first."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, ticket)
    for view in data:
        if len(view):
            await loop.sock_sendall(sock, view)
