"""Back-pressure: a push its receiver is not ready for yet is sent again, not given up.

A receiver holds envelopes for its current round and a few rounds ahead (mailbox.py). On a
graph that changes every round, a peer whose partners were down runs on alone and can be many
rounds ahead of the next partner it meets. Its push is then refused as not yet due (ABORTED),
and every transport answers that the same way: it pushes again after a short, growing pause
until the receiver has opened that round or the sender's round deadline has passed. The sender
waits for that partner's envelope anyway, so holding its push back costs it nothing; the
receiver's memory stays bounded by its window; and an edge is no longer failed (and the
network's average no longer drifts) only because one end ran ahead of the other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

FIRST_PAUSE_S = 0.005
LONGEST_PAUSE_S = 0.1


def pauses_until(deadline: float) -> Iterator[float]:
    """Seconds to wait before each new attempt, doubling from FIRST_PAUSE_S up to
    LONGEST_PAUSE_S, while the attempt after the pause still has at least a pause's time
    before `deadline` (time.monotonic) to be answered."""
    pause = FIRST_PAUSE_S
    while deadline - time.monotonic() > 2 * pause:
        yield pause
        pause = min(2 * pause, LONGEST_PAUSE_S)
