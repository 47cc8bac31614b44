"""A peer's receiving side, shared by every transport: expectations, validation, mailbox.

Whatever the transport, an incoming envelope passes the same checks in the same order: header
(protocol version, sender is a neighbour, phase known, size within limits, every tensor's name,
dtype, shape, codec and byte count as expected), then values (finite floats), then the mailbox's
round and duplicate checks. Only then can an algorithm see it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Mapping

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import Envelope, PayloadSpec
from gossipcomp.transport.codec import check_finite, decode_payloads, validate_header
from gossipcomp.transport.mailbox import Mailbox


class Inbox:
    """Validates and stores envelopes addressed to one peer."""

    def __init__(
        self,
        rank: int,
        neighbours: Collection[int],
        max_envelope_bytes: int,
        mailbox_window: int = 4,
    ) -> None:
        self.rank = rank
        self.neighbours = frozenset(neighbours)
        self.mailbox = Mailbox(mailbox_window)
        self._max_envelope_bytes = max_envelope_bytes
        self._specs: dict[str, dict[int, PayloadSpec]] = {}
        self._lock = threading.Lock()

    def expect(self, phase: str, specs: Mapping[int, PayloadSpec] | PayloadSpec) -> None:
        """Declare what envelopes of `phase` must hold: one spec for all senders, or per sender."""
        per_sender = (
            {j: specs for j in self.neighbours} if isinstance(specs, tuple) else dict(specs)
        )
        unknown = set(per_sender) - self.neighbours
        if unknown:
            raise ValueError(f"peer {self.rank}: specs given for non-neighbours {sorted(unknown)}")
        with self._lock:  # replace, never mutate: readers take a consistent snapshot
            self._specs = {**self._specs, phase: per_sender}

    def check_header(self, header: pb.EnvelopeHeader) -> PayloadSpec:
        """Validate a header before any data is read; return the spec it matched."""
        return validate_header(
            protocol_version=header.protocol_version,
            round=header.round,
            schedule_epoch=header.schedule_epoch,
            sender=header.sender,
            phase=header.phase,
            tensors=list(header.tensors),
            neighbours=self.neighbours,
            specs=self._specs,
            max_envelope_bytes=self._max_envelope_bytes,
        )

    def accept(
        self, envelope: Envelope, spec: PayloadSpec, wire_bytes: int, values_checked: bool = False
    ) -> None:
        """Check values (unless read_envelope did as they arrived) and decode compressed
        payloads (which checks their layouts), then store the envelope with what was decoded;
        raises EnvelopeRejected and stores nothing when invalid."""
        if not values_checked:
            check_finite(envelope.tensors, spec)
        decoded = decode_payloads(envelope.tensors, spec, envelope.sender, envelope.round)
        if any(value is not None for value in decoded):
            envelope = dataclasses.replace(envelope, decoded=decoded)
        self.mailbox.deliver(envelope, wire_bytes)
