"""Exact gossip averaging (D-PSGD, Lian et al. 2017): every round each peer sends its full model.

x_i <- x_i + gamma * sum_j w_ij (x_j - x_i), which for gamma = 1 is x_i <- sum_j w_ij x_j (with
w_ii = 1 - sum_j w_ij). gamma > 1 over-relaxes: gamma* = 2 / (2 - lambda_2 - lambda_min) of W
contracts disagreement fastest. A neighbour that failed this round is left out; its weight stays
with the peer itself, which keeps the live mixing matrix symmetric and doubly stochastic when
both ends of the edge miss each other. With `clipping`, each neighbour's difference x_j - x_i
(over the whole model) is clipped to the round's radius before mixing (gossip/clipping.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, difference_norm
from gossipcomp.gossip.specs import AUTO, BuildContext, Option
from gossipcomp.gossip.state import require_keys
from gossipcomp.transport.base import PayloadSpec
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec

MODEL_PHASE = "model"


class DPSGD:
    """Exact (uncompressed) gossip of every parameter."""

    name = "dpsgd"

    OPTIONS: ClassVar[dict[str, Option]] = {
        "gamma": Option(float, AUTO, auto=True, flag="consensus_step"),
    }

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> DPSGD:
        return cls(consensus_step=context.step(options["gamma"]), clipping=context.clipping)

    def __init__(
        self,
        consensus_step: float = 1.0,
        phase: str = MODEL_PHASE,
        clipping: ClipRadius | None = None,
    ) -> None:
        if not 0.0 < consensus_step < 2.0:
            raise ValueError(f"consensus_step must lie in (0, 2), got {consensus_step}")
        self.consensus_step = consensus_step
        self.phase = phase
        self.clipping = clipping

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        return {self.phase: tuple(tensor_spec(name, p) for name, p in params)}

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        payload = tuple(encode_raw(name, p) for name, p in params)
        result = hood.exchange(self.phase, payload)
        live = {j: hood.weights[j] for j in result.received}
        if not live:
            return
        theirs = {j: [decode_raw(t) for t in result.received[j].tensors] for j in live}
        with torch.no_grad():
            if self.clipping is not None:
                mine = [p for _, p in params]
                distances = {j: difference_norm(theirs[j], mine) for j in live}
                live = clipped_weights(live, distances, self.clipping)
            for index, (_, p) in enumerate(params):
                pull = torch.zeros_like(p)
                for j, w in live.items():
                    pull.add_(theirs[j][index], alpha=w)
                # sum_j w_ij (x_j - x_i) = pull - (sum_j w_ij) x_i
                pull.add_(p, alpha=-sum(live.values()))
                p.add_(pull, alpha=self.consensus_step)

    def state_dict(self) -> dict[str, Any]:
        return {}  # stateless: each round uses only the current parameters

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require_keys(state, set(), self.name)
