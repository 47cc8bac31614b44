"""A peer's receiving side, shared by every transport: expectations, validation, mailbox.

Whatever the transport, an incoming envelope passes the same checks in the same order: header
(protocol version, sender is a neighbour, (schedule epoch, phase) known, size within limits,
every tensor's name, dtype, shape, codec and byte count as expected), then values (finite
floats), then the mailbox's round and duplicate checks. Only then can an algorithm see it.

Expectations are keyed by (schedule epoch, phase): a peer that staged a new schedule accepts
envelopes laid out by it as soon as a neighbour switches, and `collect` hands an exchange only
the envelopes sent under the epoch the exchange itself uses, so no exchange ever mixes two.
A sender's link level may change at a round within an epoch (levels set by peers without a
coordinator): `expect_from` declares what its envelopes hold from that round on, chosen by the
header's round. Level notices in headers are checked with the header (levels/notices.py).

Every transport holds one Inbox and exposes it (`transport.inbox`; a throttle hands through the
one it wraps), and the peer talks to it directly: a transport only moves bytes. The inbox also
keeps the level notice announced to each neighbour, since a notice is one agreement per edge:
checked here on the way in (`accept_notices`), stamped by the transport on the way out
(`notice_for`), so both are set in one place whatever the transport.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable, Mapping

from gossipcomp.levels.notices import check_notice
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import (
    Envelope,
    ExchangeResult,
    LevelNotice,
    NoticeRules,
    PayloadSpec,
    epoch_mismatch,
)
from gossipcomp.transport.codec import (
    UnstageableEpoch,
    check_finite,
    decode_payloads,
    validate_header,
)
from gossipcomp.transport.mailbox import Mailbox

SpecTable = Mapping[tuple[int, str], Mapping[int, PayloadSpec]]


@dataclasses.dataclass(frozen=True)
class Arrivals:
    """What one exchange collected: by sender, the envelope (and its wire bytes) sent under the
    exchange's schedule epoch, and the epoch of each one that was not (never used)."""

    round: int
    phase: str
    schedule_epoch: int
    envelopes: dict[int, tuple[Envelope, int]]
    mismatched: dict[int, int]

    def report(self, result: ExchangeResult, senders: Iterable[int], timeout: float) -> None:
        """Enter in `result` each sender's envelope, or why the exchange failed for it (sent
        under another epoch, or nothing within `timeout` seconds); senders whose push already
        failed are left as they are."""
        for j in senders:
            if j in result.failed:
                continue
            if j in self.mismatched:
                result.failed[j] = epoch_mismatch(
                    self.round, self.mismatched[j], self.schedule_epoch
                )
                result.epoch_mismatches.append(j)
            elif j not in self.envelopes:
                result.failed[j] = (
                    f"no envelope for round {self.round} phase {self.phase!r} in {timeout:g} s"
                )
            else:
                result.received[j], result.bytes_received[j] = self.envelopes[j]


