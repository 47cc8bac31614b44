"""Drift correction for local steps on dissimilar data: gradient tracking from the gossip itself.

With H local steps between gossip rounds, each peer walks toward its own data's minimum, and
plain local steps stop at a biased point. Each peer keeps a correction d_i (a displacement per
phase) that it adds, d_i / H per local step, on top of its optimizer's steps; after gossip mixed
the phase's end models x_i into x_mix_i it moves the correction by what gossip moved it:

    d_i <- d_i + rate * (x_mix_i - x_i)

This is K-GT's tracking update (arXiv 2301.01313, c_i <- c_i - Delta_i + sum_j w_ij Delta_j)
read in parameter space: when the phase's anchors agree, x_mix_i - x_i is the neighbourhood's
average progress minus this peer's own, so d_i tracks (average progress - own progress) and
every peer moves by the network's average progress. Gossip with a symmetric, doubly
stochastic mixing preserves the sum of the models, so sum_i d_i stays 0 (Choco's compressed
mixing too): the corrections cancel, and at a fixed point the average gradient is zero. It costs
no bytes (the correction comes from the exchange the peers make anyway) and works with any
inner optimizer. rate 1 is K-GT's; with H = 1 and exact gossip (x_mix = M x, M = I - gamma
(I - W) for a consensus step gamma) it is Exact Diffusion/D^2, and on each eigenvalue lam of M
the linear recursion is stable only for rate < 2 (1 + lam) / (1 - lam). An over-relaxed step
(gamma* = 1.31 on an 8-ring, lam_min = -0.74) makes that 0.29, and rate 0.5 diverged there
(digits, by label). So the rate by default ("tracking") is `safe_tracking_rate`: half that
bound at the topology's lam_min and the algorithm's step, at most 0.5. Compressed gossip moves
less than exact gossip (its M is nearer I), so the bound holds for it too. Compressed gossip is not that linear recursion: it moves a part of the
disagreement (a rank-r subspace, a compressed copy) that changes every round, and the
correction then integrates a lagging signal; there, rates above 0.05 diverged on digits, and the
default is COMPRESSED_TRACKING_RATE (measured; an explicit rate overrides it).

SCAFFOLD's control variates (option II, server step 1) are this update at rate 1 where gossip
averages exactly: its local step adds -lr (c - c_i), a constant per phase, so d_i = -H lr (c -
c_i); its update c_i <- c_i - c + (x - y_i) / (H lr) with c <- mean c_i and x <- mean y_i
gives d_i <- d_i + (mean y - y_i), which is x_mix_i - x_i (tests/test_outer.py checks the two
against each other). Over sparse gossip, rate 1 is at or past the stability bound above (an
8-ring's Metropolis W has lam_min = -1/3: bound 1), so a SCAFFOLD-style correction is
`tracking:rate=1` on a complete graph and the safe rate elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gossipcomp.inputs.numbers import checked_number
from gossipcomp.inputs.text import quoted, spec_options
from gossipcomp.outer.optimizers import checked_finite, spec_of

DRIFT_CORRECTIONS = ("none", "tracking")
MAX_DEFAULT_TRACKING_RATE = 0.5
# the default rate over compressed gossip (PowerGossip, Choco, DEF-ATC), measured on ring8
# digits by label (docs/benchmarks.md, "Outer optimizers and drift correction"): 0.5 and
# the exact-gossip default diverged, 0.05 gained little, 0.01-0.02 gained most
COMPRESSED_TRACKING_RATE = 0.02
MAX_DRIFT_SPEC_CHARS = 100


@dataclass
class DriftTracker:
    """The correction d_i of one peer, one tensor per trained parameter."""

    rate: float | None = None  # None: set by the peer (`safe_tracking_rate`)
    correction: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.rate is not None:
            checked_number("drift tracking rate", self.rate, 0.0, 1.0, closed_low=False)

    @property
    def spec(self) -> str:
        return "tracking" if self.rate is None else f"tracking:rate={self.rate!r}"

    def for_mixing(
        self, smallest_eigenvalue: float, consensus_step: float, exact: bool
    ) -> DriftTracker:
        """This tracker with its rate set when none was given: `safe_tracking_rate` over
        exact gossip, and no more than COMPRESSED_TRACKING_RATE over compressed gossip."""
        if self.rate is not None:
            return self
        rate = safe_tracking_rate(smallest_eigenvalue, consensus_step)
        return DriftTracker(rate if exact else min(rate, COMPRESSED_TRACKING_RATE))

    def local_step(self, params: Sequence[torch.Tensor], steps_per_phase: int) -> None:
        """Add this phase's share of the correction after one local step."""
        with torch.no_grad():
            for p, d in zip(params, self.correction, strict=True):
                p.add_(d, alpha=1.0 / steps_per_phase)

    def update(self, ends: Sequence[torch.Tensor], mixed: Sequence[torch.Tensor]) -> None:
        """Move the correction by what gossip moved the phase's end models."""
        if not self.correction:
            self.correction = [torch.zeros_like(m) for m in mixed]
        if self.rate is None:
            raise ValueError("drift tracking: the rate is unset (see DriftTracker.for_mixing)")
        with torch.no_grad():
            for d, end, m in zip(self.correction, ends, mixed, strict=True):
                d.add_(m - end, alpha=self.rate)

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "correction": [d.clone() for d in self.correction]}

    def load_state_dict(self, state: Mapping[str, Any], like: Sequence[torch.Tensor]) -> None:
        if not isinstance(state, Mapping) or state.get("spec") != self.spec:
            raise ValueError(
                f"drift correction: saved {quoted(spec_of(state))}, this run uses {self.spec}"
            )
        self.correction = checked_finite(
            "drift correction", like, state.get("correction"), empty=True
        )


