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
with a working edge (up, and an exchange tried on it) that is only a few rounds behind
(`WAITED_GAP`) does not move: the other end waits for it at the resume round instead. A peer
that is *alone* (no edge up or agreed) says so in its handshakes; its round is not followed,
and if it ran past the resume round it moves back instead.

A neighbour's word about rounds is bounded (`RoundPace`, `plausible_round`): a claimed round is
believed only up to where that neighbour could really be, i.e. the round at which this peer and it
were last in step plus what `SPEED_ALLOWANCE` times this peer's fastest measured round allows in
the time since, plus the margin; a jump needs the agreement of two neighbours when two or more
claim to be ahead (the lower of the two highest claims is followed), and never goes back except
for a peer that is alone; a proposed resume round is at most `MAX_RESUME_MARGIN` past the
proposer's (bounded) round. So one lying neighbour can neither throw a peer far ahead nor cut
an edge for good.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field

from gossipcomp.inputs.numbers import checked_number
from gossipcomp.transport.base import HelloAnswer
from gossipcomp.transport.claims import (
    DEFAULT_ROUND_SECONDS,
    agreed_round,
    furthest_round,
    quorum_of,
)

log = logging.getLogger("gossipcomp.links")  # the name it had before it moved here

RESUME_MARGIN = 5  # rounds between agreeing on a resume round and using it
MAX_RESUME_MARGIN = 640  # the margin doubles each time an answer came too late to be used
PACE_WINDOW = 64  # recent in-step rounds whose fastest sets the pace
# a peer with a working edge that is at most this many rounds behind a resuming neighbour does not
# jump: at the resume round the neighbour's exchange waits for it (its envelope for that round
# is let in however far ahead), as a partner's does every round. A jump takes every live edge
# down, and on a graph that changes every round, where peers that are not partners are
# legitimately a few rounds apart, those edges' own resumes set off jumps in turn: hundreds of
# jumps per kill in the churn soak (docs/benchmarks.md, "Churn").
WAITED_GAP = RESUME_MARGIN


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
    # resume round offered to a restarted neighbour while the edge still exchanged here: taken
    # up if an exchange on it fails before then, dropped once one succeeds at or after it
    offered: int | None = None
    probe: Future[HelloAnswer] | None = None
    in_step_round: int = 0  # the last round both ends completed together ...
    in_step_at: float = 0.0  # ... and when (monotonic seconds)
    used: bool = False  # an exchange on the edge has been tried (succeeded or failed)


