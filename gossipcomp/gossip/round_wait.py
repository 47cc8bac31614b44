"""What one gossip round may still wait for its neighbours.

`--round-timeout` bounds a round's waiting, not each exchange's: a round has several exchanges
(an edge's resume, the level exchange after it, each phase of the algorithm), and with a timeout
each, a resume and then the model exchange meeting silent neighbours made a 10 s round out of
5 s timeouts (the churn soak, issue 27). The round's exchanges draw on one budget; the compute
between them is not counted. Each exchange still gets a short floor (a hundredth of the
budget, at most 50 ms: what a small push over a fast link takes), so that envelopes already in
the mailbox are taken and the pushes answering them can finish, rather than every neighbour
being failed at once when the budget is spent; it keeps a round within one timeout plus that
floor per exchange that starts with the budget spent.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOOR_FRACTION = 0.01  # of the round timeout: what an exchange gets once the budget is spent
MAX_FLOOR_S = 0.05


@dataclass
class RoundWait:
    """The waiting budget of one round: `limit` seconds over all of its exchanges."""

    limit: float
    waited: float = 0.0

    def timeout(self) -> float:
        """Seconds the next exchange may wait: what is left of the budget, at least the floor
        (a hundredth of the limit, at most `MAX_FLOOR_S`)."""
        floor = min(FLOOR_FRACTION * self.limit, MAX_FLOOR_S)
        return max(floor, self.limit - self.waited)

    def spent(self, seconds: float) -> None:
        """An exchange of the round waited `seconds`."""
        self.waited += max(0.0, seconds)