def parse_drift(spec: str) -> DriftTracker | None:
    """ "none" (None), "tracking" or "tracking:rate=R"; ValueError naming what is wrong."""
    if not isinstance(spec, str) or len(spec) > MAX_DRIFT_SPEC_CHARS:
        raise ValueError(
            f"drift correction: expected one of {', '.join(DRIFT_CORRECTIONS)} (at most "
            f"{MAX_DRIFT_SPEC_CHARS} characters), got {quoted(spec)}"
        )
    name, _, arguments = spec.strip().partition(":")
    name = name.strip()
    if name not in DRIFT_CORRECTIONS:
        raise ValueError(
            f"unknown drift correction {quoted(name)}; known: {', '.join(DRIFT_CORRECTIONS)}"
        )
    if name == "none":
        if arguments.strip():
            raise ValueError(
                f"drift correction none takes no options, got {quoted(arguments.strip())}"
            )
        return None
    options = spec_options(arguments, "drift correction tracking", ("rate",))
    rate = None
    if "rate" in options:
        try:
            rate = float(options["rate"])
        except ValueError:
            raise ValueError(
                f"drift correction tracking: rate expected a number, got {quoted(options['rate'])}"
            ) from None
    return DriftTracker(rate)


def safe_tracking_rate(smallest_eigenvalue: float, consensus_step: float = 1.0) -> float:
    """Half the largest stable rate on gossip x <- x + step (W x - x) whose W has
    `smallest_eigenvalue`, at most MAX_DEFAULT_TRACKING_RATE (see the module's docstring)."""
    lowest = 1.0 - consensus_step * (1.0 - smallest_eigenvalue)
    if lowest <= -1.0:
        raise ValueError(
            f"drift tracking: gossip with step {consensus_step:g} on a W whose smallest "
            f"eigenvalue is {smallest_eigenvalue:g} does not contract; expected a smaller step"
        )
    bound = 2.0 * (1.0 + lowest) / (1.0 - lowest) if lowest < 1.0 else math.inf
    return min(MAX_DEFAULT_TRACKING_RATE, bound / 2.0)
