"""The bulk lane: a large envelope's data on a TCP connection of the transport's own, not gRPC's.

Why: grpcio copies every message in user space on both ends (into a slice when sending; on
receipt a bytes object per HTTP/2 frame, then a join), and a 64 MiB envelope through it cost
twice the CPU of the same bytes on a socket (docs/benchmarks.md, "CPU per envelope on each
end"). On the lane the sender's tensors go to the kernel as they are and the receiver reads
them straight into the envelope's buffer: the only copies are the kernel's.

How (grpc_service.py serves the gRPC half): the sender calls Bulk with the envelope's header;
the receiver checks it exactly as Push does, takes the buffer, and answers a ticket (random
bytes) and its lane's port. The sender connects to that port on the host of the receiver's
gRPC address and writes the ticket; the lane answers TICKET_ACCEPTED, and only then does the
sender write exactly the data the header declared, which the receiver checks as it lands and
answers `done` on the Bulk call, or refuses it as Push would. A sender that cannot open the
lane in time (nothing listens, the ticket is not accepted) sends that envelope as a gRPC
stream instead. What a stranger who reaches the port can do is bounded here:

- at most `max_connections` lane connections are open at once; a new one beyond that takes the
  place of the oldest that has not shown a ticket (an honest sender shows its ticket at once,
  so connections held open in silence cannot keep it out), and is refused only when every
  connection is carrying data; turned-away connections are logged, at most once a minute;
- a connection must show a ticket within `ticket_timeout` seconds, or it is closed;
- a ticket is TICKET_BYTES from `secrets`, told only to the Bulk caller whose header was
  checked, good for one connection, and only while that call lasts: the call ends when its
  ticket is not shown within `ticket_timeout` (so an unused ticket holds its buffer no
  longer), and an unknown, used or expired ticket closes the connection with nothing said;
- the data lands only in the buffer of a header already checked, whose size, caller slot and
  deadline the Bulk call bounds; bytes beyond the declared count are never read (the
  connection is closed once the data is complete), and one that ends early refuses the envelope.

Plaintext only: the lane has no TLS of its own, so a transport with TLS keeps every envelope on
gRPC (grpc_transport.py), and authentication (which needs TLS) never meets the lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import EnvelopeRejected, RejectCode
from gossipcomp.transport.wire import EnvelopeReader

TICKET_BYTES = 16
TICKET_ACCEPTED = b"lane"  # the lane's answer to a valid ticket: the sender may write its data
MAX_PORT = 65535
MAX_BIND_ATTEMPTS = 8  # ports tried for a host of several addresses (LaneServer.start)
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # every interface: both families are served
LOG_EVERY = 60.0  # seconds between two warnings about turned-away connections
# a socket family this machine lacks (IPv6 turned off): its addresses are left out
_FAMILY_MISSING = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})

log = logging.getLogger("gossipcomp.transport")


@dataclass
class LaneTicket:
    """An envelope whose data the lane awaits: its ticket and reader, a future done when a
    connection has shown the ticket, one done when the data has all arrived (failed with
    EnvelopeRejected when it cannot), and that connection (None until it comes)."""

    ticket: bytes
    reader: EnvelopeReader
    claimed: asyncio.Future[None]
    arrived: asyncio.Future[None]
    connection: asyncio.Transport | None = field(default=None)


class LaneServer:
    """The receiving end: one listener on the transport's event loop, the tickets it issued."""

    def __init__(self, owner: str, max_connections: int, ticket_timeout: float) -> None:
        """`owner` names the peer in warnings (e.g. "peer 3")."""
        if max_connections < 1:
            raise ValueError(f"LaneServer: expected max_connections >= 1, got {max_connections}")
        if not 0 < ticket_timeout < float("inf"):
            raise ValueError(f"LaneServer: expected ticket_timeout > 0 s, got {ticket_timeout}")
        self.ticket_timeout = ticket_timeout
        self._owner = owner
        self._max_connections = max_connections
        self._tickets: dict[bytes, LaneTicket] = {}
        self._connections: set[_LaneConnection] = set()
        self._silent: dict[_LaneConnection, None] = {}  # no ticket shown yet, oldest first
        self._servers: list[asyncio.Server] = []
        self._closing = False
        self._turned_away = 0  # connections refused or evicted since the last warning
        self._warned_at = -LOG_EVERY
        self.port = 0

    async def start(self, host: str) -> int:
        """Listen on one unused port at every address of `host` (on the running loop: a name
        such as localhost may stand for an IPv6 and an IPv4 address, a wildcard for every
        interface of both, and a sender may reach any of them); return the port. Raises
        OSError when no port is free at all of them."""
        loop = asyncio.get_running_loop()
        found = await loop.getaddrinfo(
            None if host in WILDCARD_HOSTS else host,
            0,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        addresses = list(dict.fromkeys(found))  # a resolver may name one address twice
        for _ in range(MAX_BIND_ATTEMPTS):
            try:
                self._servers = await self._bind_all(addresses)
                return self.port
            except OSError as error:
                await self._stop_listening()
                if error.errno != errno.EADDRINUSE:
                    raise
                taken = error  # the port is taken at another of the addresses: another port
        raise OSError(f"bulk lane: no port free at every address of {host!r}") from taken

    async def _bind_all(self, addresses: list[tuple]) -> list[asyncio.Server]:
        """A server at each address, all on one port (the first one's, picked by the kernel);
        an address of a family this machine lacks (IPv6 turned off) is left out."""
        loop = asyncio.get_running_loop()
        servers: list[asyncio.Server] = []
        self._servers = servers
        for family, kind, proto, _, address in addresses:
            port = self.port if servers else 0
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as error:
                if error.errno in _FAMILY_MISSING:
                    continue
                raise
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], port, *address[2:]))
            except OSError as error:
                sock.close()
                if error.errno in _FAMILY_MISSING:
                    continue
                raise  # the port is taken at this address: start() tries another
            try:
                server = await loop.create_server(
                    lambda: _LaneConnection(self), sock=sock, backlog=self._max_connections
                )
            except BaseException:
                sock.close()
                raise
            servers.append(server)
            if len(servers) == 1:
                self.port = sock.getsockname()[1]
        if not servers:
            raise OSError("bulk lane: no address of the host could be listened on")
        return servers

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    @property
    def closing(self) -> bool:
        """Whether `close` has begun (Bulk calls are refused from then on)."""
        return self._closing

    @contextlib.contextmanager
    def expecting(self, reader: EnvelopeReader) -> Iterator[LaneTicket]:
        """A ticket for `reader`'s missing data (see LaneTicket). On leaving, the ticket is
        void and a connection still writing to the reader is closed."""
        loop = asyncio.get_running_loop()
        ticket = LaneTicket(
            secrets.token_bytes(TICKET_BYTES), reader, loop.create_future(), loop.create_future()
        )
        self._tickets[ticket.ticket] = ticket
        try:
            yield ticket
        finally:
            self._tickets.pop(ticket.ticket, None)
            for future in (ticket.claimed, ticket.arrived):
                if not future.done():
                    future.cancel()  # nobody awaits it any more
            if ticket.connection is not None:
                ticket.connection.abort()

    async def close(self) -> None:
        """Stop listening and close every lane connection (none is admitted from now on)."""
        self._closing = True
        for connection in list(self._connections):
            connection.close()
        await self._stop_listening()
        if self._turned_away:  # the count since the last warning, not to be lost
            self._warn_turned_away()

    async def _stop_listening(self) -> None:
        servers, self._servers, self.port = self._servers, [], 0
        for server in servers:
            server.close()
        for server in servers:
            await server.wait_closed()

    def _admit(self, connection: _LaneConnection) -> bool:
        """Whether `connection` may stay: when the lane is full, the oldest connection without
        a ticket makes room for it; if every one carries data, it is refused."""
        if self._closing:
            return False
        if len(self._connections) >= self._max_connections:
            self._note_turned_away()
            if not self._silent:
                return False
            oldest = next(iter(self._silent))
            self._release(oldest)
            oldest.close()
        self._connections.add(connection)
        self._silent[connection] = None
        return True

    def _note_turned_away(self) -> None:
        self._turned_away += 1
        if time.monotonic() - self._warned_at >= LOG_EVERY:
            self._warn_turned_away()

    def _warn_turned_away(self) -> None:
        log.warning(
            "%s: bulk lane full (%d connections): %d turned away or evicted without a ticket "
            "since the last warning",
            self._owner,
            self._max_connections,
            self._turned_away,
        )
        self._warned_at, self._turned_away = time.monotonic(), 0

    def _claim(self, ticket: bytes, connection: _LaneConnection) -> LaneTicket | None:
        """The envelope `ticket` was issued for, now bound to `connection` (None: no such
        ticket, or it was used or has expired)."""
        self._silent.pop(connection, None)
        claimed = self._tickets.pop(ticket, None)
        if claimed is None or claimed.claimed.done():
            return None
        claimed.connection = connection.transport
        claimed.claimed.set_result(None)
        return claimed

    def _release(self, connection: _LaneConnection) -> None:
        self._connections.discard(connection)
        self._silent.pop(connection, None)


