"""Levels that broadcasting peers (Choco-SGD, DEF-ATC) set for themselves, without a coordinator.

A broadcasting peer compresses one payload per step for all its neighbours, so its level is its
own, not a link's: each peer decides the level it sends at (the highest whose transfers fit the
round budget over its slowest live link, with the rate controller of levels/rate.py fed by its
own sends) and announces (level, effective round `NOTICE_LEAD` ahead) in every envelope it sends
until that round. Every neighbour takes it in and decodes that peer at the new level from that
round on; the sender switches there too. The end that sends decides: nobody else's links enter
the decision, so no peer needs to see links it is not on.

The lead is the one of levels/edges.py and for the same reason: a notice heard two rounds
before its round is in time, and a neighbour that did not hear it by then had its exchange with
the sender fail, so the edge is down at that neighbour. Unlike a link level, a sender's level
cannot go back to a default when one edge resumes (its other neighbours decode it at its level),
so the resume tells it instead: at the resume round each end's resume envelope states the level
it sends at in that round (a notice whose round is the envelope's own), and a second, empty
exchange carries each end's waiting notice and makes sure both ends have taken the levels in
before either sends the round's gossip (levels/peer.py). So a lost notice never leaves two ends of an
edge that carries gossip disagreeing on what either sends.

`SenderLevels` keeps one peer's view (its own level and each neighbour's, with the changes
announced and not yet in force); `OwnLevelControl` decides the own level. Pure bookkeeping: no
clock, no networking.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gossipcomp.inputs.text import quoted
from gossipcomp.levels.edges import (
    MIN_SENDS,
    NOTICE_LEAD,
    LocalRateControl,
    NoticeConflict,
    checked_level_rows,
    take_notice,
)
from gossipcomp.levels.rate import LevelCosts, link
from gossipcomp.schedule.costs import TransferLog
from gossipcomp.transport.base import LevelNotice


class SenderLevels:
    """The level this peer and each neighbour broadcast at, and at most one announced change
    per peer waiting for its round."""

    def __init__(self, rank: int, neighbours: Collection[int], default: int) -> None:
        self.rank = rank
        self.neighbours = frozenset(neighbours)
        self.default = default
        self._levels: dict[int, int] = {p: default for p in (rank, *self.neighbours)}
        self._waiting: dict[int, LevelNotice] = {}

    @property
    def in_force(self) -> dict[int, int]:
        """Peer (this one and each neighbour) -> the level it sends at now."""
        return dict(self._levels)

    @property
    def own(self) -> int:
        return self._levels[self.rank]

    @property
    def own_notice(self) -> LevelNotice | None:
        """This peer's announced change, not yet in force: what its envelopes carry."""
        return self._waiting.get(self.rank)

    def waiting(self) -> dict[int, LevelNotice]:
        """Neighbour -> the change it announced, not yet in force."""
        return {j: n for j, n in self._waiting.items() if j != self.rank}

    def decide(self, level: int, round: int) -> LevelNotice:
        """This peer changes its own level to `level`: the notice it announces, in force
        `NOTICE_LEAD` rounds after `round`."""
        if self.rank in self._waiting:
            raise ValueError(f"peer {self.rank}: a notice of its own level already waits")
        notice = LevelNotice(level, round + NOTICE_LEAD)
        self._waiting[self.rank] = notice
        return notice

    def hear(self, neighbour: int, notice: LevelNotice, round: int) -> bool:
        """Take in a neighbour's notice of its own level (checked at receipt:
        levels/notices.py) during `round`; True when it is new. NoticeConflict when
        another change from it still waits, or the notice's round has passed."""
        if neighbour not in self.neighbours:
            raise NoticeConflict(f"peer {self.rank}: level notice from non-neighbour {neighbour}")
        return take_notice(self._waiting, self.rank, neighbour, notice, round)

    def due(self, round: int) -> dict[int, int]:
        """Put in force the changes whose round has come (a peer that jumped rounds takes
        those it passed); return them, peer -> level."""
        changes = {p: n.level for p, n in self._waiting.items() if n.effective_round <= round}
        for p, level in changes.items():
            del self._waiting[p]
            self._levels[p] = level
        return changes

    def resync(self, neighbour: int, level: int) -> bool:
        """A resuming neighbour sends at `level` now (its resume envelope said so): that
        level in force, any change heard from it before forgotten (its waiting one comes
        again). True when the level in force changed."""
        self._waiting.pop(neighbour, None)
        changed = self._levels[neighbour] != level
        self._levels[neighbour] = level
        return changed

    def state_dict(self) -> dict[str, Any]:
        return {
            "levels": [[p, level] for p, level in sorted(self._levels.items())],
            "waiting": [[p, n.level, n.effective_round] for p, n in sorted(self._waiting.items())],
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore what `state_dict` returned; ValueError naming the part (nothing changed)
        when malformed, naming a peer outside this neighbourhood, or out of range."""
        if not isinstance(state, Mapping) or set(state) != {"levels", "waiting"}:
            raise ValueError("broadcast levels: expected keys ['levels', 'waiting']")
        levels = {p: level for p, level in self._rows(state["levels"], "levels", 2)}
        if set(levels) != set(self._levels):
            raise ValueError(
                f"broadcast levels: expected a level for each of peers {sorted(self._levels)}, "
                f"got {quoted(sorted(levels))}"
            )
        waiting = {
            p: LevelNotice(level, effective)
            for p, level, effective in self._rows(state["waiting"], "waiting", 3)
        }
        self._levels, self._waiting = levels, waiting

    def _rows(self, rows: Any, what: str, width: int) -> list[list[int]]:
        peers = sorted(self._levels)
        return checked_level_rows(
            rows, f"broadcast levels {what}", width, peers, ("peer", f"peers of {peers}")
        )


class OwnLevelControl:
    """Decides a broadcasting peer's own level from its sends over its live links, with the
    rate controller of levels/rate.py: each link is estimated from its own sends, and the
    peer's payload is priced at the slowest estimate (its latency and its seconds per byte
    each the largest among the links), so what it sends fits its slowest link. One decision
    per peer, so the controller's patience counts one proposal stream, not one per link.
    Never while its own notice waits."""

    def __init__(
        self, costs: LevelCosts, budget_s: float | None = None, *, follow_loss: bool = True
    ) -> None:
        """`budget_s`: seconds a round's transfers over one link may take; None: this peer's
        median compute time per round (as LocalRateControl measures it). `follow_loss`: no
        level above what the fall of this peer's training loss allows (as there)."""
        self.local = LocalRateControl(costs, budget_s, follow_loss=follow_loss)
        self._decided = False  # the first decision jumps, as an edge's does (levels/edges.py)

    def note_compute(self, seconds: float) -> None:
        self.local.note_compute(seconds)

    def note_loss(self, initial: float, recent: float) -> None:
        self.local.note_loss(initial, recent)

    def decide(
        self, levels: SenderLevels, live: Collection[int], sends: TransferLog, round: int
    ) -> LevelNotice | None:
        """The notice announcing a new own level, or None: no live link, a link without
        `MIN_SENDS` timed sends yet, no budget yet, a notice waiting, or no change."""
        budget = self.local.budget()
        samples = [sends.samples(j) for j in sorted(live)]
        if (
            budget is None
            or not samples
            or levels.own_notice is not None
            or any(len(s) < MIN_SENDS for s in samples)
        ):
            return None
        # every link as one "direction" of the peer's own key: the slowest one counts; the
        # first decision jumps to the level that fits (no current level for the controller)
        key, current = link(levels.rank, levels.rank), levels.own
        known = {key: current if self._decided else None}
        chosen = self.local.choose_all(known, {key: samples}, budget).get(key)
        self._decided = True
        return None if chosen is None or chosen == current else levels.decide(chosen, round)
