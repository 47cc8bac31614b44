"""In-process transport for fast tests: neighbours' inboxes reached by direct calls.

Envelopes pass through the same Inbox validation as over gRPC, and the bytes reported are the
serialised size of the chunks gRPC would send, so algorithms behave and account identically.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping

from gossipcomp.transport.base import (
    Envelope,
    EnvelopeRejected,
    ExchangeResult,
    HandshakeError,
    Identity,
    Payload,
    PayloadSpec,
    PeerUnreachableError,
)
from gossipcomp.transport.inbox import Inbox
from gossipcomp.transport.wire import envelope_wire_bytes, header_of


class InMemoryHub:
    """The shared 'network' of InMemoryTransports living in one process."""

    def __init__(self) -> None:
        self._transports: dict[int, InMemoryTransport] = {}
        self._lock = threading.Lock()

    def register(self, transport: InMemoryTransport) -> None:
        with self._lock:
            if transport.rank in self._transports:
                raise ValueError(f"rank {transport.rank} is already on this hub")
            self._transports[transport.rank] = transport

    def unregister(self, rank: int) -> None:
        with self._lock:
            self._transports.pop(rank, None)

    def lookup(self, rank: int) -> InMemoryTransport | None:
        with self._lock:
            return self._transports.get(rank)


class InMemoryTransport:
    """Transport whose 'wire' is a function call into the neighbour's Inbox."""

    def __init__(
        self,
        identity: Identity,
        neighbours: Collection[int],
        hub: InMemoryHub,
        max_envelope_bytes: int = 1 << 30,
    ) -> None:
        self.rank = identity.rank
        self.identity = identity
        self._neighbours = sorted(neighbours)
        self._hub = hub
        self._inbox = Inbox(self.rank, neighbours, max_envelope_bytes)
        hub.register(self)

    def expect(self, phase: str, specs: Mapping[int, PayloadSpec] | PayloadSpec) -> None:
        self._inbox.expect(phase, specs)

    def receive(self, envelope: Envelope) -> int:
        """Validate and store an envelope as if it came over the wire; return its wire bytes."""
        spec = self._inbox.check_header(header_of(envelope))
        wire_bytes = envelope_wire_bytes(envelope)
        self._inbox.accept(envelope, spec, wire_bytes)
        return wire_bytes

    def connect(self, addresses: Mapping[int, str], timeout: float) -> None:
        """Wait until every neighbour is on the hub with the same topology, model and protocol."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [j for j in self._neighbours if self._hub.lookup(j) is None]
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise PeerUnreachableError(
                    f"peer {self.rank}: neighbours {missing} not on the hub within {timeout:g} s"
                )
            time.sleep(0.01)
        for j in self._neighbours:
            other = self._hub.lookup(j)
            if other is not None and other.identity != Identity(
                j,
                self.identity.topology_hash,
                self.identity.model_signature,
                self.identity.protocol_version,
            ):
                raise HandshakeError(f"peer {self.rank}: peer {j} has identity {other.identity}")

    def exchange(
        self,
        round: int,
        phase: str,
        outgoing: Mapping[int, Payload],
        timeout: float,
        schedule_epoch: int = 0,
    ) -> ExchangeResult:
        deadline = time.monotonic() + timeout
        self._inbox.mailbox.open_round(round)
        result = ExchangeResult()
        for j, payload in outgoing.items():
            target = self._hub.lookup(j)
            if target is None:
                result.failed[j] = "not on the hub"
                continue
            try:
                result.bytes_sent[j] = target.receive(
                    Envelope(self.rank, round, phase, payload, schedule_epoch)
                )
            except EnvelopeRejected as rejected:
                result.failed[j] = f"push refused: {rejected.code.value}: {rejected}"
        arrived = self._inbox.mailbox.collect(round, phase, outgoing.keys(), deadline)
        for j in outgoing:
            if j in result.failed:
                continue
            if j not in arrived:
                result.failed[j] = f"no envelope for round {round} phase {phase!r} in {timeout:g} s"
                continue
            result.received[j], result.bytes_received[j] = arrived[j]
        return result

    def close(self) -> None:
        self._hub.unregister(self.rank)