class _LaneConnection(asyncio.BufferedProtocol):
    """One lane connection: its ticket, then its data read in place into the envelope's buffer."""

    def __init__(self, lane: LaneServer) -> None:
        self._lane = lane
        self._ticket = bytearray(TICKET_BYTES)
        self._ticket_got = 0
        self._claimed: LaneTicket | None = None
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self._lane._admit(self):
            transport.abort()
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._lane.ticket_timeout, transport.abort)

    def close(self) -> None:
        """Drop the connection at once (the lane closes, or needs its place)."""
        if self.transport is not None:
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._claimed is None:
            return memoryview(self._ticket)[self._ticket_got :]
        return self._claimed.reader.free_space()

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        if self._claimed is None:
            self._ticket_got += nbytes
            if self._ticket_got < TICKET_BYTES:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._claimed = self._lane._claim(bytes(self._ticket), self)
            if self._claimed is None:
                self.transport.abort()
            else:
                self.transport.write(TICKET_ACCEPTED)
            return
        claimed = self._claimed
        try:
            claimed.reader.received(nbytes)
        except EnvelopeRejected as refused:  # NaN or Inf: the rest is not read
            if not claimed.arrived.done():
                claimed.arrived.set_exception(refused)
            self.transport.abort()
            return
        if not claimed.reader.missing:
            if not claimed.arrived.done():  # (done: its call ended, and with it the ticket)
                claimed.arrived.set_result(None)
            self.transport.close()  # nothing beyond the declared bytes is read

    def eof_received(self) -> bool:
        return False  # the sender is done writing: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane._release(self)
        if self._timer is not None:
            self._timer.cancel()
        claimed = self._claimed
        if claimed is not None and not claimed.arrived.done():
            reader = claimed.reader
            claimed.arrived.set_exception(
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


async def open_lane(host: str, port: int, ticket: bytes, timeout: float) -> socket.socket:
    """A lane connection to `host`:`port` that has shown `ticket` and been answered
    TICKET_ACCEPTED, within `timeout` seconds: the sender's data may follow. Raises OSError
    (TimeoutError among them) when no connection can be made, or the lane closes it or answers
    anything else."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        sock = await _connect(host, port)
        try:
            await loop.sock_sendall(sock, ticket)
            answer = b""
            while len(answer) < len(TICKET_ACCEPTED):
                more = await loop.sock_recv(sock, len(TICKET_ACCEPTED) - len(answer))
                if not more:
                    raise ConnectionResetError("the lane closed without accepting the ticket")
                answer += more
            if answer != TICKET_ACCEPTED:
                raise ConnectionError("the lane answered something other than its acceptance")
        except BaseException:
            sock.close()
            raise
    return sock


async def _connect(host: str, port: int) -> socket.socket:
    """A non-blocking TCP connection to `host`:`port` (each of its addresses in turn)."""
    loop = asyncio.get_running_loop()
    error: OSError = OSError(f"no address for {host!r}")
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as failed:  # a family this machine lacks (IPv6 off): the next address
            error = failed
            continue
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
        except BaseException:  # cancelled, or the caller's time ran out
            sock.close()
            raise
    raise error


async def send_on_lane(sock: socket.socket, data: Sequence[memoryview]) -> None:
    """Write `data` on an open lane connection, each view as it is (the kernel's copy is the
    only one); raises OSError when the receiver closes it first."""
    loop = asyncio.get_running_loop()
    for view in data:
        if len(view):
            await loop.sock_sendall(sock, view)
