"""In-process transport for fast tests: neighbours' inboxes reached by direct calls.

Envelopes pass through the same Inbox validation as over gRPC, and the bytes reported are the
serialised size of the chunks gRPC would send, so algorithms behave and account identically.
The hub also injects network faults deterministically, as a real network shows them to a
sender: a message lost on the way (the push fails, nothing arrives; handshakes fail too, so a
partition is a set of lost directions), or an acknowledgement lost (the envelope arrives and
is used, yet the sender sees its push fail: the asymmetric failure).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import Future

from gossipcomp.transport.backpressure import pauses_until
from gossipcomp.transport.base import (
    Envelope,
    EnvelopeRejected,
    ExchangeResult,
    Greeting,
    HandshakeError,
    HelloAnswer,
    HelloHandler,
    Identity,
    Outgoing,
    PeerNotReady,
    PeerUnreachableError,
    RejectCode,
    no_rejoin,
)
from gossipcomp.transport.inbox import Inbox
from gossipcomp.transport.wire import envelope_wire_bytes, header_of


class Fault(enum.Enum):
    """What the hub does to messages in one direction (sender -> receiver)."""

    LOST = "lost"  # nothing arrives; the sender's push and handshakes fail
    ACK_LOST = "ack lost"  # the envelope arrives and is used; the sender's push fails


class InMemoryHub:
    """The shared 'network' of InMemoryTransports living in one process, with injected faults."""

    def __init__(self, hello_latency: float = 0.0) -> None:
        """`hello_latency`: seconds a probe's answer takes to come back (0: at once)."""
        self._transports: dict[int, InMemoryTransport] = {}
        self._faults: dict[tuple[int, int], Fault] = {}
        self._lock = threading.Lock()
        self.hello_latency = hello_latency

    def inject(self, sender: int, receiver: int, fault: Fault) -> None:
        """Apply `fault` to every message from `sender` to `receiver` until `heal`."""
        with self._lock:
            self._faults[(sender, receiver)] = fault

    def partition(self, *groups: Iterable[int]) -> None:
        """Lose every message between peers of different groups, both ways."""
        sets = [set(g) for g in groups]
        for a, first in enumerate(sets):
            for second in sets[a + 1 :]:
                for i in first:
                    for j in second:
                        self.inject(i, j, Fault.LOST)
                        self.inject(j, i, Fault.LOST)

    def heal(self) -> None:
        """Remove every injected fault."""
        with self._lock:
            self._faults.clear()

    def fault(self, sender: int, receiver: int) -> Fault | None:
        with self._lock:
            return self._faults.get((sender, receiver))

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
        self.schedule_epoch = 0
        self.identity = identity
        self._neighbours = sorted(neighbours)
        self._hub = hub
        self.inbox = Inbox(self.rank, neighbours, max_envelope_bytes)
        self._on_hello: HelloHandler = no_rejoin
        hub.register(self)

    def receive(self, envelope: Envelope) -> int:
        """Validate and store an envelope as if it came over the wire; return its wire bytes."""
        header = header_of(envelope)
        spec = self.inbox.check_header(header)
        wire_bytes = envelope_wire_bytes(envelope, header=header)
        self.inbox.accept(envelope, spec, wire_bytes)
        return wire_bytes

    def set_hello_handler(self, handler: HelloHandler) -> None:
        self._on_hello = handler

    def hello(
        self, sender: int, round: int, proposed: int, alone: bool, schedule_epoch: int
    ) -> HelloAnswer:
        """A neighbour's handshake arriving here (the in-process Hello)."""
        return self._on_hello(sender, round, proposed, alone, schedule_epoch)

    def probe(self, neighbour: int, round: int, proposed: int, alone: bool) -> Future[HelloAnswer]:
        answer: Future[HelloAnswer] = Future()
        target = self._hub.lookup(neighbour)
        lost = Fault.LOST in (
            self._hub.fault(self.rank, neighbour),
            self._hub.fault(neighbour, self.rank),
        )
        if target is None or lost:
            answer.set_exception(PeerUnreachableError(f"peer {neighbour} cannot be reached"))
            return answer
        try:
            reply = target.hello(self.rank, round, proposed, alone, self.schedule_epoch)
        except PeerNotReady as error:
            answer.set_exception(error)
            return answer
        if self._hub.hello_latency > 0:  # the answer is on its way back for a while
            timer = threading.Timer(self._hub.hello_latency, answer.set_result, (reply,))
            timer.daemon = True
            timer.start()
        else:
            answer.set_result(reply)
        return answer

    def connect(
        self, addresses: Mapping[int, str], timeout: float, greeting: Greeting | None = None
    ) -> dict[int, HelloAnswer]:
        """Wait until every neighbour is on the hub with the same topology, model and protocol;
        then greet each (see Transport.connect)."""
        greeting = greeting or Greeting()
        self.inbox.open_round(greeting.round)
        deadline = time.monotonic() + timeout
        among = greeting.among
        greeted = [j for j in self._neighbours if among is None or j in among]
        while True:
            missing = [j for j in greeted if self._hub.lookup(j) is None]
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
        answers = {}
        for j in greeted:
            other = self._hub.lookup(j)
            if other is not None:
                proposed = greeting.proposals.get(j, 0)
                answers[j] = other.hello(
                    self.rank, greeting.round, proposed, greeting.alone, self.schedule_epoch
                )
        return answers

    def exchange(
        self, round: int, phase: str, outgoing: Outgoing, timeout: float, schedule_epoch: int = 0
    ) -> ExchangeResult:
        start = time.monotonic()
        deadline = start + timeout
        self.inbox.open_round(round)
        result = ExchangeResult()
        not_yet = [
            j
            for j in outgoing
            if not self._push(j, round, phase, outgoing, schedule_epoch, start, result)
        ]
        # pushes refused as not yet due are sent again while this peer waits for its own
        # envelopes, on the schedule every transport uses (backpressure.py)
        retries = None
        if not_yet:
            retries = threading.Thread(
                target=self._push_when_due,
                args=(not_yet, round, phase, outgoing, schedule_epoch, start, deadline, result),
                name=f"peer {self.rank} pushes not yet due",
                daemon=True,
            )
            retries.start()
        arrivals = self.inbox.collect(round, phase, outgoing.keys(), deadline, schedule_epoch)
        if retries is not None:
            retries.join()
        arrivals.report(result, outgoing, timeout)
        return result

    def _push(
        self,
        j: int,
        round: int,
        phase: str,
        outgoing: Outgoing,
        schedule_epoch: int,
        start: float,
        result: ExchangeResult,
        last_try: bool = False,
    ) -> bool:
        """Deliver one envelope to `j` as the wire would, entering the outcome in `result`;
        False (and nothing entered) when `j` refused it as not yet due and this is not the
        last try."""
        target = self._hub.lookup(j)
        fault = self._hub.fault(self.rank, j)
        try:
            if target is None or fault is Fault.LOST:
                raise PeerUnreachableError("not on the hub" if target is None else "lost")
            notice = self.inbox.notice_for(j)
            result.bytes_sent[j] = target.receive(
                Envelope(self.rank, round, phase, outgoing[j], schedule_epoch, notice=notice)
            )
            if fault is Fault.ACK_LOST:
                raise PeerUnreachableError("acknowledgement lost")
            result.send_seconds[j] = time.monotonic() - start
        except EnvelopeRejected as rejected:
            if rejected.code is RejectCode.ABORTED and not last_try:
                return False
            result.failed[j] = f"push refused: {rejected.code.value}: {rejected}"
        except PeerUnreachableError as error:
            result.failed[j] = f"push failed: {error}"
        if j in result.failed:  # it has moved on or gone: do not wait for its envelope
            self.inbox.mailbox.abandon(round, phase, j)
        return True

    def _push_when_due(
        self,
        waiting: list[int],
        round: int,
        phase: str,
        outgoing: Outgoing,
        schedule_epoch: int,
        start: float,
        deadline: float,
        result: ExchangeResult,
    ) -> None:
        """Push again to each of `waiting` after each pause until it is taken or refused for
        good; at the deadline, a last try enters the refusal."""
        for pause in pauses_until(deadline):
            time.sleep(pause)
            waiting = [
                j
                for j in waiting
                if not self._push(j, round, phase, outgoing, schedule_epoch, start, result)
            ]
            if not waiting:
                return
        for j in waiting:
            self._push(j, round, phase, outgoing, schedule_epoch, start, result, last_try=True)

    def close(self) -> None:
        self.inbox.mailbox.shut()  # a thread waiting in exchange() goes on at once
        self._hub.unregister(self.rank)