@dataclass
class RoundPace:
    """How fast this peer goes through rounds in step with its neighbours: the fastest of its
    recent rounds that had at least one live edge. It bounds how far a neighbour can have run
    in a given time, so a claimed round beyond that is not believed.

    `floor` is used until a round is measured (or a checkpoint says how fast the peer went)."""

    floor: float = DEFAULT_ROUND_SECONDS
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=PACE_WINDOW))
    _prior: float | None = None

    def __post_init__(self) -> None:
        checked_number("round pace floor (seconds)", self.floor, 0.0, closed_low=False)

    def record(self, seconds: float) -> None:
        """One round completed in step with a neighbour took `seconds`."""
        if math.isfinite(seconds) and seconds > 0:
            self._recent.append(seconds)

    def assume(self, seconds: float) -> None:
        """What a checkpoint recorded, used until this run measures its own rounds."""
        if math.isfinite(seconds) and seconds > 0:
            self._prior = seconds

    def seconds_per_round(self) -> float:
        if self._recent:
            return min(self._recent)
        return self._prior if self._prior is not None else self.floor


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
        pace: RoundPace | None = None,
        newest_epoch: Callable[[], int] = lambda: 0,
        on_newer_epoch: Callable[[int], None] = lambda neighbour: None,
        may_probe: Callable[[int], bool] = lambda neighbour: True,
    ) -> None:
        """`on_resume(neighbour, round)` is called (under the lock, with the final round)
        whenever an edge is agreed to resume at a round: the peer lets that neighbour's
        envelopes for it in, however far ahead. `pace`: how fast this peer goes through rounds
        (see `plausible_round`). `newest_epoch`: the newest schedule epoch the peer has; a
        probe answered by a neighbour with a newer one counts as unanswered (the edge resumes
        once this peer has that schedule too), and `on_newer_epoch(neighbour)` is called so
        the peer can fetch it from that neighbour. `may_probe(neighbour)`: whether a lost edge
        to it is probed now (live membership: only between members, peer/membership.py)."""
        self.rank = rank
        self._on_resume = on_resume
        self._newest_epoch = newest_epoch
        self._on_newer_epoch = on_newer_epoch
        self._may_probe = may_probe
        self.backoff = backoff or Backoff()
        self.pace = pace or RoundPace()
        self._clock = clock
        now = clock()
        self._links = {j: _Link(in_step_at=now) for j in sorted(neighbours)}
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

    def in_step(self, neighbours: Collection[int], round: int) -> None:
        """`neighbours` completed `round` together with this peer (their exchange succeeded):
        the reference from which `plausible_round` counts."""
        now = self._clock()
        with self._lock:
            for j in neighbours:
                link = self._links[j]
                link.in_step_round, link.in_step_at = round, now
                link.used = True
                if link.offered is not None and round >= link.offered:
                    link.offered = None  # exchanged past it: the claim was not the neighbour's

    def restored(self, round: int, age: float) -> None:
        """This peer was restored from a checkpoint of `round` written `age` seconds ago: that
        is the last time it can have been in step with any neighbour."""
        at = self._clock() - max(0.0, age)
        with self._lock:
            for link in self._links.values():
                link.in_step_round, link.in_step_at = round, at

    def plausible_round(self, neighbour: int) -> int:
        """The furthest round `neighbour` can really have reached: the round at which both
        were last in step, plus what `SPEED_ALLOWANCE` times this peer's fastest round allows in
        the time since, plus the resume margin. Claims beyond it are not believed."""
        with self._lock:
            return self._plausible(self._links[neighbour])

    def _plausible(self, link: _Link) -> int:
        elapsed = self._clock() - link.in_step_at
        return furthest_round(
            link.in_step_round, elapsed, self.pace.seconds_per_round(), RESUME_MARGIN
        )

    def _believed(
        self, link: _Link, their_round: int, proposed: int, alone: bool
    ) -> tuple[int, int]:
        """A neighbour's claimed round as far as it can be believed, and the margin of its
        proposed resume round (0 for no proposal). The round is at most `plausible_round`
        and, unless it says it is alone (restored from a checkpoint), not behind the round both
        were last in step at, which it has passed; the margin is capped at
        `MAX_RESUME_MARGIN`. The caller holds the lock."""
        believed = min(their_round, self._plausible(link))
        if not alone:
            believed = max(believed, link.in_step_round)
        margin = (
            min(MAX_RESUME_MARGIN, max(RESUME_MARGIN, proposed - their_round)) if proposed else 0
        )
        return believed, margin

    def catch_up_round(self, round: int) -> int | None:
        """The round to move to when rounds disagree with neighbours this peer resumes with.

        Forward only, to the round a resuming neighbour had when they agreed (a neighbour that
        is alone follows this peer instead), already bounded by `plausible_round`; when two or
        more neighbours claim to be ahead, the lower of the two highest claims, so one liar
        cannot move the peer alone; never to or past the first agreed resume round; and, for a
        peer with a working edge (up, and an exchange tried on it), only when more than
        `WAITED_GAP` rounds ahead. Back only
        for a peer with no live edge that has run past a resume round (isolated, it ran ahead
        alone): to that round minus the margin. None when no move is needed."""
        with self._lock:
            resuming = [link for link in self._links.values() if link.state is LinkState.RESUMING]
            free = all(link.state is not LinkState.UP for link in self._links.values())
            # an edge that has carried an exchange: one never tried (a joiner's, before its
            # admission) keeps nobody's round, and a peer holding only such edges still jumps
            working = any(link.state is LinkState.UP and link.used for link in self._links.values())
        if not resuming:
            return None
        first_resume = min(link.resume_round for link in resuming)
        ahead = sorted(
            (link.their_round for link in resuming if link.their_round is not None),
            reverse=True,
        )
        ahead = [r for r in ahead if r > round]
        if ahead:
            agreed = agreed_round(ahead, quorum_of(len(ahead)))
            assert agreed is not None
            target = min(agreed, first_resume - 1)
            if working and target - round <= WAITED_GAP:
                return None  # the resume's wait closes the gap; a jump would drop live edges
            return target if target > round else None
        if free and round > first_resume:
            return max(0, first_resume - RESUME_MARGIN)
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
            link = self._links[neighbour]
            link.used = True
            if link.state is LinkState.UP:
                offered, link.offered = link.offered, None
                if offered is not None and offered > round:  # it did restart: resume as offered
                    log.warning(
                        "peer %d: neighbour %d lost at round %d (%s); resumes at round %d as "
                        "offered",
                        self.rank,
                        neighbour,
                        round,
                        reason,
                        offered,
                    )
                    self._adopt(neighbour, offered, None)
                else:
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
        already at or past it and cannot go back): the caller asks again with a larger margin.
        An answer whose resume round lies beyond what that neighbour can plausibly reach plus
        the largest margin is not adopted (False, and the edge stays down); its claimed round
        is believed only up to `plausible_round`."""
        with self._lock:
            link = self._links[neighbour]
            plausible = self._plausible(link)
            lowest, highest = link.in_step_round + 1, plausible + MAX_RESUME_MARGIN
            if not lowest <= answer.resume_round <= highest:
                log.warning(
                    "peer %d: neighbour %d answered resume round %d, outside the [%d, %d] it "
                    "can plausibly reach; not adopted",
                    self.rank,
                    neighbour,
                    answer.resume_round,
                    lowest,
                    highest,
                )
                return False
            if answer.resume_round <= round and not alone:
                return False
            believed, _ = self._believed(link, answer.round, 0, answer.alone)
            their_round = None if answer.alone else believed
            self._adopt(neighbour, answer.resume_round, their_round)
            return True

    def would_park(self, sender: int, sender_round: int, proposed: int, round: int) -> bool:
        """Whether answering this handshake would take down an edge that is up at this end
        (its last exchange succeeded). A running peer does not follow such a claim: one packet
        (a forged Hello) could otherwise park a working edge for hundreds of rounds and move
        this peer's round. A neighbour that really lost the edge stops exchanging on it, so
        this end's next exchange fails, the edge goes down here, and the neighbour's next
        handshake is answered: the claim is confirmed on the edge's own connection (one that
        says it is alone, restarted, is answered at once: `offer_resume`). An edge no exchange
        has been tried on yet is not working: on a time-varying topology a peer's rounds go
        on with its other partners while a neighbour is still starting, and that neighbour's
        handshake, at an earlier round, agrees a resume round as after any restart."""
        with self._lock:
            link = self._links[sender]
            in_step = proposed == 0 and sender_round == round
            return link.state is LinkState.UP and link.used and not in_step

    def offer_resume(self, sender: int, round: int) -> HelloAnswer:
        """Answer a neighbour that says it is alone (restarted) on an edge that still exchanges
        here, without taking the edge down: it is offered round + RESUME_MARGIN, which this end
        takes up only if an exchange on the edge fails before then (the neighbour really
        restarted, so it no longer exchanges at this peer's rounds). While exchanges succeed the
        offer is dropped: a forged claim costs nothing."""
        with self._lock:
            link = self._links[sender]
            link.offered = round + RESUME_MARGIN
            self._on_resume(sender, link.offered)
            anchored = self._anchored()
        return HelloAnswer(round, round + RESUME_MARGIN, alone=not anchored)

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
            link.offered = None
            sender_round, proposed_margin = self._believed(
                link, sender_round, proposed, sender_alone
            )
            anchored = self._anchored()
            # the sender's margin (grown after failed attempts) when it proposes one
            margin = proposed_margin or RESUME_MARGIN
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
            elif finished.result().schedule_epoch > self._newest_epoch():
                self._on_newer_epoch(j)  # fetched meanwhile: probe again after the first delay
                with self._lock:
                    self._links[j].retry_at = now + self.backoff.first
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
            if not self._may_probe(j):
                continue
            future = probe(j, round, proposed, alone)
            with self._lock:
                self._links[j].probe = future

    def _probe_unanswered(self, neighbour: int) -> None:
        with self._lock:
            link = self._links[neighbour]
            link.backoff = min(self.backoff.longest, 2 * link.backoff)
            link.retry_at = self._clock() + link.backoff