class Inbox:
    """Validates and stores envelopes addressed to one peer; holds the notices it announces."""

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
        # (epoch, phase, sender) -> (round, what its envelopes hold from that round on)
        self._from_round: dict[tuple[int, str, int], tuple[int, PayloadSpec]] = {}
        self._notice_rules: NoticeRules | None = None
        self._notices: dict[int, LevelNotice] = {}  # neighbour -> what its envelopes carry
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
            self._from_round = {k: v for k, v in self._from_round.items() if k[0] >= schedule_epoch}

    def expect_from(
        self,
        sender: int,
        round: int,
        specs: Mapping[str, PayloadSpec],
        schedule_epoch: int = 0,
    ) -> None:
        """From `round` on, `sender`'s envelopes of `schedule_epoch` hold `specs` (per phase)
        instead of what `expect` declared: a link level changing at that round. Replaces the
        sender's earlier one under that epoch; empty `specs` drops it."""
        if sender not in self.neighbours:
            raise ValueError(f"peer {self.rank}: specs given for non-neighbour {sender}")
        with self._lock:
            kept = {
                k: v
                for k, v in self._from_round.items()
                if not (k[0] == schedule_epoch and k[2] == sender)
            }
            for phase, spec in specs.items():
                kept[(schedule_epoch, phase, sender)] = (round, spec)
            self._from_round = kept

    def accept_notices(self, rules: NoticeRules | None) -> None:
        """Accept level notices in neighbours' envelopes under `rules` (None: refuse any)."""
        self._notice_rules = rules

    def announce(self, neighbour: int, notice: LevelNotice | None) -> None:
        """Carry `notice` in every envelope sent to `neighbour` from now on (None: none)."""
        if notice is None:
            self._notices.pop(neighbour, None)
        else:
            self._notices[neighbour] = notice

    def notice_for(self, neighbour: int) -> LevelNotice | None:
        """The notice the transport puts in envelopes to `neighbour` (None: none)."""
        return self._notices.get(neighbour)

    def open_round(self, round: int) -> None:
        """Accept envelopes from `round` on (and a few rounds ahead); older ones are late. Every
        exchange opens its own round; a peer that jumps ahead opens the new one at once."""
        self.mailbox.open_round(round)

    def rewind_round(self, round: int) -> None:
        """Start again at an earlier `round`, dropping everything held (a peer with no live edge
        adopting its neighbours' round)."""
        self.mailbox.rewind(round)

    def allow_round(self, neighbour: int, round: int) -> None:
        """Accept `neighbour`'s envelopes for `round` even beyond the window (a resume round)."""
        self.mailbox.allow(neighbour, round)

    def collect(
        self,
        round: int,
        phase: str,
        senders: Iterable[int],
        deadline: float,
        schedule_epoch: int,
    ) -> Arrivals:
        """The envelopes of (round, phase) from `senders` that arrive before `deadline`
        (time.monotonic), split into those sent under `schedule_epoch` and, by sender, the
        epoch of those that were not (never used: the exchange fails for that neighbour)."""
        arrived = self.mailbox.collect(round, phase, senders, deadline)
        mismatched = {
            j: envelope.schedule_epoch
            for j, (envelope, _) in arrived.items()
            if envelope.schedule_epoch != schedule_epoch
        }
        kept = {j: v for j, v in arrived.items() if j not in mismatched}
        return Arrivals(round, phase, schedule_epoch, kept, mismatched)

    def check_header(self, header: pb.EnvelopeHeader) -> PayloadSpec:
        """Validate a header (its level notice included, and its round against the mailbox's)
        before any data is read; return the spec it matched. A sender whose envelope comes
        under an epoch this peer cannot hold for its round (UnstageableEpoch) is not waited for
        in that round and phase."""
        try:
            spec = validate_header(
                protocol_version=header.protocol_version,
                round=header.round,
                schedule_epoch=header.schedule_epoch,
                sender=header.sender,
                phase=header.phase,
                tensors=list(header.tensors),
                neighbours=self.neighbours,
                specs=self._specs_at(header),
                max_envelope_bytes=self._max_envelope_bytes,
                reached_round=self.mailbox.reached,
            )
        except UnstageableEpoch:
            self.mailbox.abandon(header.round, header.phase, header.sender)
            raise
        check_notice(header, self.rank, self._notice_rules)
        self.mailbox.check_round(header.round, header.sender)  # late or not yet: no data read
        return spec

    def _specs_at(self, header: pb.EnvelopeHeader) -> SpecTable:
        """The expectations that hold for this header's round: `expect`'s, with the sender's
        `expect_from` spec for the phase once its round has come."""
        specs, changes = self._specs, self._from_round
        change = changes.get((header.schedule_epoch, header.phase, header.sender))
        key = (header.schedule_epoch, header.phase)
        if change is None or header.round < change[0] or key not in specs:
            return specs
        return {**specs, key: {**specs[key], header.sender: change[1]}}

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
