"""How fast the members' rounds go, so that a schedule's margin covers a time, not only rounds.

A schedule is published `margin` rounds past the furthest round heard, and a peer that passes
that round before the schedule reaches it takes it late, from its next round (its exchanges
under the old one are refused meanwhile, since the others switched). A margin counted in
rounds alone is 3 report intervals whatever a round takes: rounds of a few milliseconds (a
small model, a fast link) outran it whenever the coordinator was slow to answer, as on a loaded
machine. `RoundPace` measures each member's rounds per second from its believed claims and
gives the rounds that `SCHEDULE_LEAD_S` seconds take at the pace of the quorum-th fastest
member, so one member's word, true or not, moves nothing. A sample ends at a claim that was
cut to what time allows (a liar's, or a joiner's catching up with the network: no pace of the
network's), and no pace counts above `MAX_PACE`, the fastest that the bound on claimed rounds
believes (transport/claims.py); so the lead time adds at most `MAX_PACE` x `SCHEDULE_LEAD_S`
rounds. Until a quorum of members' paces is measured (`PACE_SAMPLE_S` after their first
reports) the margin in rounds is all there is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gossipcomp.transport.claims import DEFAULT_ROUND_SECONDS, SPEED_ALLOWANCE

# seconds a published schedule is given to reach every peer, beyond the margin's report
# intervals: a busy coordinator's reply (rounds of 55 ms and more keep the base margin of
# 2 x report_every + 1 with report_every 1, so adaptive levels on slow links react no later)
SCHEDULE_LEAD_S = 0.15
PACE_SAMPLE_S = 0.1  # a member's pace is measured over at least this many seconds
MAX_PACE = SPEED_ALLOWANCE / DEFAULT_ROUND_SECONDS  # rounds a second: what claims may show


class RoundPace:
    """Members' rounds per second, measured from their believed (round, time) claims.

    Not thread-safe: the caller holds its own lock."""

    def __init__(self, lead_s: float = SCHEDULE_LEAD_S) -> None:
        self.lead_s = lead_s
        self._marks: dict[int, tuple[int, float]] = {}  # rank -> (round, at) the sample began
        self._measured: dict[int, float] = {}  # rank -> rounds per second, last sample

    def heard(self, rank: int, round: int, at: float, cut: bool = False) -> None:
        """Member `rank` is believed at `round` at time `at` (seconds); `cut`: its claim went
        beyond what time allowed (the sample in progress ends, nothing measured)."""
        mark = self._marks.get(rank)
        if cut or mark is None or round < mark[0] or at < mark[1]:
            self._marks[rank] = (round, at)
            return
        if at - mark[1] >= PACE_SAMPLE_S:
            pace = (round - mark[0]) / (at - mark[1])
            self._measured[rank] = min(pace, MAX_PACE)
            self._marks[rank] = (round, at)

    def forget(self, rank: int) -> None:
        for table in (self._marks, self._measured):
            table.pop(rank, None)

    def rounds_per_second(self, members: Iterable[int], quorum: int) -> float | None:
        """The `quorum`-th fastest measured pace among `members`; None when fewer are
        measured."""
        paces = sorted((self._measured[r] for r in members if r in self._measured), reverse=True)
        return paces[quorum - 1] if len(paces) >= quorum >= 1 else None

    def lead_rounds(self, members: Iterable[int], quorum: int) -> int:
        """The rounds `lead_s` seconds take at the members' pace (0 before it is measured)."""
        pace = self.rounds_per_second(members, quorum)
        return 0 if pace is None else math.ceil(pace * self.lead_s)
