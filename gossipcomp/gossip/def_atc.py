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

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gossipcomp.compress import parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.broadcast import BroadcastGossip, KeyOfRound
from gossipcomp.gossip.clipping import ClipRadius
from gossipcomp.gossip.specs import BuildContext, Option

PHASE = "def"

# Sparsifiers leave most of delta in the error memory; with zeta = 1 the references then
# overshoot and training diverged on ring8 digits, while (0.5, 0.2) reached 0.966 with top-1%
# (docs/benchmarks.md). Dense and sign-like compressors work with the undamped (1, 1).


def default_def_steps(compressor: Compressor) -> tuple[float, float]:
    """Documented default (zeta, gamma) for a compressor."""
    return (0.5, 0.2) if compressor.sparsifying else (1.0, 1.0)


class DEFATC(BroadcastGossip):
    """Differential error feedback (DEF-ATC) with any compressor.

    The parameters travel in the groups of the current schedule (gossip/grouping.py; one group
    per parameter by default), each group compressed once; references and the error memory are
    kept as one flat buffer per group and saved per parameter, so checkpoints and regrouping
    do not depend on the grouping.
    """

    name = "def"
    label = "DEF-ATC"
    OWN_COPY = ("reference", "reference")
    NEIGHBOUR_COPIES = ("neighbour_references", "neighbour references")
    MEMORIES = (("error", "error memory"),)
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
        super().__init__(compressor, seed, clipping)
        self.zeta = zeta
        self.gamma = gamma

    @property
    def reference(self) -> list[torch.Tensor]:
        """phi_k, one flat buffer per group."""
        return self.own_copy

    @property
    def neighbour_references(self) -> dict[int, list[torch.Tensor]]:
        """phi_l as tracked here, per neighbour."""
        return self.tracked

    @property
    def error(self) -> list[torch.Tensor]:
        """z, one flat buffer per group."""
        return self.memories["error"]

    def _phases(self) -> dict[str, KeyOfRound]:
        return {PHASE: lambda round: round}

    def _initial_copy(self, params: NamedParams) -> list[torch.Tensor]:
        return self._require_codec().flats([p for _, p in params])  # the identical initial model

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        codec = self._require_codec()
        with torch.no_grad():
            model = codec.flats([p for _, p in params])
            sent, own = [], []
            for g, (delta, reference) in enumerate(zip(model, self.own_copy, strict=True)):
                delta.sub_(reference).add_(self.error[g])
                compressed = codec.compress(delta, hood.round, g)
                decoded = codec.decompress_own(compressed, hood.round, g)
                self.error[g] = delta.sub_(decoded)
                sent.append(compressed)
                own.append(decoded)
            result = hood.exchange(PHASE, codec.payload(sent))
            self._add_to_copies(own.__getitem__, result.received, lambda peer, g: self.zeta)
            # every live neighbour combines, with its last reference when it failed this round
            weights = self._clipped(hood.weights)
            self_weight = hood.self_weight if self.clipping is None else 1.0 - sum(weights.values())
            mixed = []
            for g, reference in enumerate(self.own_copy):
                combined = reference * self_weight
                for j, w in weights.items():
                    combined.add_(self.tracked[j][g], alpha=w)
                mixed.append(combined.mul_(self.gamma).add_(reference, alpha=1.0 - self.gamma))
            codec.copy_into(params, mixed)
