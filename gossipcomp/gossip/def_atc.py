"""DEF-ATC: differential error feedback with adapt-then-combine diffusion.

Nassif, Vlaski, Carpentiero, Matta, Sayed (IEEE TSP 2025, arXiv 2406.18418). Each peer k keeps a
reference phi of itself and of each neighbour (all start at the identical initial model) and an
error memory z. After the local (adapt) step gave psi_k = w_k:
    delta = psi_k - phi_k + z ; q = C(delta) ; z = delta - D(q)
    phi_l += zeta D(q_l) for l in N(k) and k         (references, updated on receipt)
    w_k = (1 - gamma) phi_k + gamma sum_l a_lk phi_l  (combine, l in N(k) and k)
zeta in (0, 1] damps the differential update, gamma in (0, 1] mixes. With the identity
compressor and zeta = gamma = 1 a round is exactly one D-PSGD (ATC diffusion) round. A neighbour
that fails a round keeps its last reference in the combine; a neighbour left out after a failure
gives its weight to the peer, and when the edge comes back both ends send their own reference
exactly once (`resume_payload`), so each end's copy of the other's reference is exact again.

Bandwidth-adaptive levels (`PeerLeveled`, levels/codecs.py): a peer compresses at its own
level (the lowest among its links in a coordinator's schedule, or the one it decides and
announces without a coordinator: levels/senders.py) and decodes each neighbour at that
neighbour's, computed from the same schedule or announced by it. zeta and gamma stay those of the configured
compressor at every level: zeta must be the sender's at every end that tracks its reference,
and one pair for all keeps that true without a table of pairs.

The combine is w_k = phi_k + gamma sum_l a_lk (phi_l - phi_k) (l in N(k)), computed as above with
a_kk = 1 - sum_l a_lk. With `clipping`, each phi_l - phi_k (over the whole model) is clipped to
the round's radius, i.e. a_lk becomes a_lk min(1, tau / ||phi_l - phi_k||) and a_kk takes the
rest (gossip/clipping.py); the references themselves are tracked unclipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from gossipcomp.compress import parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import RESUME_PHASE, NamedParams, Neighbourhood
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, difference_norm
from gossipcomp.gossip.merged import MergedCodec
from gossipcomp.gossip.specs import BuildContext, Option
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

PHASE = "def"

# Sparsifiers leave most of delta in the error memory; with zeta = 1 the references then
# overshoot and training diverged on ring8 digits, while (0.5, 0.2) reached 0.966 with top-1%
# (docs/benchmarks.md). Dense and sign-like compressors work with the undamped (1, 1).


def default_def_steps(compressor: Compressor) -> tuple[float, float]:
    """Documented default (zeta, gamma) for a compressor."""
    return (0.5, 0.2) if compressor.sparsifying else (1.0, 1.0)


class DEFATC:
    """Differential error feedback (DEF-ATC) with any compressor.

    The parameters travel in the groups of the current schedule (gossip/grouping.py; one group
    per parameter by default), each group compressed once; references and the error memory are
    kept as one flat buffer per group and saved per parameter, so checkpoints and regrouping
    do not depend on the grouping.
    """

    name = "def"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "compressor": Option(str, required=True, flag="compressor"),
        "zeta": Option(float, None, flag="zeta"),  # unset: default_def_steps
        "gamma": Option(float, None, flag="gamma"),
    }

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> DEFATC:
        return cls(
            parse_spec(options["compressor"]),
            zeta=options["zeta"],
            gamma=options["gamma"],
            seed=context.seed,
            clipping=context.clipping,
        )

    def __init__(
        self,
        compressor: Compressor,
        zeta: float | None = None,
        gamma: float | None = None,
        seed: int = 0,
        clipping: ClipRadius | None = None,
    ) -> None:
        default_zeta, default_gamma = default_def_steps(compressor)
        zeta = default_zeta if zeta is None else zeta
        gamma = default_gamma if gamma is None else gamma
        for label, value in (("zeta", zeta), ("gamma", gamma)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{label} must lie in (0, 1], got {value}")
        self.compressor = compressor
        self.zeta = zeta
        self.gamma = gamma
        self.seed = seed
        self.clipping = clipping
        self._codec: MergedCodec | None = None
        self._levels: BroadcastLevels | None = None
        self._groups: tuple[TensorGroup, ...] | None = None  # the schedule's (None: default)
        self.reference: list[torch.Tensor] = []  # phi_k, one flat buffer per group
        self.neighbour_references: dict[int, list[torch.Tensor]] = {}  # phi_l
        self.error: list[torch.Tensor] = []  # z

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._codec = MergedCodec(params, self.compressor, self.seed, rank)
        self._levels = BroadcastLevels(params, self.compressor, rank, neighbours)
        self._groups = None
        initial = self._codec.flats([p for _, p in params])
        self.reference = [t.clone() for t in initial]
        self.neighbour_references = {j: [t.clone() for t in initial] for j in neighbours}
        self.error = self._codec.zeros()
        return self.specs(params, None)

    def specs(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> dict[str, PayloadSpec]:
        """Per phase, what a neighbour's envelope holds under `groups` (None or empty: one
        group per parameter with this algorithm's compressor), without changing anything."""
        codec = self._require_codec()
        grouping = codec.regrouped(params, groups)
        return {
            PHASE: codec.spec(lambda round: round, grouping),
            RESUME_PHASE: raw_copy_spec(params),
        }

    def regroup(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Switch to `groups` (a schedule taking effect): state moves to the new buffers."""
        codec = self._require_codec()
        reference, error = codec.per_parameter(self.reference), codec.per_parameter(self.error)
        tracked = {j: codec.per_parameter(t) for j, t in self.neighbour_references.items()}
        self._groups = tuple(groups) if groups else None
        levels = self._require_levels()
        levels.switch(params, self._groups, levels.levels, codec)
        self.reference, self.error = codec.flats(reference), codec.flats(error)
        self.neighbour_references = {j: codec.flats(t) for j, t in tracked.items()}

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """The ladder of its compressor, with the bytes a round sends each neighbour."""
        return self._require_levels().costs(1)

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
        return {
            PHASE: ladder.specs_for(params, groups, levels, codec, lambda round: round),
            RESUME_PHASE: raw_copy_spec(params),
        }

    def set_peer_levels(self, params: NamedParams, levels: Mapping[int, int], round: int) -> None:
        """Compress at this peer's level in `levels` from now on (neighbours' payloads are
        decoded at theirs by the transport, from `peer_specs`)."""
        self._require_levels().switch(params, self._groups, levels, self._require_codec())

    def _require_levels(self) -> BroadcastLevels:
        if self._levels is None:
            raise RuntimeError("DEF-ATC used before setup")
        return self._levels

    def _require_codec(self) -> MergedCodec:
        if self._codec is None:
            raise RuntimeError("DEF-ATC used before setup")
        return self._codec

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        codec = self._require_codec()
        with torch.no_grad():
            model = codec.flats([p for _, p in params])
            sent, own = [], []
            for g, (delta, reference) in enumerate(zip(model, self.reference, strict=True)):
                delta.sub_(reference).add_(self.error[g])
                compressed = codec.compress(delta, hood.round, g)
                decoded = codec.decompress_own(compressed, hood.round, g)
                self.error[g] = delta.sub_(decoded)
                sent.append(compressed)
                own.append(decoded)
            result = hood.exchange(PHASE, codec.payload(sent))
            for g, reference in enumerate(self.reference):
                reference.add_(own[g], alpha=self.zeta)
                for j, envelope in result.received.items():
                    self.neighbour_references[j][g].add_(
                        codec.decoded(envelope, g), alpha=self.zeta
                    )
            # every live neighbour combines, with its last reference when it failed this round
            weights, self_weight = hood.weights, hood.self_weight
            if self.clipping is not None:
                distances = {
                    j: difference_norm(self.neighbour_references[j], self.reference)
                    for j in weights
                }
                weights = clipped_weights(weights, distances, self.clipping)
                self_weight = 1.0 - sum(weights.values())
            mixed = []
            for g, reference in enumerate(self.reference):
                combined = reference * self_weight
                for j, w in weights.items():
                    combined.add_(self.neighbour_references[j][g], alpha=w)
                mixed.append(combined.mul_(self.gamma).add_(reference, alpha=1.0 - self.gamma))
            codec.copy_into(params, mixed)

    def resume_payload(self, params: NamedParams) -> Payload | None:
        """This peer's reference phi_k, exactly: the neighbour replaces its copy with it."""
        return raw_copy_payload(params, self._require_codec().per_parameter(self.reference))

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        codec = self._require_codec()
        current = codec.per_parameter(self.neighbour_references[neighbour])
        restored = restored_tensors(current, envelope, f"{self.name} resume")
        self.neighbour_references[neighbour] = codec.flats(restored)

    def state_dict(self) -> dict[str, Any]:
        codec = self._require_codec()
        return {
            "reference": [t.clone() for t in codec.per_parameter(self.reference)],
            "neighbour_references": save_edge_tensors(
                {j: codec.per_parameter(t) for j, t in self.neighbour_references.items()}
            ),
            "error": [t.clone() for t in codec.per_parameter(self.error)],
            "feedback": codec.feedback_memories(),  # ef+... compressors' memories
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        codec = self._require_codec()
        if isinstance(state, dict):  # older checkpoints saved no feedback memories
            state = {"feedback": {}, **state}
        require_keys(state, {"reference", "neighbour_references", "error", "feedback"}, self.name)
        reference = checked_tensors(
            f"{self.name} reference", codec.per_parameter(self.reference), state["reference"]
        )
        error = checked_tensors(
            f"{self.name} error memory", codec.per_parameter(self.error), state["error"]
        )
        neighbours = load_edge_tensors(
            f"{self.name} neighbour references",
            {j: codec.per_parameter(t) for j, t in self.neighbour_references.items()},
            state["neighbour_references"],
        )
        codec.load_feedback_memories(state["feedback"])  # checks all, then assigns
        self.reference, self.error = codec.flats(reference), codec.flats(error)
        self.neighbour_references = {j: codec.flats(t) for j, t in neighbours.items()}
