"""Choco-SGD (Koloskova, Stich, Jaggi 2019): gossip of compressed differences to public copies.

Each peer keeps a public copy xh_i of its model, and a copy of each neighbour's public copy xh_j,
which it tracks exactly from what the neighbour sends (all start at 0). A round:
    q_i = C(x_i - xh_i); send q_i to every neighbour
    xh_i += D(q_i); xh_j += D(q_j) for each j heard; x_i += gamma sum_j w_ij (xh_j - xh_i)
With a symmetric doubly stochastic W the network sum of x is unchanged by a round, for any
compressor, biased or not. Keeping each neighbour's copy (rather than only the weighted sum
s_i = sum_j w_ij xh_j of the paper) costs one model per neighbour and buys two things: a
neighbour left out of a round is simply left out of the sum (its weight stays with the peer),
and an edge that comes back after a failure is resynchronised exactly by exchanging the public
copies once (`resume_payload`, `resume_edge`).

Choco needs a contractive compressor (E||C(x) - x||^2 <= (1 - w) ||x||^2); an unbiased one with
variance bound beta ||x||^2 (QSGD, TernGrad, unbiased random-k) is made contractive by scaling
its output by 1 / (1 + beta), as the Choco paper does; both ends scale the same bytes by the same
factor, so the public copies stay identical. gamma is the consensus step; by default the
compressor's `consensus_step`, measured on ring8 digits (docs/benchmarks.md).

Bandwidth-adaptive levels (`PeerLeveled`, levels/codecs.py): a peer compresses at its own
level (the lowest among its links in a coordinator's schedule, or the one it decides and
announces without a coordinator: levels/senders.py) and decodes each neighbour at that
neighbour's, computed from the same schedule or announced by it; both ends of an edge hold the
same two levels at every round. The 1 / (1 + beta) scale of a payload is its
sender's level's, at both ends. The consensus step of edge (i, j) is the smaller of the two
ends' levels' steps (unless a step is given), the same at both ends, so the network sum is kept
when neighbours compress at different levels.

With `clipping`, each neighbour's xh_j - xh_i (over the whole model) is clipped to the round's
radius before mixing (gossip/clipping.py); the public copies themselves are tracked unclipped,
so both ends of every edge still agree on them exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gossipcomp.compress import parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.broadcast import BroadcastGossip, KeyOfRound
from gossipcomp.gossip.clipping import ClipRadius
from gossipcomp.gossip.grouping import Grouping
from gossipcomp.gossip.specs import AUTO, BuildContext, Option, check_steps

PHASE = "choco"


class Choco(BroadcastGossip):
    """Choco-SGD's gossip step with any compressor, `steps` times per round.

    Each step compresses x - xh afresh and exchanges it (phase "choco{s}"): more steps buy faster
    consensus with more bytes, which pays when peers' data differ (docs/benchmarks.md). The
    parameters travel in the groups of the current schedule (gossip/grouping.py; one group per
    parameter by default), each compressed once, with its own compressor; the consensus step
    is `consensus_step` for every group, or each group's compressor's own when not given.
    """

    name = "choco"
    label = "Choco"
    OWN_COPY = ("public", "public copy")
    NEIGHBOUR_COPIES = ("neighbour_public", "neighbours' public copies")
    OPTIONS: ClassVar[dict[str, Option]] = {
        "compressor": Option(str, required=True, flag="compressor"),
        "steps": Option(int, 1, flag="gossip_steps"),
        # "auto" or unset: the compressor's own suggested step
        "gamma": Option(float, None, auto=True, flag="consensus_step"),
    }

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> Choco:
        return cls(**choco_arguments(options, context))

    def __init__(
        self,
        compressor: Compressor,
        consensus_step: float | None = None,
        seed: int = 0,
        steps: int = 1,
        clipping: ClipRadius | None = None,
    ):
        step = checked_choco_steps(self.name, compressor, consensus_step, steps)
        super().__init__(compressor, seed, clipping)
        self.consensus_step = step
        self._given_step = consensus_step
        self.steps = steps
        self._scales: dict[int, list[float]] = {}  # peer -> 1 / (1 + beta) per group, its level
        self._steps: dict[int, list[float]] = {}  # peer -> gamma per group at its level

    @property
    def public(self) -> list[torch.Tensor]:
        """xh_i, one flat buffer per group."""
        return self.own_copy

    @property
    def neighbour_public(self) -> dict[int, list[torch.Tensor]]:
        """xh_j as tracked here, per neighbour."""
        return self.tracked

    def _phases(self) -> dict[str, KeyOfRound]:
        # distinct compression randomness for every step
        return {f"{PHASE}{s}": lambda round, s=s: round * self.steps + s for s in range(self.steps)}

    def _initial_copy(self, params: NamedParams) -> list[torch.Tensor]:
        return self._require_codec().zeros()

    def _levels_changed(self, params: NamedParams) -> None:
        """Each peer's scales and steps per group at its level (the own ones from the codec's
        grouping, which compresses at this peer's level)."""
        ladder = self._require_levels()
        by_level = {ladder.own: self._require_codec().grouping}
        for level in set(ladder.levels.values()) - set(by_level):
            by_level[level] = ladder.grouping(params, self._groups, level)
        scales = {level: self._group_scales(g) for level, g in by_level.items()}
        steps = {level: self._group_steps(g) for level, g in by_level.items()}
        self._scales = {p: scales[level] for p, level in ladder.levels.items()}
        self._steps = {p: steps[level] for p, level in ladder.levels.items()}

    @staticmethod
    def _group_scales(grouping: Grouping) -> list[float]:
        return [1.0 / (1.0 + g.compressor.variance_bound(g.layout.numel)) for g in grouping.groups]

    def _group_steps(self, grouping: Grouping) -> list[float]:
        given = self._given_step
        return [g.compressor.consensus_step if given is None else given for g in grouping.groups]

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        for s in range(self.steps):
            self._consensus_step(params, hood, s)

    def _consensus_step(self, params: NamedParams, hood: Neighbourhood, s: int) -> None:
        codec = self._require_codec()
        key = hood.round * self.steps + s  # distinct compression randomness for every step
        with torch.no_grad():
            model = codec.flats([p for _, p in params])
            sent = [
                codec.compress(x.sub_(public), key, g)
                for g, (x, public) in enumerate(zip(model, self.own_copy, strict=True))
            ]
            result = hood.exchange(f"{PHASE}{s}", codec.payload(sent))
            # first every group's public copies (own and tracked), then the mixing weights
            # (clipping needs the distances over all groups), then the mixing
            self._add_to_copies(
                lambda g: codec.decompress_own(sent[g], key, g),
                result.received,
                lambda peer, g: self._scales[peer][g],
            )
            # only neighbours heard this step mix in; the others' weight stays with the peer
            weights = self._clipped({j: hood.weights[j] for j in result.received})
            pulls = []
            for g, public in enumerate(self.own_copy):
                # pull = sum_j gamma_ij w_ij (xh_j - xh_i) over them, with gamma_ij the smaller
                # of both ends' steps (symmetric: the network sum is kept), as gamma_i times
                # w_ij gamma_ij / gamma_i (w_ij itself when the ends' steps are equal)
                step = self._steps[self._me][g]
                edge = {j: w * (min(step, self._steps[j][g]) / step) for j, w in weights.items()}
                pull = public * -sum(edge.values())
                for j, w in edge.items():
                    pull.add_(self.tracked[j][g], alpha=w)
                pulls.append(pull.mul_(step))
            codec.add_into(params, pulls)


def choco_arguments(options: Mapping[str, Any], context: BuildContext) -> dict[str, Any]:
    """A Choco variant's constructor arguments from its spec's options (`OPTIONS`)."""
    gamma = options["gamma"]
    return {
        "compressor": parse_spec(options["compressor"]),
        "consensus_step": None if gamma in (None, AUTO) else float(gamma),
        "seed": context.seed,
        "steps": check_steps(options["steps"]),
        "clipping": context.clipping,
    }


def checked_choco_steps(
    name: str, compressor: Compressor, consensus_step: float | None, steps: int
) -> float:
    """The consensus step a Choco variant uses (the given one, or the compressor's own),
    checked to lie in (0, 1], with `steps` >= 1; ValueError naming the algorithm."""
    step = compressor.consensus_step if consensus_step is None else consensus_step
    if not 0.0 < step <= 1.0:
        raise ValueError(f"consensus_step must lie in (0, 1] for {name}, got {step}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return step
