"""A peer's receiving side, shared by every transport: expectations, validation, mailbox.

Whatever the transport, an incoming envelope passes the same checks in the same order: header
(protocol version, sender is a neighbour, (schedule epoch, phase) known, size within limits,
every tensor's name, dtype, shape, codec and byte count as expected), then values (finite
floats), then the mailbox's round and duplicate checks. Only then can an algorithm see it.

Expectations are keyed by (schedule epoch, phase): a peer that staged a new schedule accepts
envelopes laid out by it as soon as a neighbour switches, and `collect` hands an exchange only
the envelopes sent under the epoch the exchange itself uses, so no exchange ever mixes two.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable, Mapping

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
        self._specs: dict[tuple[int, str], dict[int, PayloadSpec]] = {}
        self._lock = threading.Lock()

    def expect(
        self,
        phase: str,
        specs: Mapping[int, PayloadSpec] | PayloadSpec,
        schedule_epoch: int = 0,
    ) -> None:
        """Declare what envelopes of (`schedule_epoch`, `phase`) must hold: one spec for all
        senders, or per sender."""
        per_sender = (
            {j: specs for j in self.neighbours} if isinstance(specs, tuple) else dict(specs)
        )
        unknown = set(per_sender) - self.neighbours
        if unknown:
            raise ValueError(f"peer {self.rank}: specs given for non-neighbours {sorted(unknown)}")
        with self._lock:  # replace, never mutate: readers take a consistent snapshot
            self._specs = {**self._specs, (schedule_epoch, phase): per_sender}

    def forget_epochs_before(self, schedule_epoch: int) -> None:
        """Drop the expectations of epochs older than `schedule_epoch` (no longer in use)."""
        with self._lock:
            self._specs = {k: v for k, v in self._specs.items() if k[0] >= schedule_epoch}

    def collect(
        self,
        round: int,
        phase: str,
        senders: Iterable[int],
        deadline: float,
        schedule_epoch: int,
    ) -> tuple[dict[int, tuple[Envelope, int]], dict[int, int]]:
        """The envelopes of (round, phase) from `senders` that arrive before `deadline`
        (time.monotonic), split into those sent under `schedule_epoch` and, by sender, the
        epoch of those that were not (never used: the exchange fails for that neighbour)."""
        arrived = self.mailbox.collect(round, phase, senders, deadline)
        mismatched = {
            j: envelope.schedule_epoch
            for j, (envelope, _) in arrived.items()
            if envelope.schedule_epoch != schedule_epoch
        }
        return {j: v for j, v in arrived.items() if j not in mismatched}, mismatched

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
