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

Peer side (`LossWindow`): the loss of the untrained model (the mean of the first round's first
`INITIAL_STEPS` local steps: a round of many local steps trains the model meanwhile) and the
mean of the last `LOSS_WINDOW_ROUNDS` rounds; a checkpoint keeps both, so a restored peer does not
report its trained loss as its start. Coordinator side (`LossAllowance`): the members that
report both losses count, once they are a majority; the ratio of the lower median of the first
losses to the upper median of the recent ones (so one member's word moves neither past the
honest ones, two members' included), bounded; it only grows, so the loss's noise never lowers a
level the ratio once allowed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.rate import LevelCosts

LOSS_WINDOW_ROUNDS = 10  # rounds whose mean loss a report carries
INITIAL_STEPS = 4  # local steps of the first round whose mean is the untrained model's loss
RUNG_FALL = 4.0  # the fall of the loss each rung up the ladder needs (sqrt: a doubling)
MAX_LOSS = 1e6  # a larger loss (cross-entropy: nats) is not measured (a diverging run, a lie)
MAX_RATIO = RUNG_FALL**64  # a fall beyond this allows no more: far above any ladder's rungs


class LossWindow:
    """One peer's training loss: the untrained model's (F_0) and the recent rounds' mean."""

    def __init__(self, rounds: int = LOSS_WINDOW_ROUNDS) -> None:
        checked_integer("loss window (rounds)", rounds, 1, 10**6)
        self._rounds: deque[float] = deque(maxlen=rounds)  # each round's mean step loss
        self._steps: list[float] = []  # the losses of the round in progress
        self.initial = 0.0  # the first round's mean loss (0: no round observed yet)

    def observe(self, loss: float) -> None:
        """One local step's minibatch loss; one outside 0 to `MAX_LOSS` (not finite, negative
        as a density's log-likelihood can be, or huge) is not counted."""
        if math.isfinite(loss) and 0.0 <= loss <= MAX_LOSS:
            self._steps.append(loss)

    def end_round(self) -> None:
        """Close the round: its mean joins the window (a round without steps adds nothing)."""
        if not self._steps:
            return
        if self.initial == 0.0 and not self._rounds:
            first = self._steps[:INITIAL_STEPS]
            self.initial = sum(first) / len(first)
        self._rounds.append(sum(self._steps) / len(self._steps))
        self._steps = []

    @property
    def recent(self) -> float:
        """The mean loss of the window's rounds (0: none observed)."""
        return sum(self._rounds) / len(self._rounds) if self._rounds else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"initial": self.initial, "rounds": list(self._rounds)}

    def load_state_dict(self, state: Any) -> None:
        """Take a saved window back; ValueError naming what is malformed (nothing changed)."""
        if not isinstance(state, dict) or set(state) != {"initial", "rounds"}:
            raise ValueError(f"expected keys ['initial', 'rounds'], got {quoted(state)}")
        rounds = state["rounds"]
        if not isinstance(rounds, list) or len(rounds) > (self._rounds.maxlen or 0):
            raise ValueError(
                f"rounds: expected a list of at most {self._rounds.maxlen} losses, got "
                f"{quoted(rounds)}"
            )
        initial = checked_number("initial", state["initial"], 0.0, MAX_LOSS)
        losses = [checked_number("rounds' loss", x, 0.0, MAX_LOSS) for x in rounds]
        self.initial = initial
        self._rounds.clear()
        self._rounds.extend(losses)
        self._steps = []


class LossAllowance:
    """The highest rung a link may reach as training progresses (module docstring)."""

    def __init__(self) -> None:
        self.ratio = 1.0  # the largest F_0 / F_t believed; 1 until the loss has fallen
        self.measured = False  # a majority of the members has reported both losses once

    def update(self, losses: Sequence[tuple[float, float]], members: int) -> None:
        """Take the (F_0, F_t) of the members that report both (each > 0) out of `members`:
        nothing changes until they are a majority."""
        checked_integer("members", members, 1)
        if 2 * len(losses) <= members:
            return
        for initial, recent in losses:
            checked_number("initial loss", initial, 0.0, MAX_LOSS, closed_low=False)
            checked_number("loss", recent, 0.0, MAX_LOSS, closed_low=False)
        fall = statistics.median_low(i for i, _ in losses) / statistics.median_high(
            r for _, r in losses
        )
        self.ratio = min(MAX_RATIO, max(self.ratio, fall))
        self.measured = True

    def highest(self, ladder: LevelCosts) -> int:
        """The highest level of `ladder` the fall allows: rung k needs a fall of 4^k."""
        levels = ladder.levels
        rung = int(math.log(self.ratio, RUNG_FALL) + 1e-9)  # 1e-9: 16.0 is 4^2, not 4^1.99..
        return levels[min(rung, len(levels) - 1)]
