"""Which neighbours a peer gossips with this round, and how lost ones come back.

A neighbour whose exchange failed is *down*: the peer leaves it out of its rounds at once (no
more waiting a full deadline every round) and its mixing weight stays with the peer itself, which
keeps the live mixing matrix symmetric and doubly stochastic. The lower-ranked end of a lost edge
probes the other with a handshake, with exponential backoff; a peer restarted from a checkpoint
asks every neighbour at start. The two ends of an answered probe agree on a *resume round* R
(the round of the end that is not alone, plus a margin, or a later one already agreed), and at
round R both resynchronise the edge's state (the algorithm's resume phase) before gossiping on it
again. So an edge is used only when both ends put it back at the same round.

Rounds drift apart while an edge is down (a restarted peer starts from its checkpoint's round;
the two sides of a partition run at their own pace; an isolated peer runs ahead alone). The end
that is behind moves forward to the round the other end had when they agreed
(`catch_up_round`): its other edges then see rounds out of step, fail once, and resume the same
way, so the catch-up spreads, level and never overshooting, until rounds line up again. A peer
that is *alone* (no edge up or agreed) says so in its handshakes; its round is not followed,
and if it ran past the resume round it moves back instead.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass

from gossipcomp.transport.base import HelloAnswer

log = logging.getLogger(__name__)

RESUME_MARGIN = 5  # rounds between agreeing on a resume round and using it
MAX_RESUME_MARGIN = 640  # the margin doubles each time an answer came too late to be used


class LinkState(enum.Enum):
    UP = "up"
    DOWN = "down"
    RESUMING = "resuming"  # both ends agreed to resume at `resume_round`


@dataclass
class _Link:
    state: LinkState = LinkState.UP
    resume_round: int = 0
    retry_at: float = 0.0  # monotonic time of the next probe (DOWN, probing end only)
    backoff: float = 0.0
    margin: int = RESUME_MARGIN  # rounds ahead this end proposes to resume
    their_round: int | None = None  # the other end's round at agreement, if it is to be followed
    probe: Future[HelloAnswer] | None = None


@dataclass(frozen=True)
class Backoff:
    """Delays between probes of a lost neighbour: first, doubling up to `longest` (seconds)."""

    first: float = 0.25
    longest: float = 4.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.longest:
            raise ValueError(
                f"backoff needs 0 < first <= longest, got {self.first}, {self.longest}"
            )


class LinkMonitor:
    """Liveness of one peer's edges: up, down (probed with backoff), or resuming at a round.

    Thread-safe: `answer_hello` runs on the server's threads, everything else on the peer's.
    Transitions the peer's thread makes after a long call (an exchange) are compare-and-set:
    they apply only if no handshake changed the edge meanwhile.
    """

    def __init__(
        self,
        rank: int,
        neighbours: Collection[int],
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_resume: Callable[[int, int], None] = lambda neighbour, round: None,
    ) -> None:
        """`on_resume(neighbour, round)` is called (under the lock, with the final round)
        whenever an edge is agreed to resume at a round: the peer lets that neighbour's
        envelopes for it in, however far ahead."""
        self.rank = rank
        self._on_resume = on_resume
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._links = {j: _Link() for j in sorted(neighbours)}
        self._lock = threading.Lock()

    def state(self, neighbour: int) -> LinkState:
        with self._lock:
            return self._links[neighbour].state

    def live(self) -> list[int]:
        """Neighbours to gossip with this round."""
        with self._lock:
            return [j for j, link in self._links.items() if link.state is LinkState.UP]

    def not_up(self) -> list[int]:
        """Neighbours whose edge is down or resuming (a checkpoint records them)."""
        with self._lock:
            return [j for j, link in self._links.items() if link.state is not LinkState.UP]

    def resuming_at(self, round: int) -> list[int]:
        """Neighbours whose edge resumes at `round`; a resume round already missed (the peer is
        past it) counts as a failure, so the edge is probed again."""
        due = []
        with self._lock:
            for j, link in self._links.items():
                if link.state is LinkState.RESUMING:
                    if link.resume_round == round:
                        due.append(j)
                    elif link.resume_round < round:
                        self._down(j, round, "resume round passed before it was reached")
        return due

    def anchored(self) -> bool:
        """Some edge is up or agreed to resume: this peer's round matters to a neighbour, so a
        neighbour it greets must follow it rather than the other way round."""
        with self._lock:
            return self._anchored()

    def _anchored(self) -> bool:
        return any(link.state is not LinkState.DOWN for link in self._links.values())

    def catch_up_round(self, round: int) -> int | None:
        """The round to move to when rounds disagree with a neighbour this peer resumes with:
        that neighbour's round when they agreed (when it has live edges of its own; otherwise it
        follows this peer). Forward when this peer is behind it (restarted, or on the slower
        side of a healed partition), never to or past a resume round; back only for a peer with
        no live edge that has run past a resume round (isolated, it ran ahead alone). None when
        no move is needed."""
        with self._lock:
            resuming = [link for link in self._links.values() if link.state is LinkState.RESUMING]
            free = all(link.state is not LinkState.UP for link in self._links.values())
        if not resuming:
            return None
        first_resume = min(link.resume_round for link in resuming)
        followed = [link.their_round for link in resuming if link.their_round is not None]
        if followed and max(followed) > round:
            return min(max(followed), first_resume - 1)
        if free and round > first_resume:
            return first_resume - RESUME_MARGIN
        return None

    def up(self, neighbour: int, resume_round: int) -> bool:
        """The edge resumed at `resume_round`: gossip on it again. False (and nothing changes)
        if a handshake agreed another round meanwhile."""
        with self._lock:
            link = self._links[neighbour]
            if link.state is not LinkState.RESUMING or link.resume_round != resume_round:
                return False
            link.state, link.margin = LinkState.UP, RESUME_MARGIN
            return True

    def failed(self, neighbour: int, round: int, reason: str) -> None:
        """An exchange on an up edge failed: leave the neighbour out from now on and probe it
        later (the first probe after `backoff.first` seconds; each unanswered one doubles the
        wait). An edge a handshake put back meanwhile keeps its agreed resume round."""
        with self._lock:
            if self._links[neighbour].state is LinkState.UP:
                self._down(neighbour, round, reason)

    def resume_failed(self, neighbour: int, resume_round: int, reason: str) -> None:
        """The resume exchange at `resume_round` failed: down again, unless a handshake agreed
        a later round meanwhile."""
        with self._lock:
            link = self._links[neighbour]
            if link.state is LinkState.RESUMING and link.resume_round == resume_round:
                self._down(neighbour, resume_round, reason)
                link.margin = min(MAX_RESUME_MARGIN, 2 * link.margin)  # more time next try

    def mark_down(self, neighbour: int, round: int, reason: str) -> None:
        """Take the edge down whatever its state (restored as down from a checkpoint)."""
        with self._lock:
            self._down(neighbour, round, reason)

    def _down(self, neighbour: int, round: int, reason: str) -> None:
        link = self._links[neighbour]  # the caller holds the lock
        if link.state is LinkState.DOWN:
            return
        log.warning(
            "peer %d: neighbour %d down at round %d (%s)", self.rank, neighbour, round, reason
        )
        link.state, link.backoff = LinkState.DOWN, self.backoff.first
        link.retry_at = self._clock() + link.backoff

    def _adopt(self, neighbour: int, resume_round: int, their_round: int | None) -> int:
        """Agree to resume at `resume_round` or a later round already agreed; return it.
        `their_round`: the neighbour's round, when this peer is to catch up with it. The caller
        holds the lock."""
        link = self._links[neighbour]
        if link.state is LinkState.RESUMING:
            resume_round = max(resume_round, link.resume_round)
        link.state, link.resume_round, link.backoff = LinkState.RESUMING, resume_round, 0.0
        link.their_round = their_round
        self._on_resume(neighbour, resume_round)
        return resume_round

    def resume(self, neighbour: int, answer: HelloAnswer, round: int, alone: bool) -> bool:
        """Adopt the resume round a neighbour answered (`alone`: this peer asked as one with no
        live edge, so it may move back to meet it). False if it came too late (this peer is
        already at or past it and cannot go back): the caller asks again with a larger margin."""
        with self._lock:
            if answer.resume_round <= round and not alone:
                return False
            their_round = None if answer.alone else answer.round
            self._adopt(neighbour, answer.resume_round, their_round)
            return True

    def answer_hello(
        self, sender: int, sender_round: int, proposed: int, sender_alone: bool, round: int
    ) -> HelloAnswer:
        """Answer a neighbour's handshake.

        A (re)start (nothing proposed) at our own round, on an edge that was up at both ends,
        needs no resynchronisation: both ends hold the edge's state as of the same round (a
        fresh start at round 0, or a whole network restored from checkpoints of the same round).
        Otherwise the edge resumes at the round of the end that has live edges (the other will
        adopt it) plus the margin, or the sender's proposal if later; both ends with live edges:
        the later of their rounds; any resume round already agreed and still ahead is kept."""
        with self._lock:
            link = self._links[sender]
            if proposed == 0 and sender_round == round and link.state is LinkState.UP:
                return HelloAnswer(round, 0)
            anchored = self._anchored()
            # the sender's margin (grown after failed attempts) when it proposes one
            margin = max(RESUME_MARGIN, proposed - sender_round) if proposed else RESUME_MARGIN
            bases = [round + margin] if anchored else []
            if not sender_alone:
                bases.append(sender_round + margin)
            wanted = max(bases or [max(round, sender_round) + margin])
            if link.state is not LinkState.RESUMING or link.resume_round <= round:
                link.state = LinkState.DOWN  # any earlier agreement is void: start afresh
            resume_round = self._adopt(sender, wanted, None if sender_alone else sender_round)
        log.warning(
            "peer %d: neighbour %d (round %d%s) rejoins at round %d",
            self.rank,
            sender,
            sender_round,
            ", alone" if sender_alone else "",
            resume_round,
        )
        return HelloAnswer(round, resume_round, alone=not anchored)

    def poll_probes(
        self, round: int, probe: Callable[[int, int, int, bool], Future[HelloAnswer]]
    ) -> None:
        """Collect answered probes and send due ones. Only the lower-ranked end of an edge
        probes, so the two ends never race to agree on different resume rounds. An answer that
        comes too late to be used is asked again at once, with twice the margin; the margin also
        doubles after each failed resume exchange, and the answering end honours it, so the
        agreement leaves enough rounds for slow handshakes."""
        now = self._clock()
        answered: list[tuple[int, Future[HelloAnswer]]] = []
        with self._lock:
            for j, link in self._links.items():
                if link.probe is not None and link.probe.done():
                    answered.append((j, link.probe))
                    link.probe = None
        alone = not self.anchored()
        for j, finished in answered:
            if finished.exception() is not None:
                self._probe_unanswered(j)
            elif not self.resume(j, finished.result(), round, alone):
                with self._lock:
                    link = self._links[j]
                    link.margin = min(MAX_RESUME_MARGIN, 2 * link.margin)
                    link.retry_at = now
        to_send: list[tuple[int, int]] = []
        with self._lock:
            for j, link in self._links.items():
                due = link.state is LinkState.DOWN and now >= link.retry_at
                if due and link.probe is None and self.rank < j:
                    to_send.append((j, round + link.margin))
        for j, proposed in to_send:
            future = probe(j, round, proposed, alone)
            with self._lock:
                self._links[j].probe = future

    def _probe_unanswered(self, neighbour: int) -> None:
        with self._lock:
            link = self._links[neighbour]
            link.backoff = min(self.backoff.longest, 2 * link.backoff)
            link.retry_at = self._clock() + link.backoff
