"""A peer's failure accounting: the rounds in a row whose exchanges heard no neighbour, why each
neighbour last failed, and whether the peer trains alone. It warns when the failures go on and
raises GossipStalled after `max_failed_rounds` of them, so a run cut off from every neighbour
says so instead of training alone in silence."""

from __future__ import annotations

import logging
from collections.abc import Collection

from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.inputs.text import quoted

# rounds in a row whose exchanges failed with every neighbour before the peer stops (0: never)
DEFAULT_MAX_FAILED_ROUNDS = 20
FAILED_ROUNDS_WARNING = 3  # ... and before it warns that its exchanges keep failing
log = logging.getLogger("gossipcomp.peer")  # its warnings are the peer's


class GossipStalled(RuntimeError):
    """A peer's exchanges failed with every neighbour in `max_failed_rounds` rounds in a row:
    it has been training alone, which is not what a gossip run was asked to do."""


class FailedRounds:
    """The failed rounds of peer `rank` with `neighbours`, since one last heard a neighbour."""

    def __init__(self, rank: int, neighbours: Collection[int], max_failed_rounds: int) -> None:
        checked_integer("max_failed_rounds (0: never stop)", max_failed_rounds, 0)
        self.rank = rank
        self.neighbours = set(neighbours)
        self.max_failed_rounds = max_failed_rounds
        self.count = 0  # rounds that tried an exchange since one last heard a neighbour
        self.first = 0  # the first of them
        self.reasons: dict[int, str] = {}  # neighbour -> why its last exchange failed
        self.alone = False  # the last round reached no neighbour

    def failed(self, neighbour: int, reason: str) -> None:
        """Note why an exchange with `neighbour` failed (quoted when the peer stops)."""
        self.reasons[neighbour] = reason

    def report_isolation(self, weights: Collection[int], failed: set[int], round: int) -> None:
        """Say so when a round reached no neighbour at all (the peer trains alone), and when
        neighbours are back. `weights`: the neighbours this round tried; `failed`: those whose
        exchange failed."""
        alone = not set(weights) - failed
        if alone and not self.alone:
            lost = sorted(self.neighbours - (set(weights) - failed))
            log.warning(
                "peer %d: no neighbour reachable in round %d (%s); training alone",
                self.rank,
                round,
                ", ".join(str(j) for j in lost),
            )
        elif self.alone and not alone:
            log.warning("peer %d: neighbours reachable again in round %d", self.rank, round)
        self.alone = alone

    def count_round(self, heard: bool, tried: bool, round: int) -> None:
        """Count the failed rounds since a neighbour was last heard: rounds that tried an
        exchange (gossip or resume) and heard no one. A round with every edge down or waiting
        for its agreed resume round tries none: the links are recovering (a partition, a
        neighbour restarting, probes under way), which is not counted, nor does it clear the
        count. `stop_if_stalled` ends the run after `max_failed_rounds`; a warning comes after
        FAILED_ROUNDS_WARNING."""
        if heard:
            self.count = 0
            return
        if not (tried and self.neighbours):
            return
        self.count += 1
        if self.count == 1:
            self.first = round
        if self.count == FAILED_ROUNDS_WARNING:
            log.warning(
                "peer %d: its exchanges failed with every neighbour in %d rounds in a row (rounds "
                "%d to %d, none heard in between), so it trains alone; %s; %s",
                self.rank,
                self.count,
                self.first,
                round,
                self.summary(),
                f"it stops after {self.max_failed_rounds} (max_failed_rounds, "
                "--max-failed-rounds; 0: never)"
                if self.max_failed_rounds
                else "max_failed_rounds is 0: it goes on alone",
            )

    def stop_if_stalled(self, last_round: int) -> None:
        """Raise GossipStalled once `max_failed_rounds` failed rounds came in a row, the last
        of them `last_round`."""
        if self.max_failed_rounds and self.count >= self.max_failed_rounds:
            raise GossipStalled(
                f"peer {self.rank}: its exchanges failed with every neighbour in "
                f"{self.count} rounds in a row (rounds {self.first} to "
                f"{last_round}, none heard in between), so it was training alone; "
                f"{self.summary()}; stopped (max_failed_rounds "
                f"{self.max_failed_rounds}, --max-failed-rounds; 0: never stop)"
            )

    def summary(self) -> str:
        """The last failure of each neighbour, each reason cut short (it may quote a
        neighbour's words)."""
        if not self.reasons:
            return "no neighbour answered"
        return "last failures: " + "; ".join(
            f"neighbour {j}: {quoted(reason, 160)}" for j, reason in sorted(self.reasons.items())
        )
