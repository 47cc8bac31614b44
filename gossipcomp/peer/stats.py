"""PeerStats: what a peer has done so far, as its `stats` property reports it (the rounds, the
serialised bytes per link, where the time went, the schedules and levels it went through)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from gossipcomp.schedule.costs import TransferLog
from gossipcomp.schedule.schedule import Schedule


@dataclass(frozen=True)
class PeerStats:
    """What a peer has done so far: rounds, serialised bytes per link, and where time went."""

    rank: int
    rounds: int
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    failed_exchanges: dict[int, int]
    compute_seconds: float
    comm_seconds: float
    mismatched_epoch_exchanges: int = 0  # exchanges refused: the two ends were in other epochs
    schedule_epochs: tuple[Schedule, ...] = ()  # every schedule that took effect, in order
    # those of them it took late: in force from its round after they came, not theirs
    late_epochs: frozenset[int] = frozenset()
    local_steps: int = 0  # local steps counted by `after_local_step` (custom loops)
    # each change of one of its links' level: {round, link: [low, high], level: label}
    link_levels: tuple[dict[str, Any], ...] = ()
    # per neighbour: the median seconds of the last sends there (what a round's transfer takes)
    send_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    # each change of the level it broadcasts at (choco, def): {round, level: label}
    peer_levels: tuple[dict[str, Any], ...] = ()

    @property
    def bytes_sent_total(self) -> int:
        return sum(self.bytes_sent.values())


def median_send_seconds(sends: TransferLog) -> dict[int, float]:
    """Per neighbour with sends logged: the median seconds of its last sends."""
    return {
        j: statistics.median(s for _, s in sends.samples(j))
        for j in sends.links()
        if sends.samples(j)
    }
