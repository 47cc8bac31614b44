"""One bound for claimed rounds: how far anyone's word about a round is believed.

A round number comes from the network in a Hello, a report to the coordinator, a schedule's
effective round and a level notice. Each reader bounds it the same way, here:

- by time (`furthest_round`): a party last known for sure at round R, t seconds ago, can be at
  most R + margin + `allowance` x t / (fastest seconds per round) now;
- by agreement (`agreed_round`): a round several parties claim to have reached is believed only
  as far as `quorum` of them agree (the quorum-th highest claim), so one liar moves nothing;
- by lead (`lead_bound`): a round that a message says something takes effect at (a schedule's
  effective round, a level notice's) lies at most a fixed lead past a round the reader knows for
  sure (its own round, the envelope's checked round);
- `RoundClaims` keeps both for a set of parties (the coordinator's members, a peer's
  neighbours): each party's claim is believed up to what time allows since its last believed
  one, and `agreed()` is the round a quorum of them reached.

Nothing here trusts a claim to be in range: every result is clamped to 0..MAX_WIRE_ROUND.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from gossipcomp.transport.base import MAX_WIRE_ROUND

SPEED_ALLOWANCE = 2.0  # a party may run rounds this many times faster than the fastest seen
DEFAULT_ROUND_SECONDS = 0.005  # the fastest round assumed before any was measured


def furthest_round(
    confirmed: int,
    elapsed: float,
    seconds_per_round: float,
    margin: int = 0,
    allowance: float = SPEED_ALLOWANCE,
) -> int:
    """The furthest round a party known to be at round `confirmed` `elapsed` seconds ago can
    have reached now, rounds taking at least `seconds_per_round` / `allowance` seconds, plus
    `margin` rounds; at most MAX_WIRE_ROUND."""
    if not (math.isfinite(seconds_per_round) and seconds_per_round > 0):
        raise ValueError(f"seconds_per_round: expected seconds > 0, got {seconds_per_round!r}")
    elapsed = 0.0 if math.isnan(elapsed) else max(0.0, elapsed)
    rounds = min(allowance * elapsed / seconds_per_round, float(MAX_WIRE_ROUND))
    furthest = max(0, confirmed) + max(0, margin) + math.ceil(rounds)
    return min(furthest, MAX_WIRE_ROUND)


def lead_bound(known: int, lead: int) -> int:
    """The furthest round a claim about the future may name: `lead` rounds past `known`, a round
    the reader knows for sure (its own, or the checked round of the envelope carrying the claim);
    at most MAX_WIRE_ROUND. Schedules and level notices are held to it."""
    if lead < 0:
        raise ValueError(f"lead: expected rounds >= 0, got {lead}")
    return min(max(0, known) + lead, MAX_WIRE_ROUND)


def agreed_round(claims: Iterable[int], quorum: int) -> int | None:
    """The highest round at least `quorum` of `claims` reach (the quorum-th highest claim);
    None when there are fewer than `quorum` claims."""
    if quorum < 1:
        raise ValueError(f"quorum: expected >= 1, got {quorum}")
    ordered = sorted(claims, reverse=True)
    if len(ordered) < quorum:
        return None
    return ordered[quorum - 1]


def quorum_of(parties: int) -> int:
    """How many parties must agree on a round: two when there are two or more (one liar moves
    nothing), else the one."""
    return min(2, max(1, parties))


@dataclass(frozen=True)
class Believed:
    """A party's claimed round as far as it is believed, and when it was claimed."""

    round: int
    at: float  # the clock's seconds
    cut: bool  # the claim went beyond what time allowed and was cut to `round`


class RoundClaims:
    """Rounds claimed by several parties, each believed up to `furthest_round` of its last
    believed claim (a party's first claim: of `agreed()` and when it was reached, when a
    quorum exists; unbounded otherwise), and the round a quorum of them agree on.

    Not thread-safe: the caller holds its own lock.
    """

    def __init__(
        self,
        seconds_per_round: float = DEFAULT_ROUND_SECONDS,
        margin: int = 0,
        quorum: Callable[[int], int] = quorum_of,
        clock: Callable[[], float] = time.monotonic,
        allowance: float = SPEED_ALLOWANCE,
    ) -> None:
        """`seconds_per_round`: the fastest a round can take (what the peers measured, or a
        floor); `margin`: rounds allowed on top of what time allows (reports come every few
        rounds); `quorum(n)`: how many of n parties must agree."""
        furthest_round(0, 0.0, seconds_per_round)  # checks seconds_per_round
        self.seconds_per_round = seconds_per_round
        self.margin = margin
        self.allowance = allowance
        self._quorum = quorum
        self._clock = clock
        self._believed: dict[Hashable, Believed] = {}

    def bound(self, party: Hashable) -> int | None:
        """The furthest round `party` can claim now; None when nothing bounds it yet."""
        now = self._clock()
        last = self._believed.get(party)
        if last is None:
            reference = self._agreed_reference()
            if reference is None:
                return None
            last = reference
        return furthest_round(
            last.round, now - last.at, self.seconds_per_round, self.margin, self.allowance
        )

    def believe(self, party: Hashable, claimed: int) -> Believed:
        """Record `party`'s claim of round `claimed`, believed up to `bound(party)`."""
        claimed = min(max(0, claimed), MAX_WIRE_ROUND)
        limit = self.bound(party)
        believed = Believed(
            claimed if limit is None else min(claimed, limit),
            self._clock(),
            limit is not None and claimed > limit,
        )
        self._believed[party] = believed
        return believed

    def forget(self, party: Hashable) -> None:
        self._believed.pop(party, None)

    def believed(self, party: Hashable) -> Believed | None:
        return self._believed.get(party)

    def agreed(self) -> int | None:
        """The round a quorum of the parties' believed rounds reach (None with too few)."""
        rounds = [b.round for b in self._believed.values()]
        return agreed_round(rounds, self._quorum(len(rounds))) if rounds else None

    def _agreed_reference(self) -> Believed | None:
        """The agreed round and the earliest time a quorum had claimed it."""
        agreed = self.agreed()
        if agreed is None:
            return None
        reached = sorted(b.at for b in self._believed.values() if b.round >= agreed)
        quorum = self._quorum(len(self._believed))
        return Believed(agreed, reached[quorum - 1], False)
