"""Versioned schedules: which tensors travel merged, how each group is compressed, from when.

A `Schedule` is a plan with a version (`epoch`) and the round from which it holds
(`effective_round`): tensor groups with a compressor each, and a compression level per link
(levels/rate.py chooses them; a link it does not list keeps the algorithm's own level). Every peer applies the same schedule at the same round, so both ends of an
edge always lay out and decode envelopes alike; envelopes carry the epoch and a receiver uses
only those sent under the epoch it is in (transport/inbox.py).

`ScheduleBook` is one peer's view: the schedule in force and those staged for later rounds.
Staging checks a schedule completely (it covers every parameter exactly once, names only known
parameters and compressors, goes forward in epoch, and takes effect in the future) and refuses
it with a `ScheduleRefused` naming what is wrong, leaving the book unchanged: a schedule may
come from the network (the coordinator, or a neighbour that holds it), so it is hostile until
checked.

Nothing a schedule says can freeze a peer. It takes effect at most `SCHEDULE_HORIZON` rounds
after the peer's own round, so whatever is staged is in force, and out of the way, within that
many rounds. Its epoch is at most `EPOCH_ALLOWANCE` past the epoch in force plus the rounds
since that took effect, so no sender can use up the epochs (an honest coordinator publishes at
most about one a round). A newer epoch supersedes every staged schedule that would take effect
at or after its round: a restarted coordinator, whose epochs continue above the newest any peer
reports holding, is told apart by its epoch alone and replaces whatever its predecessor (or a
rogue) left staged.

Membership travels the same way (live membership, topology/members.py): a schedule may name the
ranks in the network from its effective round (`members`, sorted, each below the topology's
capacity), so who is in the network is versioned, bounded and checked before use by the very
mechanisms above; no second path carries it. A schedule naming none keeps the topology's own
(every rank of a fixed topology; the initial members of a live one). A schedule a neighbour
passes on may not change the members (peer/schedules.py): only the coordinator's do, so no
member can announce another's departure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gossipcomp.compress import parse_spec
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.rate import MAX_LEVEL
from gossipcomp.schedule.groups import TensorGroup, check_cover
from gossipcomp.transport.claims import lead_bound

MAX_EPOCH = 2**31 - 1  # epochs travel as int64 but are bounded like the envelope field
MAX_ROUND = 2**53 - 1  # rounds on the wire lie below 2^53
MAX_STAGED = 4  # schedules waiting for their round at one peer; more is refused
# rounds after a peer's own round within which a schedule must take effect: twice the
# coordinator's largest publication margin (coordinator.MAX_MARGIN), room for a peer behind
SCHEDULE_HORIZON = 20_000
EPOCH_ALLOWANCE = 64  # epochs a schedule may skip beyond one per round since the current one
MAX_GROUPS = 1 << 16  # groups in one schedule: far above any model's parameter count
MAX_PLANNER_NAME = 64  # characters of the planner label kept in reports
MAX_LINKS = 1 << 20  # links in one schedule: far above any topology's edge count
MAX_BUDGET_S = 86_400.0  # a round budget beyond a day is a lie or a bug
MAX_MEMBERS = 1 << 20  # ranks one schedule may name (topology.checks.MAX_PEERS bounds them again)
DEFAULT_PLANNER = "per-tensor"


class ScheduleRefused(ValueError):
    """A schedule a peer will not apply; the message names what is wrong."""


class ScheduleLate(ScheduleRefused):
    """A schedule refused only for coming after its effective round at the peer: usable, had
    it come in time (the coordinator publishes it again further ahead)."""


@dataclass(frozen=True, order=True)
class LinkLevel:
    """The compression level of the edge between peers `low` < `high` (PowerGossip: a rank)."""

    low: int
    high: int
    level: int

    def __post_init__(self) -> None:
        for field, value, top in (
            ("low", self.low, MAX_EPOCH),
            ("high", self.high, MAX_EPOCH),
            ("level", self.level, MAX_LEVEL),
        ):
            checked_integer(f"schedule link {field}", value, 0, top, ScheduleRefused)
        if self.low >= self.high:
            raise ScheduleRefused(
                f"schedule link {self.low}-{self.high}: expected the lower rank first"
            )
        if self.level < 1:
            raise ScheduleRefused(f"schedule link {self.low}-{self.high}: level 0, expected >= 1")


@dataclass(frozen=True)
class Schedule:
    """A versioned plan: `groups` of parameter names, each fused into one buffer and compressed
    with its compressor spec, from `effective_round` on. No groups: one group per parameter
    with the algorithm's own compressor (what a peer runs before any schedule arrives)."""

    epoch: int
    effective_round: int
    groups: tuple[TensorGroup, ...] = ()
    planner: str = DEFAULT_PLANNER  # what made it, for reports
    links: tuple[LinkLevel, ...] = ()  # sorted, one per edge at most
    budget_s: float = 0.0  # the round budget the levels were chosen for (0: no levels)
    # live membership: the ranks in the network from effective_round on, sorted (empty: the
    # topology's own)
    members: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checked_integer("schedule epoch", self.epoch, 0, MAX_EPOCH, ScheduleRefused)
        checked_integer(
            "schedule effective_round", self.effective_round, 0, MAX_ROUND, ScheduleRefused
        )
        if not isinstance(self.planner, str) or not 0 < len(self.planner) <= MAX_PLANNER_NAME:
            raise ScheduleRefused(
                f"schedule planner: expected a name of 1 to {MAX_PLANNER_NAME} characters, "
                f"got {quoted(self.planner)}"
            )
        if len(self.groups) > MAX_GROUPS:
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: {len(self.groups)} groups, at most {MAX_GROUPS}"
            )
        if len(self.links) > MAX_LINKS:
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: {len(self.links)} links, at most {MAX_LINKS}"
            )
        edges = [(x.low, x.high) for x in self.links]
        if edges != sorted(set(edges)):
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: links must be sorted, each edge at most once"
            )
        if len(self.members) > MAX_MEMBERS:
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: {len(self.members)} members, at most {MAX_MEMBERS}"
            )
        for rank in self.members:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_MEMBERS:
                raise ScheduleRefused(
                    f"schedule epoch {self.epoch} members: expected ranks in [0, {MAX_MEMBERS}), "
                    f"got {quoted(rank)}"
                )
        if list(self.members) != sorted(set(self.members)):
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: members must be sorted, each rank at most once"
            )
        budget = self.budget_s
        if (
            isinstance(budget, bool)
            or not isinstance(budget, int | float)
            or not 0.0 <= budget <= MAX_BUDGET_S  # also false for NaN
        ):
            raise ScheduleRefused(
                f"schedule budget_s: expected seconds in [0, {MAX_BUDGET_S:g}], got {quoted(budget)}"
            )

    def levels_of(self, rank: int) -> dict[int, int]:
        """The levels of `rank`'s links by neighbour (links not listed are absent)."""
        levels = {x.high: x.level for x in self.links if x.low == rank}
        levels.update({x.low: x.level for x in self.links if x.high == rank})
        return levels

    def check_links(self, edges: Sequence[tuple[int, int]]) -> None:
        """Raise ScheduleRefused unless every link listed is one of `edges` (lower rank first)."""
        known = set(edges)
        for x in self.links:
            if (x.low, x.high) not in known:
                raise ScheduleRefused(
                    f"schedule epoch {self.epoch}: link {x.low}-{x.high} is not an edge of the "
                    "topology"
                )

    def check_members(self, capacity: int | None) -> None:
        """Raise ScheduleRefused unless the members are ranks of a live topology of
        `capacity` ranks (None: a fixed topology, where a schedule names no members)."""
        if not self.members:
            return
        if capacity is None:
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: names members, but the topology's membership is "
                "fixed; expected no members (a topology file with `members:` is live)"
            )
        outside = [rank for rank in self.members if rank >= capacity]
        if outside:
            raise ScheduleRefused(
                f"schedule epoch {self.epoch}: member {outside[0]} is outside the topology's "
                f"capacity; expected ranks 0..{capacity - 1}"
            )

    def check(self, names: Sequence[str]) -> None:
        """Raise ScheduleRefused unless the groups cover `names` (the model's parameters)
        exactly once and every compressor spec is one this peer can build."""
        if not self.groups:
            return
        try:
            check_cover(self.groups, names, contiguous=False)
        except ValueError as error:
            raise ScheduleRefused(f"schedule epoch {self.epoch}: {error}") from None
        for index, group in enumerate(self.groups):
            try:
                parse_spec(group.compressor)
            except (ValueError, TypeError) as error:
                raise ScheduleRefused(
                    f"schedule epoch {self.epoch}, group {index}: compressor "
                    f"{quoted(group.compressor)}: {error}"
                ) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (checkpoints, reports, the coordinator's messages)."""
        return {
            "epoch": self.epoch,
            "effective_round": self.effective_round,
            "planner": self.planner,
            "groups": [{"names": list(g.names), "compressor": g.compressor} for g in self.groups],
            "links": [[x.low, x.high, x.level] for x in self.links],
            "budget_s": self.budget_s,
            "members": list(self.members),
        }

    @classmethod
    def from_dict(cls, value: Any) -> Schedule:
        """The inverse of `to_dict`; ScheduleRefused naming the field when malformed. Links,
        budget and members may be missing (schedules saved before there were levels or live
        membership)."""
        required = {"epoch", "effective_round", "planner", "groups"}
        if not isinstance(value, Mapping) or not required <= set(value) <= _KEYS:
            found = sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
            raise ScheduleRefused(
                f"schedule: expected keys {sorted(_KEYS)} (links, budget_s, members optional), "
                f"got {quoted(found)}"
            )
        groups = value["groups"]
        if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
            raise ScheduleRefused(f"schedule groups: expected a list of at most {MAX_GROUPS}")
        parsed = []
        for index, group in enumerate(groups):
            if (
                not isinstance(group, Mapping)
                or set(group) != {"names", "compressor"}
                or not isinstance(group["names"], list)
                or not all(isinstance(n, str) for n in group["names"])
                or not isinstance(group["compressor"], str)
            ):
                raise ScheduleRefused(
                    f"schedule group {index}: expected {{names: [str, ...], compressor: str}}, "
                    f"got {quoted(group)}"
                )
            parsed.append(TensorGroup(tuple(group["names"]), group["compressor"]))
        links = value.get("links", [])
        if not isinstance(links, list) or len(links) > MAX_LINKS:
            raise ScheduleRefused(f"schedule links: expected a list of at most {MAX_LINKS}")
        levels = []
        for index, item in enumerate(links):
            if not isinstance(item, list) or len(item) != 3:
                raise ScheduleRefused(
                    f"schedule link {index}: expected [low, high, level], got {quoted(item)}"
                )
            levels.append(LinkLevel(*item))
        members = value.get("members", [])
        if not isinstance(members, list) or len(members) > MAX_MEMBERS:
            raise ScheduleRefused(f"schedule members: expected a list of at most {MAX_MEMBERS}")
        return cls(
            value["epoch"],
            value["effective_round"],
            tuple(parsed),
            value["planner"],
            tuple(levels),
            value.get("budget_s", 0.0),
            tuple(members),
        )


_KEYS = {"epoch", "effective_round", "planner", "groups", "links", "budget_s", "members"}


def _allowed_epoch(current: Schedule, round: int) -> int:
    since = max(0, round - current.effective_round)
    return min(MAX_EPOCH, current.epoch + EPOCH_ALLOWANCE + since)


class ScheduleBook:
    """One peer's schedules: the one in force and those staged for later rounds (at most
    MAX_STAGED), in order of epoch and effective round."""

    def __init__(
        self,
        names: Sequence[str],
        edges: Sequence[tuple[int, int]] = (),
        capacity: int | None = None,
    ) -> None:
        """`names`: the model's parameters; `edges`: the topology's, lower rank first (the
        only links a schedule may set a level for); `capacity`: the ranks a live topology
        may hold (None: its membership is fixed, and schedules name no members)."""
        self._names = list(names)
        self._edges = list(edges)
        self._capacity = capacity
        self.current = Schedule(0, 0)
        self.history: list[Schedule] = [self.current]  # every schedule that took effect
        # epochs staged `late`: in force here from the round after the one that staged them,
        # not from the round the others switched at (not kept in a checkpoint)
        self.taken_late: set[int] = set()
        self._staged: list[Schedule] = []

    @property
    def newest(self) -> Schedule:
        """The newest schedule this peer has, in force or staged."""
        return self._staged[-1] if self._staged else self.current

    @property
    def staged(self) -> tuple[Schedule, ...]:
        return tuple(self._staged)

    def stage(
        self, schedule: Schedule, round: int, *, late: bool = False, begun: int | None = None
    ) -> Schedule:
        """Accept `schedule` to take effect at its round and return it as staged;
        ScheduleRefused (nothing changed) when it does not cover the model, does not go forward
        in epoch or goes too far (`allowed_epoch`), takes effect more than `SCHEDULE_HORIZON`
        rounds after `round` (the peer's current round), or at or before `begun`, the furthest
        round the peer has begun (default `round`: it may already have exchanged under the old
        one; a peer between two rounds passes `round - 1`, so a schedule of the round it is
        about to run still counts as on time). `late` (a schedule the others hold, which
        reached this peer after its round): one whose round has begun here takes effect at
        the next round not begun instead (its epoch joins `taken_late`). Staged schedules that
        would take effect at or after its round are superseded (dropped); at most MAX_STAGED
        wait."""
        newest = self.newest
        if schedule.epoch <= newest.epoch:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: expected an epoch after {newest.epoch}, the "
                "newest this peer has (schedules only go forward)"
            )
        allowed = self.allowed_epoch(round)
        if schedule.epoch > allowed:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: expected at most epoch {allowed} (epoch "
                f"{self.current.epoch} in force, {EPOCH_ALLOWANCE} more plus one a round since): "
                "epochs cannot be used up"
            )
        horizon = lead_bound(round, SCHEDULE_HORIZON)
        if schedule.effective_round > horizon:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: takes effect at round "
                f"{schedule.effective_round}, expected at most {horizon} ({SCHEDULE_HORIZON} "
                f"rounds after this peer's round {round})"
            )
        begun = round if begun is None else begun
        taken_late = schedule.effective_round <= begun
        if taken_late:
            if not late:
                raise ScheduleLate(
                    f"schedule epoch {schedule.epoch}: takes effect at round "
                    f"{schedule.effective_round}, expected a round after {begun} (the furthest "
                    "round this peer has begun): a schedule cannot take effect in the past"
                )
            schedule = dataclasses.replace(schedule, effective_round=begun + 1)
        kept = [s for s in self._staged if s.effective_round < schedule.effective_round]
        if len(kept) >= MAX_STAGED:
            raise ScheduleRefused(
                f"schedule epoch {schedule.epoch}: {MAX_STAGED} schedules already wait for "
                "their round at this peer"
            )
        self._check(schedule)
        self._staged = [*kept, schedule]
        if taken_late:
            self.taken_late.add(schedule.epoch)
        return schedule

    def allowed_epoch(self, round: int) -> int:
        """The highest epoch a schedule staged at `round` may have: `EPOCH_ALLOWANCE` past the
        epoch in force, plus one for every round since it took effect."""
        return _allowed_epoch(self.current, round)

    def _check(self, schedule: Schedule) -> None:
        schedule.check(self._names)
        schedule.check_links(self._edges)
        schedule.check_members(self._capacity)

    def due(self, round: int) -> Schedule | None:
        """The schedule that takes effect by `round`, now in force (None when the one in force
        stays). A peer that jumped over several effective rounds goes to the latest one."""
        ready = [s for s in self._staged if s.effective_round <= round]
        if not ready:
            return None
        self._staged = [s for s in self._staged if s.effective_round > round]
        self.current = ready[-1]
        self.history.append(self.current)
        return self.current

    def epoch_at(self, round: int) -> int:
        """The epoch in force at `round` by what this peer has now."""
        epoch = self.current.epoch
        for schedule in self._staged:
            if schedule.effective_round <= round:
                epoch = schedule.epoch
        return epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "current": self.current.to_dict(),
            "staged": [s.to_dict() for s in self._staged],
            "history": [s.to_dict() for s in self.history],
        }

    def load_state_dict(self, state: Any, round: int) -> None:
        """Restore what `state_dict` returned at `round` (the checkpoint's); ScheduleRefused
        (nothing changed) when any part is malformed, does not cover the model, is out of
        order, or is out of the bounds staging holds to at that round (in force after it,
        staged beyond the horizon, an epoch past `allowed_epoch`)."""
        if not isinstance(state, Mapping) or set(state) != {"current", "staged", "history"}:
            raise ScheduleRefused("schedules: expected keys ['current', 'history', 'staged']")
        current = Schedule.from_dict(state["current"])
        self._check(current)
        lists = []
        for key, limit in (("staged", MAX_STAGED), ("history", MAX_EPOCH)):
            items = state[key]
            if not isinstance(items, list) or len(items) > limit:
                raise ScheduleRefused(f"schedules {key}: expected a list of at most {limit}")
            lists.append([Schedule.from_dict(item) for item in items])
        staged, history = lists
        chain = [current, *staged]
        for before, after in zip(chain, chain[1:], strict=False):
            if after.epoch <= before.epoch or after.effective_round <= before.effective_round:
                raise ScheduleRefused(
                    f"schedules: staged epoch {after.epoch} does not follow epoch {before.epoch}"
                )
        if current.effective_round > round:
            raise ScheduleRefused(
                f"schedules: epoch {current.epoch} in force from round "
                f"{current.effective_round}, after the checkpoint's round {round}"
            )
        allowed = _allowed_epoch(current, round)
        for schedule in staged:
            if schedule.effective_round > round + SCHEDULE_HORIZON or schedule.epoch > allowed:
                raise ScheduleRefused(
                    f"schedules: staged epoch {schedule.epoch} from round "
                    f"{schedule.effective_round} is beyond what a peer at round {round} stages "
                    f"(at most epoch {allowed}, round {round + SCHEDULE_HORIZON})"
                )
            self._check(schedule)
        self.current, self._staged = current, staged
        self.history = history or [current]
