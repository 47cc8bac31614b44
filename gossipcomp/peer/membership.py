"""A peer's side of live membership (topology/members.py): who it gossips with, greets, probes
and answers, by the members its schedules name.

The graph of a round is the family over the members of the schedule in force at that round,
which every member switches to at the same round, so both ends of an edge agree on it. Edges
come up only between members:

- at a fresh start (round 0, not joining) a member greets the members in force, as on a fixed
  topology; anyone else (a joiner, a restarted peer) greets nobody and starts alone, every edge
  down: its round is its own until a member's probe brings it to the network's;
- a peer probes (and answers the handshake of) a neighbour only when that neighbour is a member
  in force here and this peer is a member of the newest schedule it holds; a joiner holds its
  admission before it is in force, so the members' probes after the admission's round find it,
  and it follows their round (it is alone);
- a peer that is not a member in force does no rounds: `gossip()` returns without one, so its
  round cannot run past an admission's effective round before it holds it. `joining`: a peer
  restarted after it may have been removed is a member only from a schedule newer than the one
  it started with (the coordinator's next one, which names whether it is in);
- a joiner has never been in step with anyone, so the bound on neighbours' claimed rounds
  (peer/links.py) would hold it far behind a network that has run for a while; once it holds
  its admission, whose effective round the coordinator set ahead of the network's furthest
  round and which passed the one bound on schedules (schedule.py), it counts from that round
  as the last one it was in step at, and follows the member that probes it from there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from gossipcomp.schedule.schedule import Schedule, ScheduleBook
from gossipcomp.topology import Topology


class PeerMembership:
    """Membership as peer `rank` sees it from its schedule book (`book()`: the one it holds
    now, since a checkpoint may replace it)."""

    def __init__(
        self, rank: int, topology: Topology, book: Callable[[], ScheduleBook], joining: bool
    ) -> None:
        self.rank = rank
        self.topology = topology
        self._book = book
        if joining and topology.live is None:
            raise ValueError(
                f"peer {rank}: joining a network needs a live topology (a topology file with "
                f"`members:`); {topology.name} has a fixed membership"
            )
        self.joining = joining
        self._joined_after = book().newest.epoch  # joining: member only in a newer schedule

    @property
    def live(self) -> bool:
        return self.topology.live is not None

    def restarted_from(self, epoch: int) -> None:
        """A checkpoint was restored whose newest schedule is `epoch`."""
        self._joined_after = epoch

    def _named(self, in_force: bool) -> tuple[int, ...]:
        live = self.topology.live
        assert live is not None
        book = self._book()
        schedule = book.current if in_force else book.newest
        if self.joining and schedule.epoch <= self._joined_after:
            return tuple(j for j in live.members(schedule.members) if j != self.rank)
        return live.members(schedule.members)

    def members(self) -> tuple[int, ...]:
        """The members in force (every rank of a fixed topology)."""
        if not self.live:
            return tuple(range(self.topology.n))
        return self._named(in_force=True)

    def member(self) -> bool:
        """Whether this peer is a member in force (always, on a fixed topology)."""
        return not self.live or self.rank in self._named(in_force=True)

    def will_be_member(self) -> bool:
        """Whether the newest schedule this peer holds names it (always, on a fixed topology)."""
        return not self.live or self.rank in self._named(in_force=False)

    def awaiting_admission(self) -> bool:
        """Whether this peer joins and holds no schedule naming it yet: it asks the coordinator
        (its reports say so) for one, which a member restarted before its removal needs too."""
        return self.joining and not self.will_be_member()

    def admission(self) -> Schedule | None:
        """The first staged schedule that names this peer while it is not a member in force
        (None: it is one, or holds none that names it)."""
        live = self.topology.live
        if live is None or self.member():
            return None
        for schedule in self._book().staged:
            if self.joining and schedule.epoch <= self._joined_after:
                continue
            if self.rank in live.members(schedule.members):
                return schedule
        return None

    def row(self, round: int) -> dict[int, float]:
        """This peer's neighbours and weights at `round` (its round: the schedule in force)."""
        if not self.live:
            return self.topology.round_weights(self.rank, round)[0]
        if not self.member():
            return {}
        return self.topology.member_weights(self.rank, round, self._book().current.members)

    def greeted(self, round: int, neighbours: Collection[int]) -> frozenset[int] | None:
        """Whom `start()` greets at `round` (None: every neighbour, a fixed topology)."""
        if not self.live:
            return None
        if round > 0 or self.joining or not self.member():
            return frozenset()  # alone: members' probes bring it in
        members = set(self.members())
        return frozenset(j for j in neighbours if j in members)

    def may_link(self, neighbour: int) -> bool:
        """Whether an edge to `neighbour` may be probed or agreed now: it is a member in force
        here and this peer a member of the newest schedule it holds."""
        if not self.live:
            return True
        return self.will_be_member() and neighbour in self._named(in_force=True)

    def outside(self, neighbours: Collection[int]) -> list[int]:
        """The `neighbours` this peer may not hold an edge to now: every one when it is not a
        member in force, else those that are not (none on a fixed topology). A change of
        members takes their edges down, so an edge that comes back does so by a probe and a
        resynchronisation at both ends, never half-up."""
        if not self.live:
            return []
        if not self.member():
            return list(neighbours)
        members = set(self.members())
        return [j for j in neighbours if j not in members]

    def refusal(self, sender: int) -> str | None:
        """Why `sender`'s handshake is not answered yet (None: it is)."""
        if self.may_link(sender):
            return None
        if not self.will_be_member():
            return f"peer {self.rank} is not a member of the network yet"
        return f"peer {sender} is not a member at peer {self.rank}'s round"
