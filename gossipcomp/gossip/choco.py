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

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from gossipcomp.compress import parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import RESUME_PHASE, NamedParams, Neighbourhood
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, difference_norm
from gossipcomp.gossip.grouping import Grouping
from gossipcomp.gossip.merged import MergedCodec
from gossipcomp.gossip.specs import AUTO, BuildContext, Option, check_steps
from gossipcomp.gossip.state import (
    checked_tensors,
    load_edge_tensors,
    raw_copy_payload,
    raw_copy_spec,
    require_keys,
    restored_tensors,
    save_edge_tensors,
)
from gossipcomp.levels.codecs import BroadcastLevels
from gossipcomp.levels.rate import LevelCosts
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec

PHASE = "choco"


class Choco:
    """Choco-SGD's gossip step with any compressor, `steps` times per round.

    Each step compresses x - xh afresh and exchanges it (phase "choco{s}"): more steps buy faster
    consensus with more bytes, which pays when peers' data differ (docs/benchmarks.md). The
    parameters travel in the groups of the current schedule (gossip/grouping.py; one group per
    parameter by default), each compressed once, with its own compressor; the consensus step
    is `consensus_step` for every group, or each group's compressor's own when not given.
    """

    name = "choco"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "compressor": Option(str, required=True, flag="compressor"),
        "steps": Option(int, 1, flag="gossip_steps"),
        # "auto" or unset: the compressor's own suggested step
        "gamma": Option(float, None, auto=True, flag="consensus_step"),
    }

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> Choco:
        gamma = options["gamma"]
        return cls(
            parse_spec(options["compressor"]),
            consensus_step=None if gamma in (None, AUTO) else float(gamma),
            seed=context.seed,
            steps=check_steps(options["steps"]),
            clipping=context.clipping,
        )

    def __init__(
        self,
        compressor: Compressor,
        consensus_step: float | None = None,
        seed: int = 0,
        steps: int = 1,
        clipping: ClipRadius | None = None,
    ):
        step = compressor.consensus_step if consensus_step is None else consensus_step
        if not 0.0 < step <= 1.0:
            raise ValueError(f"consensus_step must lie in (0, 1] for choco, got {step}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.compressor = compressor
        self.consensus_step = step
        self._given_step = consensus_step
        self.seed = seed
        self.steps = steps
        self.clipping = clipping
        self._codec: MergedCodec | None = None
        self._levels: BroadcastLevels | None = None
        self._groups: tuple[TensorGroup, ...] | None = None  # the schedule's (None: default)
        self._me = 0
        self._scales: dict[int, list[float]] = {}  # peer -> 1 / (1 + beta) per group, its level
        self._steps: dict[int, list[float]] = {}  # peer -> gamma per group at its level
        self.public: list[torch.Tensor] = []  # xh_i, one flat buffer per group
        self.neighbour_public: dict[int, list[torch.Tensor]] = {}  # xh_j as tracked here

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._codec = MergedCodec(params, self.compressor, self.seed, rank)
        self._levels = BroadcastLevels(params, self.compressor, rank, neighbours)
        self._me, self._groups = rank, None
        self._adopt_levels(params)
        self.public = self._codec.zeros()
        self.neighbour_public = {j: self._codec.zeros() for j in neighbours}
        return self.specs(params, None)

    def specs(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> dict[str, PayloadSpec]:
        """Per phase, what a neighbour's envelope holds under `groups` (None or empty: one
        group per parameter with this algorithm's compressor), without changing anything."""
        codec = self._require_codec()
        grouping = codec.regrouped(params, groups)
        specs = {
            f"{PHASE}{s}": codec.spec(lambda round, s=s: round * self.steps + s, grouping)
            for s in range(self.steps)
        }
        specs[RESUME_PHASE] = raw_copy_spec(params)
        return specs

    def regroup(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Switch to `groups` (a schedule taking effect): state moves to the new buffers."""
        codec = self._require_codec()
        public = codec.per_parameter(self.public)
        tracked = {j: codec.per_parameter(t) for j, t in self.neighbour_public.items()}
        self._groups = tuple(groups) if groups else None
        levels = self._require_levels()
        levels.switch(params, self._groups, levels.levels, codec)
        self._adopt_levels(params)
        self.public = codec.flats(public)
        self.neighbour_public = {j: codec.flats(t) for j, t in tracked.items()}

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """The ladder of its compressor, with the bytes a round (`steps` payloads) sends."""
        return self._require_levels().costs(self.steps)

    def level_label(self, level: int) -> str:
        return self._require_levels().ladder.spec(level)

    def default_level(self) -> int:
        return self._require_levels().ladder.default

    def peer_specs(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, each neighbour's envelope under `groups`, compressed at its level."""
        codec, ladder = self._require_codec(), self._require_levels()
        specs: dict[str, Mapping[int, PayloadSpec] | PayloadSpec] = {
            f"{PHASE}{s}": ladder.specs_for(
                params, groups, levels, codec, lambda round, s=s: round * self.steps + s
            )
            for s in range(self.steps)
        }
        specs[RESUME_PHASE] = raw_copy_spec(params)
        return specs

    def set_peer_levels(self, params: NamedParams, levels: Mapping[int, int], round: int) -> None:
        """Compress at this peer's level in `levels` from now on, scaling and stepping each
        neighbour's payloads at its own."""
        self._require_levels().switch(params, self._groups, levels, self._require_codec())
        self._adopt_levels(params)

    def _adopt_levels(self, params: NamedParams) -> None:
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

    def _require_levels(self) -> BroadcastLevels:
        if self._levels is None:
            raise RuntimeError("Choco used before setup")
        return self._levels

    def _require_codec(self) -> MergedCodec:
        if self._codec is None:
            raise RuntimeError("Choco used before setup")
        return self._codec

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
                for g, (x, public) in enumerate(zip(model, self.public, strict=True))
            ]
            result = hood.exchange(f"{PHASE}{s}", codec.payload(sent))
            # first every group's public copies (own and tracked), then the mixing weights
            # (clipping needs the distances over all groups), then the mixing
            for g, scale in enumerate(self._scales[self._me]):
                self.public[g].add_(codec.decompress_own(sent[g], key, g), alpha=scale)
                for j, envelope in result.received.items():
                    self.neighbour_public[j][g].add_(
                        codec.decoded(envelope, g), alpha=self._scales[j][g]
                    )
            # only neighbours heard this step mix in; the others' weight stays with the peer
            weights = {j: hood.weights[j] for j in result.received}
            if self.clipping is not None:
                distances = {
                    j: difference_norm(self.neighbour_public[j], self.public) for j in weights
                }
                weights = clipped_weights(weights, distances, self.clipping)
            pulls = []
            for g, public in enumerate(self.public):
                # pull = sum_j gamma_ij w_ij (xh_j - xh_i) over them, with gamma_ij the smaller
                # of both ends' steps (symmetric: the network sum is kept), as gamma_i times
                # w_ij gamma_ij / gamma_i (w_ij itself when the ends' steps are equal)
                step = self._steps[self._me][g]
                edge = {j: w * (min(step, self._steps[j][g]) / step) for j, w in weights.items()}
                pull = public * -sum(edge.values())
                for j, w in edge.items():
                    pull.add_(self.neighbour_public[j][g], alpha=w)
                pulls.append(pull.mul_(step))
            codec.add_into(params, pulls)

    def resume_payload(self, params: NamedParams) -> Payload | None:
        """This peer's public copy, exactly: the neighbour replaces its tracked copy with it."""
        return raw_copy_payload(params, self._require_codec().per_parameter(self.public))

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        codec = self._require_codec()
        current = codec.per_parameter(self.neighbour_public[neighbour])
        restored = restored_tensors(current, envelope, f"{self.name} resume")
        self.neighbour_public[neighbour] = codec.flats(restored)

    def state_dict(self) -> dict[str, Any]:
        codec = self._require_codec()
        return {
            "public": [t.clone() for t in codec.per_parameter(self.public)],
            "neighbour_public": save_edge_tensors(
                {j: codec.per_parameter(t) for j, t in self.neighbour_public.items()}
            ),
            "feedback": codec.feedback_memories(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        codec = self._require_codec()
        if isinstance(state, dict):  # older checkpoints saved no feedback memories
            state = {"feedback": {}, **state}
        require_keys(state, {"public", "neighbour_public", "feedback"}, self.name)
        public = checked_tensors(
            f"{self.name} public copy", codec.per_parameter(self.public), state["public"]
        )
        tracked = load_edge_tensors(
            f"{self.name} neighbours' public copies",
            {j: codec.per_parameter(t) for j, t in self.neighbour_public.items()},
            state["neighbour_public"],
        )
        codec.load_feedback_memories(state["feedback"])  # checks all, then assigns
        self.public = codec.flats(public)
        self.neighbour_public = {j: codec.flats(t) for j, t in tracked.items()}
