"""How a peer's edges come back (the peer's side of peer/links.py): its answers to neighbours'
handshakes, its own handshake at start, moving to a resuming neighbour's round when rounds
disagree, and resynchronising the edges that resume at an agreed round before they carry
gossip again."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from gossipcomp.gossip.base import RESUME_PHASE, GossipAlgorithm, NamedParams, Resumable
from gossipcomp.levels.peer import CompressionLevels
from gossipcomp.peer.failures import FailedRounds
from gossipcomp.peer.links import RESUME_MARGIN, LinkMonitor
from gossipcomp.peer.membership import PeerMembership
from gossipcomp.peer.schedules import PeerSchedules
from gossipcomp.topology import Topology
from gossipcomp.transport.base import (
    ExchangeResult,
    Greeting,
    HelloAnswer,
    Payload,
    PeerNotReady,
)
from gossipcomp.transport.protocol import Transport

log = logging.getLogger("gossipcomp.peer")  # its warnings are the peer's
Exchange = Callable[[str, list[int], Payload], ExchangeResult]


class Rejoin:
    """The edges of peer `rank` coming back: `links` says which are up, `schedules` is asked
    for the newer schedules a neighbour names, `failures` notes why a resume failed."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        transport: Transport,
        links: LinkMonitor,
        schedules: PeerSchedules,
        levels: CompressionLevels,
        algorithm: GossipAlgorithm,
        params: NamedParams,
        failures: FailedRounds,
        membership: PeerMembership,
    ) -> None:
        self.rank = rank
        self.topology = topology
        self.transport = transport
        self.links = links
        self.schedules = schedules
        self.levels = levels
        self.algorithm = algorithm
        self.params = params
        self.failures = failures
        self.membership = membership

    def answer_hello(
        self,
        sender: int,
        their_round: int,
        proposed: int,
        alone: bool,
        epoch: int,
        round: int,
        started: bool,
    ) -> HelloAnswer:
        """The answer to `sender`'s handshake, this peer being at `round` (`started`: its own
        handshake is done); PeerNotReady while the edge may not be agreed yet."""
        newest = self.schedules.book.newest.epoch
        refusal = self.membership.refusal(sender)
        if refusal is not None:  # live membership: edges only between members
            raise PeerNotReady(refusal)
        if epoch > newest:  # the edge resumes once this peer has that schedule too
            self.schedules.want(sender)  # asked at its own address: a forged claim costs that
            raise PeerNotReady(
                f"peer {self.rank} has schedules up to epoch {newest}, not yet epoch {epoch}"
            )
        if started and self.links.would_park(sender, their_round, proposed, round):
            if not alone:  # its round would be followed: wait for the edge itself to fail
                raise PeerNotReady(
                    f"peer {self.rank}: its edge to peer {sender} is up and exchanging; a "
                    "rejoin is agreed once an exchange on it fails"
                )
            answer = self.links.offer_resume(sender, round)  # taken up if it fails
            return dataclasses.replace(answer, schedule_epoch=newest)
        answer = self.links.answer_hello(sender, their_round, proposed, alone, round)
        return dataclasses.replace(answer, schedule_epoch=newest)

    def connect(self, round: int, timeout: float, addresses: dict[int, str] | None) -> None:
        """Handshake with every neighbour at `round` (see Peer.start): a neighbour in a newer
        schedule epoch is taken down until this peer has fetched it; one at another round
        agrees a resume round."""
        book = addresses or dict(enumerate(self.topology.addresses))
        neighbours = self.topology.neighbors(self.rank)
        greeted = self.membership.greeted(round, neighbours)  # None: every neighbour
        if greeted is not None:  # live: ranks not given (not started yet) from the file
            book = {**dict(enumerate(self.topology.addresses)), **book}
        for j in neighbours if greeted is not None else ():
            if j not in greeted:  # live membership: probed once both ends are members
                self.links.mark_down(j, round, "not greeted at start (live membership)")
        restored = round > 0 or greeted == frozenset()  # its round is stale: adopt theirs
        proposals = {j: round + RESUME_MARGIN for j in self.links.not_up()}
        answers = self.transport.connect(
            {j: book[j] for j in neighbours},
            timeout,
            Greeting(round, proposals, alone=restored, among=greeted),
        )
        for j, answer in answers.items():
            if answer.schedule_epoch > self.schedules.book.newest.epoch:
                self.schedules.want(j)
                self.links.mark_down(
                    j, round, f"runs schedule epoch {answer.schedule_epoch}, not yet here"
                )
            elif answer.resume_round > 0:
                self.links.resume(j, answer, round, alone=restored)

    def moved(self, before: int, target: int) -> None:
        """This peer moved from round `before` to `target`, a resuming neighbour's, as
        `links.catch_up_round` said (rounds disagreed: see links.py): forward when behind; back
        as well when it has no live edge (its round is its own). The new round is opened at
        once so that neighbour's envelopes are let in."""
        log.warning(
            "peer %d: %s its neighbours; moves from round %d to %d",
            self.rank,
            "behind" if target > before else "alone and ahead of",
            before,
            target,
        )
        if target < before:
            self.transport.inbox.rewind_round(target)
        else:
            self.transport.inbox.open_round(target)
        for j in self.links.live():  # now out of step: fail at once rather than wait a deadline
            self.links.failed(j, before, f"this peer moved to round {target}")

    def resume_edges(self, round: int, exchange: Exchange) -> bool:
        """Resynchronise the edges that resume at `round` (both ends agreed on it), so that the
        algorithm's per-edge state (public copies, references, power vectors) matches at both
        ends before the edge carries gossip again; `exchange` is the round's exchange. Returns
        whether any edge tried."""
        due = self.links.resuming_at(round)
        if not due:
            return False
        self.levels.before_resume(due, round)
        resumable = isinstance(self.algorithm, Resumable)
        payload = self.algorithm.resume_payload(self.params) if resumable else None
        # always exchanged, empty when there is nothing to resynchronise: an edge is back only
        # when both ends reached the resume round
        result = exchange(RESUME_PHASE, due, payload or ())
        unsynced = self.levels.after_resume(result, round, exchange)
        for j in due:
            if j in result.received and j not in result.failed and j not in unsynced:
                if resumable:
                    envelope = result.received[j] if payload is not None else None
                    self.algorithm.resume_edge(j, envelope, round)
                # if a handshake moved the resume round meanwhile, the edge stays resuming and
                # is resynchronised again then
                self.links.up(j, round)
            else:
                reason = result.failed.get(j) or unsynced.get(j, "no resume payload")
                self.links.resume_failed(j, round, reason)
                self.failures.failed(j, reason)
        return True

    def restored(
        self,
        round: int,
        down: list[int],
        saved_at: float | None,
        seconds_per_round: float | None,
    ) -> None:
        """This peer was restored from a checkpoint of `round`, written at `saved_at` with the
        pace `seconds_per_round`, when its edges to `down` were down: those are probed and
        resynchronised after the restart, like any lost edge."""
        for j in down:
            self.links.mark_down(j, round, "down when the checkpoint was written")
        # the checkpoint's round is the last one this peer can have been in step at
        self.links.restored(round, 0.0 if saved_at is None else time.time() - saved_at)
        if seconds_per_round is not None:
            self.links.pace.assume(seconds_per_round)
