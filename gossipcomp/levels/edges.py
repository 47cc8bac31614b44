"""Link levels that peers set among themselves, without a coordinator.

The lower-ranked end of each edge decides the edge's level: its own rate controller
(levels/rate.py) estimates the link from this peer's sends over it and picks the highest
level whose transfers fit the round budget (given, or this peer's median compute time per
round; or, when longer, the slowest of this peer's links at the lowest level: its round waits
for that one, so the others may fill the time, as under a coordinator). A decision becomes a
notice (level, effective round `NOTICE_LEAD` rounds ahead) that the lower end carries in every
envelope it sends the other end until that round; both ends put the level in force at the top
of that round. While a notice waits, that edge gets no new one.

Why the lead suffices: the higher end takes a notice in after the exchange that brought it, and
must have done so before the lower end's first envelope of the effective round R arrives (its
spec changes there). That envelope leaves only after the lower end finished round R - 1, which
needed the higher end's envelope of R - 1, sent after it finished R - 2. So a notice heard by
round R - 2 is in time, and with a lead of 4 the lower end sends it in at least three rounds
(R - 4 to R - 2). A round in which the higher end does not hear it is a round whose exchange
with the lower end failed: the edge is then down at that end (links.py) and comes back only
through a resume, at which both ends put the edge back at the algorithm's own level and forget
any waiting notice. Nothing on the wire is needed to agree then, so a lost notice can never
leave the two ends at different levels while the edge carries gossip.

An edge's first decision (and the first after a resume) jumps straight to the level that fits,
so it prices the link as if every second of its sends were bytes (no latency: levels/rate.py
`RateController.update`): the sends so far are few, at one level and start-up ones among them,
and a latency read from them could take a slow link for a fast one. This never overshoots;
later decisions climb one level at a time as usual, with the latency the edge's sizes show.

Levels follow the training loss here too, by default (levels/progress.py): the deciding end
caps its proposals at the rung its own loss's fall allows (`note_loss`), its own word only, so
nothing a neighbour sends moves it.

`EdgeLevels` keeps one peer's levels and waiting notices; `LocalRateControl` makes the lower
end's decisions. Pure bookkeeping: no clock, no networking.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from gossipcomp.inputs.numbers import checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.progress import MAX_LOSS, LossAllowance
from gossipcomp.levels.rate import (
    DEFAULT_WINDOW,
    MAX_LEVEL,
    LevelCosts,
    Link,
    RateController,
    link,
)
from gossipcomp.schedule.costs import TransferLog
from gossipcomp.schedule.schedule import MAX_ROUND
from gossipcomp.transport.base import LevelNotice

NOTICE_LEAD = 4  # rounds between a decision and the round both ends switch (module docstring)
MIN_SENDS = DEFAULT_WINDOW // 2  # sends over a link before its first decision
COMPUTE_WINDOW = 16  # recent rounds whose median compute time is the default budget
MIN_COMPUTE_ROUNDS = 3  # rounds timed before the default budget is believed


class NoticeConflict(ValueError):
    """A neighbour announced a change while another one it announced still waits."""


def take_notice(
    waiting: dict[int, LevelNotice], rank: int, neighbour: int, notice: LevelNotice, round: int
) -> bool:
    """Record `neighbour`'s `notice`, heard by peer `rank` during `round`, among the changes
    `waiting` for their round; True when it is new. NoticeConflict when its round has passed
    (it cannot be honoured as announced) or another change from that neighbour still waits."""
    if notice.effective_round <= round:
        raise NoticeConflict(
            f"peer {rank}: level notice from peer {neighbour} for round "
            f"{notice.effective_round}, heard in round {round}"
        )
    current = waiting.get(neighbour)
    if current == notice:
        return False
    if current is not None:
        raise NoticeConflict(
            f"peer {rank}: peer {neighbour} announced level {notice.level} from round "
            f"{notice.effective_round} while level {current.level} from round "
            f"{current.effective_round} still waits"
        )
    waiting[neighbour] = notice
    return True


class EdgeLevels:
    """One peer's link levels set with its neighbours: the level in force on each edge (absent:
    the algorithm's own) and at most one announced change per edge waiting for its round."""

    def __init__(self, rank: int, neighbours: Collection[int]) -> None:
        self.rank = rank
        self.neighbours = frozenset(neighbours)
        self._in_force: dict[int, int] = {}
        self._waiting: dict[int, LevelNotice] = {}

    @property
    def in_force(self) -> dict[int, int]:
        """Neighbour -> the level its edge uses now (edges at the algorithm's own level left
        out)."""
        return dict(self._in_force)

    def level(self, neighbour: int) -> int | None:
        return self._in_force.get(neighbour)

    def waiting(self) -> dict[int, LevelNotice]:
        """Neighbour -> the change announced for its edge, not yet in force."""
        return dict(self._waiting)

    def decide(self, neighbour: int, level: int, round: int) -> LevelNotice:
        """This peer, the lower-ranked end, changes the edge to `neighbour` to `level`: the
        notice it announces, in force `NOTICE_LEAD` rounds after `round`."""
        if neighbour not in self.neighbours or neighbour < self.rank:
            raise ValueError(
                f"peer {self.rank}: decides levels only for its edges to higher-ranked "
                f"neighbours, not for peer {neighbour}"
            )
        if neighbour in self._waiting:
            raise ValueError(f"peer {self.rank}: a notice for edge to {neighbour} already waits")
        notice = LevelNotice(level, round + NOTICE_LEAD)
        self._waiting[neighbour] = notice
        return notice

    def hear(self, neighbour: int, notice: LevelNotice, round: int) -> bool:
        """Take in a lower-ranked neighbour's notice (checked at receipt: levels/notices.py)
        during `round`; True when it is new. NoticeConflict when another change from it still
        waits, or the notice's round has passed (it cannot be honoured as announced)."""
        if neighbour not in self.neighbours or neighbour > self.rank:
            raise NoticeConflict(
                f"peer {self.rank}: level notice from peer {neighbour}, which is not a "
                "lower-ranked neighbour"
            )
        return take_notice(self._waiting, self.rank, neighbour, notice, round)

    def notice_for(self, neighbour: int) -> LevelNotice | None:
        """What this peer's envelopes to `neighbour` carry: its own waiting decision for that
        edge (only the lower-ranked end has any)."""
        return self._waiting.get(neighbour) if self.rank < neighbour else None

    def due(self, round: int) -> dict[int, int]:
        """Put in force the changes whose round has come (a peer that jumped rounds takes
        those it passed); return them, neighbour -> level."""
        changes = {j: n.level for j, n in self._waiting.items() if n.effective_round <= round}
        for j, level in changes.items():
            del self._waiting[j]
            self._in_force[j] = level
        return changes

    def reset(self, neighbour: int) -> bool:
        """The edge resumes: back to the algorithm's own level, any waiting notice forgotten
        (both ends do this at the resume round). True when the level in force changed."""
        self._waiting.pop(neighbour, None)
        return self._in_force.pop(neighbour, None) is not None

    def state_dict(self) -> dict[str, Any]:
        return {
            "in_force": [[j, level] for j, level in sorted(self._in_force.items())],
            "waiting": [[j, n.level, n.effective_round] for j, n in sorted(self._waiting.items())],
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore what `state_dict` returned; ValueError naming the part (nothing changed)
        when malformed, naming a peer that is not a neighbour, or out of range."""
        if not isinstance(state, Mapping) or set(state) != {"in_force", "waiting"}:
            raise ValueError("link levels: expected keys ['in_force', 'waiting']")
        in_force = {j: level for j, level in self._rows(state["in_force"], "in_force", 2)}
        waiting = {
            j: LevelNotice(level, effective)
            for j, level, effective in self._rows(state["waiting"], "waiting", 3)
        }
        self._in_force, self._waiting = in_force, waiting

    def _rows(self, rows: Any, what: str, width: int) -> list[list[int]]:
        return checked_level_rows(
            rows,
            f"link levels {what}",
            width,
            self.neighbours,
            ("neighbour", f"neighbours of peer {self.rank}"),
        )


def checked_level_rows(
    rows: Any, what: str, width: int, allowed: Collection[int], names: tuple[str, str]
) -> list[list[int]]:
    """Checkpoint rows [peer, level] (width 2) or [peer, level, round] (width 3), checked:
    at most one per peer of `allowed`, levels in [1, MAX_LEVEL], rounds in [1, MAX_ROUND].
    `names`: how errors call one peer and the peers allowed."""
    one, among = names
    if not isinstance(rows, list) or len(rows) > len(allowed):
        raise ValueError(f"{what}: expected a list of at most {len(allowed)} rows")
    highs = (MAX_LEVEL, MAX_ROUND)[: width - 1]
    seen: set[int] = set()
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != width
            or any(isinstance(x, bool) or not isinstance(x, int) for x in row)
            or row[0] not in allowed
            or row[0] in seen
            or not all(1 <= x <= high for x, high in zip(row[1:], highs, strict=True))
        ):
            raise ValueError(
                f"{what}: expected rows [{one}, level{', round' if width == 3 else ''}] with "
                f"distinct {among} and levels in [1, {MAX_LEVEL}], got {quoted(row)}"
            )
        seen.add(row[0])
    return rows


class LocalRateControl:
    """The rate controller of one peer for the edges where it is the lower-ranked end (module
    docstring): decides from this peer's own sends over all its live links at once (the
    slowest sets the floor of the budget), never for an edge while a notice for it waits."""

    def __init__(
        self, costs: LevelCosts, budget_s: float | None = None, *, follow_loss: bool = True
    ) -> None:
        """`budget_s`: seconds a round's transfers over one link may take; None: this peer's
        median compute time per round. `follow_loss`: no level above what the fall of this
        peer's training loss allows (`note_loss`; until a loss is noted, the budget alone)."""
        if budget_s is not None and not 0.0 < budget_s <= 86_400.0:
            raise ValueError(f"round budget: expected seconds in (0, 86400], got {budget_s}")
        self.costs = costs
        self.controller = RateController(costs)
        self.fixed_budget = budget_s
        self.allowance: LossAllowance | None = LossAllowance() if follow_loss else None
        self._compute: deque[float] = deque(maxlen=COMPUTE_WINDOW)

    def note_compute(self, seconds: float) -> None:
        """One round's local computation took `seconds`."""
        if seconds > 0.0:
            self._compute.append(seconds)

    def note_loss(self, initial: float, recent: float) -> None:
        """This peer's training loss: the untrained model's and the recent rounds' mean
        (levels/progress.py `LossWindow`); either 0 (not measured yet): nothing changes.
        Following the loss, ValueError naming the loss for one not finite or outside 0 to
        MAX_LOSS; not following it, nothing is read."""
        if self.allowance is None:
            return
        initial = checked_number("initial loss", initial, 0.0, MAX_LOSS)
        recent = checked_number("recent loss", recent, 0.0, MAX_LOSS)
        if initial > 0.0 and recent > 0.0:
            self.allowance.update([(initial, recent)], 1)

    def ceiling(self) -> int | None:
        """The highest level the loss allows; None: no cap (not following it, or no loss
        noted yet)."""
        if self.allowance is None or not self.allowance.measured:
            return None
        return self.allowance.highest(self.costs)

    def budget(self) -> float | None:
        """The round budget in force (None while the default one is not yet measured)."""
        if self.fixed_budget is not None:
            return self.fixed_budget
        if len(self._compute) < MIN_COMPUTE_ROUNDS:
            return None
        return statistics.median(self._compute)

    def choose_all(
        self,
        current: Mapping[Link, int | None],
        sends: Mapping[Link, Sequence[Sequence[tuple[int, float]]]],
        budget: float,
        floor_only: Collection[Link] = (),
    ) -> dict[Link, int]:
        """The level of each link of `sends` not in `floor_only`, from its `current` one
        (None: none yet) and its sends (each direction's): no higher than the loss's ceiling
        (a level above it from before, the algorithm's own at the start, comes down to it),
        a link the controller cannot estimate keeping its current level (left out when it has
        none). All of a peer's links in one call: its round waits for the slowest of them,
        so that one's time at the lowest level is the budget the others fill (levels/rate.py
        `round_budget`), as a coordinator's is; `floor_only` links count for that alone."""
        top = self.ceiling()
        known = {key: level for key, level in current.items() if level is not None}
        chosen = self.controller.update(known, sends, budget, top=top, floor_only=floor_only)
        return {
            key: level if top is None else min(level, top)
            for key, level in chosen.items()
            if key in sends and key not in floor_only
        }

    def decide(
        self, levels: EdgeLevels, live: Collection[int], sends: TransferLog, round: int
    ) -> dict[int, LevelNotice]:
        """Decisions for the live edges to higher-ranked neighbours without a waiting notice
        and with enough sends to estimate from: neighbour -> the notice announcing a new
        level (edges whose level stays are left out)."""
        budget = self.budget()
        if budget is None:
            return {}
        timed = {j: sends.samples(j) for j in sorted(live)}
        timed = {j: samples for j, samples in timed.items() if len(samples) >= MIN_SENDS}
        waiting = levels.waiting()
        not_decided = {j for j in timed if j < levels.rank or j in waiting}
        chosen = self.choose_all(
            {link(levels.rank, j): levels.level(j) for j in timed},
            {link(levels.rank, j): [samples] for j, samples in timed.items()},
            budget,
            floor_only={link(levels.rank, j) for j in not_decided},
        )
        notices = {}
        for j in timed:
            if j in not_decided:
                continue
            level = chosen.get(link(levels.rank, j))
            if level is not None and level != levels.level(j):
                notices[j] = levels.decide(j, level, round)
        return notices
