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

With `clipping`, each neighbour's xh_j - xh_i (over the whole model) is clipped to the round's
radius before mixing (gossip/clipping.py); the public copies themselves are tracked unclipped,
so both ends of every edge still agree on them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import RESUME_PHASE, NamedParams, Neighbourhood
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, difference_norm
from gossipcomp.gossip.compressed import BroadcastCodec, compressed_spec, to_wire
from gossipcomp.gossip.state import (
    checked_tensors,
    load_edge_tensors,
    raw_copy_payload,
    raw_copy_spec,
    require_keys,
    restore_from_envelope,
    save_edge_tensors,
)
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec

PHASE = "choco"


class Choco:
    """Choco-SGD's gossip step with any compressor, `steps` times per round.

    Each step compresses x - xh afresh and exchanges it (phase "choco{s}"): more steps buy faster
    consensus with more bytes, which pays when peers' data differ (docs/benchmarks.md).
    """

    name = "choco"

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
        self.seed = seed
        self.steps = steps
        self.clipping = clipping
        self._codec: BroadcastCodec | None = None
        self._scales: list[float] = []  # 1 / (1 + beta) per tensor
        self.public: list[torch.Tensor] = []  # xh_i
        self.neighbour_public: dict[int, list[torch.Tensor]] = {}  # xh_j as tracked here

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._codec = BroadcastCodec(self.compressor, self.seed, rank)
        self._scales = [1.0 / (1.0 + self.compressor.variance_bound(p.numel())) for _, p in params]
        self.public = [torch.zeros_like(p, dtype=torch.float32) for _, p in params]
        self.neighbour_public = {j: [torch.zeros_like(t) for t in self.public] for j in neighbours}
        spec = compressed_spec(params, self.compressor)
        specs = {f"{PHASE}{s}": spec for s in range(self.steps)}
        specs[RESUME_PHASE] = raw_copy_spec(params)
        return specs

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        for s in range(self.steps):
            self._consensus_step(params, hood, s)

    def _consensus_step(self, params: NamedParams, hood: Neighbourhood, s: int) -> None:
        codec = self._codec
        if codec is None:
            raise RuntimeError("Choco.step before setup")
        key = hood.round * self.steps + s  # distinct compression randomness for every step
        with torch.no_grad():
            sent = [
                codec.compress(p.float() - self.public[i], key, i)
                for i, (_, p) in enumerate(params)
            ]
            payload = tuple(to_wire(n, c) for (n, _), c in zip(params, sent, strict=True))
            result = hood.exchange(f"{PHASE}{s}", payload)
            # first every tensor's public copies (own and tracked), then the mixing weights
            # (clipping needs the distances over all tensors), then the mixing
            for i in range(len(params)):
                scale = self._scales[i]
                own = codec.decompress_own(sent[i], key, i, self.public[i])
                self.public[i].add_(own, alpha=scale)
                for j, envelope in result.received.items():
                    tracked = self.neighbour_public[j][i]
                    tracked.add_(codec.decompress_from(envelope, i, tracked, key), alpha=scale)
            # only neighbours heard this step mix in; the others' weight stays with the peer
            weights = {j: hood.weights[j] for j in result.received}
            if self.clipping is not None:
                distances = {
                    j: difference_norm(self.neighbour_public[j], self.public) for j in weights
                }
                weights = clipped_weights(weights, distances, self.clipping)
            heard = sum(weights.values())
            for i, (_, p) in enumerate(params):
                # pull = sum_j w_ij (xh_j - xh_i) over them
                pull = torch.zeros_like(self.public[i])
                for j, w in weights.items():
                    pull.add_(self.neighbour_public[j][i], alpha=w)
                pull.add_(self.public[i], alpha=-heard)
                p.add_(pull.to(p.dtype), alpha=self.consensus_step)

    def resume_payload(self, params: NamedParams) -> Payload | None:
        """This peer's public copy, exactly: the neighbour replaces its tracked copy with it."""
        return raw_copy_payload(params, self.public)

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        restore_from_envelope(self.neighbour_public[neighbour], envelope, f"{self.name} resume")

    def state_dict(self) -> dict[str, Any]:
        return {
            "public": [t.clone() for t in self.public],
            "neighbour_public": save_edge_tensors(self.neighbour_public),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require_keys(state, {"public", "neighbour_public"}, self.name)
        public = checked_tensors(f"{self.name} public copy", self.public, state["public"])
        tracked = load_edge_tensors(
            f"{self.name} neighbours' public copies",
            self.neighbour_public,
            state["neighbour_public"],
        )
        self.public, self.neighbour_public = public, tracked
