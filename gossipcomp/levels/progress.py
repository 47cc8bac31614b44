"""Training progress caps link levels: AdaComm's rule, carried from periods to ranks.

Wang and Joshi (2019, AdaComm) communicate more as the training loss falls: a local-update
period tau_t = tau_0 * sqrt(F_t / F_0), so rounds early in training, where exact averaging
buys little, cost little. Carried to compression, where a round always communicates but sends
a coarser or finer approximation: the rank PowerGossip gossips (the dimension of the subspace
of the model difference it averages) grows as sqrt(F_0 / F_t), one rung of its ladder (a
doubling) per fourfold fall of the loss. The other ladders step by about a doubling of what
they keep too (top-k's 1-2-5 ratios), so the rule is the same for every ladder: rung k (from
0, the lowest) needs F_0 / F_t >= 4^k. Counted in rungs, not in bytes: a rank-1 round's bytes
are half uncompressed vectors (biases) on benchmarks/adaptive.py's model, so rank 2 sends only
1.5x rank 1's bytes and a ceiling in bytes let it rise at a 2.25x fall, by round 29 there. The
rate controller still chooses within the bandwidth budget; this is a ceiling under it.
Measured on the shaped ring (docs/benchmarks.md, issue 24): a level above the lowest on the
fast links bought no rounds before round ~80 and cost time at every change of the network,
while rank 1 for the whole run never reached the target.

Peer side (`LossWindow`): the loss of the untrained model (the first round's local steps) and
the mean of the last `LOSS_WINDOW_ROUNDS` rounds. Coordinator side (`LossAllowance`): the
median over the members of each (one member's word moves neither past the honest ones), and a
ratio that only grows, so the loss's noise never lowers a level the ratio once allowed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.levels.rate import LevelCosts

LOSS_WINDOW_ROUNDS = 10  # rounds whose mean loss a report carries
RUNG_FALL = 4.0  # the fall of the loss each rung up the ladder needs (sqrt: a doubling)


class LossWindow:
    """One peer's training loss: the first round's mean (F_0) and the recent rounds' mean."""

    def __init__(self, rounds: int = LOSS_WINDOW_ROUNDS) -> None:
        checked_integer("loss window (rounds)", rounds, 1, 10**6)
        self._rounds: deque[float] = deque(maxlen=rounds)  # each round's mean step loss
        self._steps: list[float] = []  # the losses of the round in progress
        self.initial = 0.0  # the first round's mean loss (0: no round observed yet)

    def observe(self, loss: float) -> None:
        """One local step's minibatch loss (a non-finite one is skipped: the trainer's own
        check stops a diverged run)."""
        if math.isfinite(loss) and loss >= 0:
            self._steps.append(loss)

    def end_round(self) -> None:
        """Close the round: its mean joins the window (a round without steps adds nothing)."""
        if not self._steps:
            return
        mean = sum(self._steps) / len(self._steps)
        self._steps = []
        if not self._rounds and self.initial == 0.0:
            self.initial = mean
        self._rounds.append(mean)

    @property
    def recent(self) -> float:
        """The mean loss of the window's rounds (0: none observed)."""
        return sum(self._rounds) / len(self._rounds) if self._rounds else 0.0


class LossAllowance:
    """The highest rung a link may reach as training progresses (module docstring)."""

    def __init__(self) -> None:
        self.ratio = 1.0  # the largest F_0 / F_t seen; 1 until the loss has fallen

    def update(self, initial: Sequence[float], recent: Sequence[float]) -> bool:
        """Take the members' reported losses (F_0 and the recent mean each, 0: not measured);
        False, changing nothing, when some member measured none (the rule then cannot apply)."""
        if not initial or len(initial) != len(recent) or min(*initial, *recent) <= 0:
            return False
        for value in (*initial, *recent):
            checked_number("loss", value, 0.0, closed_low=False)
        self.ratio = max(self.ratio, statistics.median(initial) / statistics.median(recent))
        return True

    def highest(self, ladder: LevelCosts) -> int:
        """The highest level of `ladder` the fall allows: rung k needs a fall of 4^k."""
        levels = ladder.levels
        rung = int(math.log(self.ratio, RUNG_FALL) + 1e-9)  # 1e-9: 16.0 is 4^2, not 4^1.99..
        return levels[min(rung, len(levels) - 1)]
