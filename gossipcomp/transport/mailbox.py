"""Where validated envelopes wait until the local peer asks for them, keyed by (round, phase, sender).

A peer's neighbours may run up to a round ahead, so envelopes for the current and a few future
rounds are held; anything for a round already finished is late and refused, a second envelope
for the same (round, phase, sender) is a duplicate and refused, so nothing is applied twice or
to the wrong round. An envelope for a round beyond the window is refused as not yet (ABORTED,
transport/backpressure.py): its sender is ahead, sends it again later, and this peer's memory
stays bounded by the window. When `collect` gives up on a sender at its deadline, that sender's envelope
for the (round, phase) is refused if it comes later: a sender whose push was acknowledged knows
its envelope was collected, so both ends of an edge see the same outcome unless the
acknowledgement itself is lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

from gossipcomp.transport.base import Envelope, EnvelopeRejected, RejectCode


class Mailbox:
    """Thread-safe store of envelopes for rounds in [floor, floor + window]."""

    def __init__(self, window: int = 4) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 round, got {window}")
        self._window = window
        self._floor = 0
        self._reached = -1  # the furthest round opened (-1: none yet)
        self._items: dict[tuple[int, str, int], tuple[Envelope, int]] = {}
        self._consumed: set[tuple[int, str, int]] = set()
        self._closed: set[tuple[int, str, int]] = set()  # collect gave up on these
        self._abandoned: set[tuple[int, str, int]] = set()  # known not to come: stop waiting
        self._allowed: dict[int, int] = {}  # sender -> one round accepted beyond the window
        self._shut = False  # the transport is closing: no wait lasts
        self._cond = threading.Condition()

    def allow(self, sender: int, round: int) -> None:
        """Also accept `sender`'s envelopes for `round`, however far ahead: the round at which
        an edge resumes, agreed with a neighbour that may be many rounds ahead of this peer."""
        with self._cond:
            self._allowed[sender] = round

    def open_round(self, round: int) -> None:
        """Mark rounds before `round` finished: their envelopes are dropped and refused from now."""
        with self._cond:
            self._reached = max(self._reached, round)
            if round > self._floor:
                self._floor = round
                self._items = {k: v for k, v in self._items.items() if k[0] >= round}
                self._consumed = {k for k in self._consumed if k[0] >= round}
                self._closed = {k for k in self._closed if k[0] >= round}
                self._abandoned = {k for k in self._abandoned if k[0] >= round}
                self._allowed = {s: r for s, r in self._allowed.items() if r >= round}

    def rewind(self, round: int) -> None:
        """Start again at `round`, earlier than the floor: everything held or remembered is
        dropped (agreed resume rounds from `round` on stay allowed)."""
        with self._cond:
            self._floor = round
            self._reached = round - 1
            self._items.clear()
            self._consumed.clear()
            self._closed.clear()
            self._abandoned.clear()
            self._allowed = {s: r for s, r in self._allowed.items() if r >= round}
            self._cond.notify_all()

    @property
    def reached(self) -> int:
        """The furthest round this peer has opened (-1 before its first): a schedule it stages
        from now on takes effect after it, so an epoch it does not hold for a round up to this
        one never comes for that round."""
        with self._cond:
            return self._reached

    def check_round(self, round: int, sender: int) -> None:
        """Refuse `sender`'s envelope for `round` as late (FAILED_PRECONDITION: that round is
        finished here) or not yet (ABORTED: beyond the window and not an agreed resume round;
        the sender may push it again once this peer gets there). Called with the header, before
        any data is read, and again when the envelope is stored."""
        with self._cond:
            if round < self._floor:
                raise EnvelopeRejected(
                    RejectCode.FAILED_PRECONDITION,
                    f"round: expected >= {self._floor} (earlier rounds are finished), got {round}",
                    public=f"round {round}: not accepted now",
                )
            if round > self._floor + self._window and self._allowed.get(sender) != round:
                raise EnvelopeRejected(
                    RejectCode.ABORTED,
                    f"round: expected <= {self._floor + self._window} "
                    f"(at most {self._window} ahead of {self._floor}), got {round}",
                    public=f"round {round}: not accepted yet",
                )

    def deliver(self, envelope: Envelope, wire_bytes: int) -> None:
        """Store a validated envelope, or refuse it as late, not yet due or a duplicate."""
        key = (envelope.round, envelope.phase, envelope.sender)
        with self._cond:
            self.check_round(envelope.round, envelope.sender)  # the condition's lock is reentrant
            if key in self._items or key in self._consumed:
                raise EnvelopeRejected(
                    RejectCode.ALREADY_EXISTS,
                    f"duplicate envelope for round {envelope.round}, phase {envelope.phase!r} "
                    f"from peer {envelope.sender}",
                    public=f"round {envelope.round}: not accepted now",
                )
            if key in self._closed:
                raise EnvelopeRejected(
                    RejectCode.FAILED_PRECONDITION,
                    f"round {envelope.round}, phase {envelope.phase!r}: arrived after peer's "
                    "deadline for it (the round went on without this envelope)",
                    public=f"round {envelope.round}: not accepted now",
                )
            self._items[key] = (envelope, wire_bytes)
            self._cond.notify_all()

    def collect(
        self, round: int, phase: str, senders: Collection[int], deadline: float
    ) -> dict[int, tuple[Envelope, int]]:
        """Wait until every sender's envelope for (round, phase) is here or the deadline passes.

        Returns (and removes) the envelopes that arrived, with their wire bytes. Senders given up
        with `abandon` are not waited for; those still missing at the end are closed: their
        envelope for this (round, phase) is refused should it arrive later.
        """
        wanted = set(senders)
        with self._cond:
            while True:
                missing = [
                    s
                    for s in wanted
                    if (round, phase, s) not in self._items
                    and (round, phase, s) not in self._abandoned
                ]
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0 or self._shut:
                    break
                self._cond.wait(remaining)
            arrived = {}
            for s in wanted:
                key = (round, phase, s)
                if key in self._items:
                    arrived[s] = self._items.pop(key)
                    self._consumed.add(key)
                else:
                    self._closed.add(key)
            return arrived

    def shut(self) -> None:
        """End every wait now and make later ones return at once with what is here: the
        transport is closing, and no envelope it waits for will be taken in."""
        with self._cond:
            self._shut = True
            self._cond.notify_all()

    def abandon(self, round: int, phase: str, sender: int) -> None:
        """Stop waiting for `sender`'s envelope of (round, phase): it is known not to come (our
        push to that sender was refused, so it has moved on or gone; or it came under an epoch
        this peer cannot hold for that round). A finished round is nobody's wait: nothing is
        kept for it, so headers naming old rounds cannot fill memory until the next round."""
        with self._cond:
            if round < self._floor:
                return
            self._abandoned.add((round, phase, sender))
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._items)
