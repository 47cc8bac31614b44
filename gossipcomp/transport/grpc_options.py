"""The gRPC transport's settings, checked when made, and why its security rules hold.

Limits, timings, TLS files and signing keys for GrpcTransport (grpc_transport.py, the client
side) and its server (grpc_service.py): a bad value fails before any socket opens. With them
the reasons the transport gives when it refuses to start (keys without TLS, plaintext off
loopback). Kept apart from both sides, which read them, and because the command lines build
and check options (and test addresses with `is_loopback`) without starting a transport.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from gossipcomp.security.signing_keys import PeerKeys
from gossipcomp.security.tls import TlsFiles
from gossipcomp.transport.authentication import DEFAULT_CLOCK_TOLERANCE
from gossipcomp.transport.base import DEFAULT_BULK_LANE_BYTES
from gossipcomp.transport.serving import (
    DEFAULT_READ_CHUNK_BYTES,
    check_read_chunk,
    read_chunk_options,
)
from gossipcomp.transport.wire import DEFAULT_CHUNK_BYTES

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
    # envelopes with at least this many data bytes go on the bulk lane (transport/
    # bulk_lane.py) when peers are plaintext: the kernel's copies only, not grpcio's; 0: never.
    # With TLS every envelope stays on gRPC (the lane has no TLS)
    bulk_lane_bytes: int = DEFAULT_BULK_LANE_BYTES
    max_lane_connections: int = 64  # bulk lane connections open at once, ticket or not

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
            "max_lane_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"GrpcOptions.{name}: expected >= 1, got {getattr(self, name)}")
        check_read_chunk(self.read_chunk_bytes, "GrpcOptions")
        if self.bulk_lane_bytes < 0:
            raise ValueError(
                f"GrpcOptions.bulk_lane_bytes: expected >= 0 (0: no bulk lane), got "
                f"{self.bulk_lane_bytes}"
            )
        if self.receive_pool_bytes < 0:
            raise ValueError(
                f"GrpcOptions.receive_pool_bytes: expected >= 0, got {self.receive_pool_bytes}"
            )

    @property
    def uses_bulk_lane(self) -> bool:
        """Whether large envelopes go on the bulk lane: plaintext peers with it on."""
        return self.tls is None and self.bulk_lane_bytes > 0

    def channel_options(self, rank: int = 0) -> list[tuple[str, int]]:
        """The options of a channel made by peer `rank`. Peers of one process share their
        connections to a server in groups (`connection_group`): every edge keeps a stream open
        on its connection (its Link), so one connection for all of them could run out of
        streams at a hub, while one each would take a socket per edge (a dense graph of 64
        peers in one process needed over 1,400 file descriptors)."""
        return [
            ("gossipcomp.connection_group", self.connection_group(rank)),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            *read_chunk_options(self.read_chunk_bytes),
        ]

    def connection_group(self, rank: int) -> int:
        """Which of its process's connections to a server peer `rank` uses: ranks in blocks of
        a quarter of `max_streams_per_connection` (at least 1) share one, so the links on one
        connection take at most a quarter of its streams, leaving the rest to pushes and
        handshakes."""
        return rank // max(1, self.max_streams_per_connection // 4)


def is_loopback(bind: str) -> bool:
    """Whether a `host:port` address only accepts connections from this machine."""
    host = bind.rsplit(":", 1)[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or 0.0.0.0 / [::] (every interface)
