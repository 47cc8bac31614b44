"""Choco-SGD with a public copy per edge, so that each link can compress at its own level.

Choco (gossip/choco.py) broadcasts one compressed difference a step to every neighbour, so a
peer's level is its own: the lowest its links allow. On a ring whose one slow link has two ends,
that drags half the peers' links to the slow link's level, and a level per peer measured no
faster to a target than the floor for every link (docs/benchmarks.md, "In training, on the ring
of the adaptive benchmark"). Here each edge (i, j) carries its own pair of copies instead:
xh_ij (i's copy as j tracks it) and xh_ji, held identically at both ends. A step, for each
neighbour j heard:
    q_ij = C_ij(x_i - xh_ij), sent to j alone; xh_ij += s_ij D(q_ij); xh_ji += s_ij D(q_ji)
    x_i += sum_j gamma_ij w_ij (xh_ji - xh_ij)
with C_ij the compressor of the edge's level, s_ij its 1 / (1 + beta) scale (1 for a
contractive compressor: Choco's scaling of an unbiased one) and gamma_ij its consensus step
(or the one given). Both ends use the same level, scale and step, and their pulls along an edge
are equal and opposite, so a round keeps the network sum for any levels (with a fixed clip
radius or none: an adaptive radius is each peer's own, as in Choco). With every link at
one level and a deterministic compressor (top-k), every xh_ij of a peer equals Choco's xh_i and
the two algorithms agree up to float rounding (their sums are ordered differently); a link costs what Choco's broadcast costs it, and a peer
compresses once per neighbour rather than once.

Levels are LinkLeveled, as PowerGossip's ranks: a coordinator's schedule sets each link's, or
the lower-ranked end decides it (levels/edges.py); both ends switch at the same round. The
ladder and its floor are the broadcast's (levels/codecs.py). A resumed edge restarts both its
copies at zero, as at the start, at both ends: nothing needs to travel to agree on them, and
until they fill up again the edge mixes less. Error-feedback compressors (ef+...) are refused:
Choco's copies already carry the compression error forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from gossipcomp.compress import ErrorFeedback
from gossipcomp.compress.base import Compressed, CompressionContext, Compressor
from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.broadcast import KeyOfRound
from gossipcomp.gossip.choco import Choco, checked_choco_steps, choco_arguments
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, difference_norm
from gossipcomp.gossip.grouping import Grouping, to_wire
from gossipcomp.gossip.merged import decoded_group, decoding_spec
from gossipcomp.gossip.specs import BuildContext, Option
from gossipcomp.gossip.state import load_edge_tensors, require_keys, save_edge_tensors
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.codecs import BroadcastLevels
from gossipcomp.levels.rate import LevelCosts
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec

PHASE = "choco"


class EdgeChoco:
    """Choco-SGD's gossip step with a pair of public copies and a level per edge."""

    name = "choco-edge"
    label = "Choco per edge"
    OPTIONS: ClassVar[dict[str, Option]] = Choco.OPTIONS

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> EdgeChoco:
        return cls(**choco_arguments(options, context))

    def __init__(
        self,
        compressor: Compressor,
        consensus_step: float | None = None,
        seed: int = 0,
        steps: int = 1,
        clipping: ClipRadius | None = None,
    ) -> None:
        if isinstance(compressor, ErrorFeedback):
            raise ValueError(
                f"{self.label}: compressor {compressor.spec!r} keeps an error-feedback memory; "
                "expected one without (the public copies already carry the error forward)"
            )
        self.compressor = compressor
        self.consensus_step = checked_choco_steps(self.name, compressor, consensus_step, steps)
        self._given_step = consensus_step
        self.steps = steps
        self.seed = seed
        self.clipping = clipping
        self._me = -1
        self._neighbours: list[int] = []
        self._device = torch.device("cpu")  # the model's: the copies live beside it
        self._ladder: BroadcastLevels | None = None
        self._layout: Grouping | None = None  # the buffers' groups at the default level
        self._by_level: dict[int, Grouping] = {}  # every usable level's compressors
        self._link_levels: dict[int, int] = {}  # neighbour -> its edge's level
        self.own: dict[int, list[torch.Tensor]] = {}  # neighbour -> xh_ij, one flat per group
        self.theirs: dict[int, list[torch.Tensor]] = {}  # neighbour -> xh_ji as tracked here

    # --- setup, specs, regrouping and levels ------------------------------------------------

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._me, self._neighbours = rank, list(neighbours)
        self._device = params[0][1].device if params else torch.device("cpu")
        self._ladder = BroadcastLevels(params, self.compressor, rank, neighbours)
        self._link_levels = dict.fromkeys(neighbours, self._ladder.ladder.default)
        self._use_groups(params, None)
        zeros = self._zeros()
        self.own = {j: [t.clone() for t in zeros] for j in neighbours}
        self.theirs = {j: [t.clone() for t in zeros] for j in neighbours}
        return self.specs(params, None)

    def _use_groups(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Build the groupings of `groups` at every level a link may use."""
        ladder = self._require_ladder()
        levels = {*self.level_costs(params).levels, ladder.ladder.default}
        self._by_level = {level: self._grouping(params, groups, level) for level in levels}
        self._layout = self._by_level[ladder.ladder.default]

    def _grouping(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None, level: int
    ) -> Grouping:
        """`groups` at `level`; ValueError for a group whose compressor keeps an
        error-feedback memory (a schedule's group may name one)."""
        grouping = self._require_ladder().grouping(params, groups, level)
        for group in grouping.groups:
            if isinstance(group.compressor, ErrorFeedback):
                raise ValueError(
                    f"{self.label}: group {quoted(group.name)} is compressed with "
                    f"{quoted(group.compressor.spec)}, which keeps an error-feedback memory; "
                    "expected a compressor without"
                )
        return grouping

    def _zeros(self) -> list[torch.Tensor]:
        layout = self._require_layout()
        return [torch.zeros(g.layout.numel, device=self._device) for g in layout.groups]

    def _checked_levels(self, params: NamedParams, levels: Mapping[int, int]) -> dict[int, int]:
        """Every neighbour's link level under `levels` (one not listed: the default);
        ValueError naming the link for a neighbour this peer lacks or a level it cannot use."""
        ladder = self._require_ladder()
        usable = self.level_costs(params).levels
        chosen = dict.fromkeys(self._neighbours, ladder.ladder.default)
        for j, level in levels.items():
            if j not in chosen:
                raise ValueError(f"link level for peer {j}, which is not a neighbour")
            checked = ladder.ladder.check(level, f"link level for peer {j}")
            if checked not in usable:
                raise ValueError(
                    f"link level for peer {j}: {checked} is below the floor {min(usable)} "
                    f"({ladder.ladder.spec(min(usable))})"
                )
            chosen[j] = checked
        return chosen

    def specs(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, what each neighbour's envelope holds under `groups` at the links'
        current levels, changing nothing."""
        return self.link_specs(params, groups, self._link_levels)

    def link_specs(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, each neighbour's envelope under `groups` with its link at its level in
        `levels`: one spec when every link has the same level."""
        chosen = self._checked_levels(params, levels)
        ladder = self._require_ladder()
        by_level = {level: self._grouping(params, groups, level) for level in set(chosen.values())}
        specs: dict[str, Mapping[int, PayloadSpec] | PayloadSpec] = {}
        for s in range(self.steps):
            key = self._key_of(s)
            spec = {level: self._spec(grouping, key) for level, grouping in by_level.items()}
            if len(spec) == 1:
                specs[f"{PHASE}{s}"] = next(iter(spec.values()))
            elif not spec:  # no neighbour: nothing will arrive
                specs[f"{PHASE}{s}"] = self._spec(
                    self._grouping(params, groups, ladder.ladder.default), key
                )
            else:
                specs[f"{PHASE}{s}"] = {j: spec[level] for j, level in chosen.items()}
        return specs

    def _key_of(self, s: int) -> KeyOfRound:
        """Step `s`'s compression key of a round: distinct randomness for every step."""
        return lambda round: round * self.steps + s

    def _spec(self, grouping: Grouping, key_of_round: KeyOfRound) -> PayloadSpec:
        """A neighbour's envelope under `grouping`, decoded as sent to this peer alone."""
        return decoding_spec(grouping, self.seed, self._me, key_of_round)

    def regroup(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Switch to `groups` (a schedule taking effect): the copies move to the new buffers."""
        layout = self._require_layout()
        own = {j: layout.views(t) for j, t in self.own.items()}
        theirs = {j: layout.views(t) for j, t in self.theirs.items()}
        self._use_groups(params, groups)
        layout = self._require_layout()
        self.own = {j: layout.flats(t) for j, t in own.items()}
        self.theirs = {j: layout.flats(t) for j, t in theirs.items()}

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """The ladder of its compressor from the floor up, with the bytes a round sends one
        neighbour at each."""
        return self._require_ladder().costs(self.steps)

    def level_label(self, level: int) -> str:
        return self._require_ladder().ladder.spec(level)

    def set_levels(self, levels: Mapping[int, int], round: int) -> None:
        """Compress each link at its level in `levels` (others: the default) from `round`
        on; the copies stay (levels change compressors, never the groups)."""
        default = self._require_ladder().ladder.default
        chosen = {j: levels.get(j, default) for j in self._neighbours}
        unknown = sorted(set(chosen.values()) - set(self._by_level))
        if unknown:
            raise ValueError(f"{self.label}: link levels {unknown} were not checked by link_specs")
        self._link_levels = chosen

    # --- a step -------------------------------------------------------------------------------

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        for s in range(self.steps):
            self._consensus_step(params, hood, s)

    def _context(self, receiver: int, key: int, group: int) -> CompressionContext:
        return CompressionContext(self.seed, self._me, receiver, key, group)

    def _consensus_step(self, params: NamedParams, hood: Neighbourhood, s: int) -> None:
        layout = self._require_layout()
        key = hood.round * self.steps + s
        with torch.no_grad():
            model = layout.flats([p for _, p in params])
            sent: dict[int, list[Compressed]] = {}
            outgoing: dict[int, Payload] = {}
            for j in hood.neighbours:
                groups = self._by_level[self._link_levels[j]].groups
                sent[j] = [
                    g.compressor.compress(x - own, self._context(j, key, index))
                    for index, (g, x, own) in enumerate(
                        zip(groups, model, self.own[j], strict=True)
                    )
                ]
                outgoing[j] = tuple(
                    to_wire(g.name, c) for g, c in zip(groups, sent[j], strict=True)
                )
            result = hood.exchange(f"{PHASE}{s}", outgoing)
            for j, envelope in result.received.items():
                self._add_to_edge(j, sent[j], envelope, key)
            weights = self._clipped({j: hood.weights[j] for j in result.received})
            pulls = [torch.zeros_like(x) for x in model]
            for j, w in weights.items():
                for g, (pull, mine, theirs) in enumerate(
                    zip(pulls, self.own[j], self.theirs[j], strict=True)
                ):
                    weight = w * self._step_of(j, g)
                    pull.add_(theirs, alpha=weight).sub_(mine, alpha=weight)
            layout.add_into(params, pulls)

    def _add_to_edge(self, j: int, sent: list[Compressed], envelope: Envelope, key: int) -> None:
        """xh_ij += s D(q_ij) (what this peer sent j, decoded as j decodes it) and
        xh_ji += s D(q_ji) (decoded by the transport at receipt), group by group."""
        groups = self._by_level[self._link_levels[j]].groups
        for index, (g, compressed) in enumerate(zip(groups, sent, strict=True)):
            scale = 1.0 / (1.0 + g.compressor.variance_bound(g.layout.numel))
            # both decoded from wire bytes on the host; the copies live beside the model
            mine = g.compressor.decompress(compressed, self._context(j, key, index))
            self.own[j][index].add_(mine.to(self._device), alpha=scale)
            theirs = decoded_group(envelope, index)
            self.theirs[j][index].add_(theirs.to(self._device), alpha=scale)

    def _step_of(self, j: int, group: int) -> float:
        """gamma of edge (this peer, j) for `group`: the given step, or its level's
        compressor's (both ends hold the same level)."""
        if self._given_step is not None:
            return self._given_step
        return self._by_level[self._link_levels[j]].groups[group].compressor.consensus_step

    def _clipped(self, weights: Mapping[int, float]) -> Mapping[int, float]:
        """`weights`, each clipped by the distance between the edge's two copies (over the
        whole model) when clipping is on (gossip/clipping.py)."""
        if self.clipping is None:
            return weights
        distances = {j: difference_norm(self.theirs[j], self.own[j]) for j in weights}
        return clipped_weights(weights, distances, self.clipping)

    # --- edges that come back, checkpoints -----------------------------------------------------

    def resume_payload(self, params: NamedParams) -> Payload | None:
        return None  # both ends restart the edge's copies at zero: nothing to send

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        zeros = self._zeros()
        self.own[neighbour] = [t.clone() for t in zeros]
        self.theirs[neighbour] = [t.clone() for t in zeros]

    def state_dict(self) -> dict[str, Any]:
        layout = self._require_layout()
        return {
            "own_copies": save_edge_tensors({j: layout.views(t) for j, t in self.own.items()}),
            "neighbour_copies": save_edge_tensors(
                {j: layout.views(t) for j, t in self.theirs.items()}
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require_keys(state, {"own_copies", "neighbour_copies"}, self.name)
        layout = self._require_layout()
        own = load_edge_tensors(
            f"{self.name} own copies",
            {j: layout.views(t) for j, t in self.own.items()},
            state["own_copies"],
        )
        theirs = load_edge_tensors(
            f"{self.name} neighbours' copies",
            {j: layout.views(t) for j, t in self.theirs.items()},
            state["neighbour_copies"],
        )
        self.own = {j: layout.flats(t) for j, t in own.items()}
        self.theirs = {j: layout.flats(t) for j, t in theirs.items()}

    def _require_ladder(self) -> BroadcastLevels:
        if self._ladder is None:
            raise RuntimeError(f"{self.label} used before setup")
        return self._ladder

    def _require_layout(self) -> Grouping:
        if self._layout is None:
            raise RuntimeError(f"{self.label} used before setup")
        return self._layout
