"""A lying peer, for robustness experiments: it gossips an attacked model and trains honestly.

`Byzantine(inner, attack)` wraps any gossip algorithm. Each round it swaps the peer's parameters
for attacked ones (e.g. -4 x), runs the inner algorithm's step on them, so that everything the
inner algorithm sends derives from the attacked model (Choco's public copies and DEF-ATC's
references then track the attacked model consistently at both ends of every edge), and then puts
the peer's own parameters back: the liar does not mix what its neighbours sent, and keeps
training on its own data. Attacks are built by name from `ATTACKS` (`make_attack`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossipcomp.gossip.base import GossipAlgorithm, NamedParams, Neighbourhood, Resumable
from gossipcomp.gossip.catalog import ATTACK_NAMES, DEFAULT_SCALE
from gossipcomp.inputs.numbers import checked_number
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec

# attack name -> what the liar sends in place of its parameter x, given the scale: sign_flip
# -scale x (pulls neighbours the wrong way), scale: scale x (drags their weights up, or to 0)
ATTACKS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = dict(
    zip(ATTACK_NAMES, (lambda x, scale: x * -scale, lambda x, scale: x * scale), strict=True)
)


@dataclass(frozen=True)
class Attack:
    """A named attack with its scale; `apply` gives what is sent in place of a parameter."""

    name: str = "sign_flip"
    scale: float = DEFAULT_SCALE

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack {self.name!r}; known: {sorted(ATTACKS)}")
        checked_number("attack scale", self.scale, 0.0, closed_low=False)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return ATTACKS[self.name](tensor, self.scale)


def make_attack(name: str, scale: float = DEFAULT_SCALE) -> Attack:
    """A registered attack; an unknown name or a bad scale raises ValueError naming it."""
    return Attack(name, scale)


class Byzantine:
    """`inner`, gossiping an attacked copy of the model; the peer's own model is kept.

    Resumable exactly when `inner` is (the instance is then a `ResumableByzantine`), so a peer
    resynchronises the liar's edges the way the inner algorithm does.
    """

    def __new__(cls, inner: GossipAlgorithm, attack: Attack) -> Byzantine:
        if cls is Byzantine and isinstance(inner, Resumable):
            cls = ResumableByzantine
        return super().__new__(cls)

    def __init__(self, inner: GossipAlgorithm, attack: Attack) -> None:
        self.inner = inner
        self.attack = attack
        self.name = inner.name  # the same wire phases, state and configuration as `inner`

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        return self.inner.setup(params, rank, neighbours)

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        with torch.no_grad():
            own = [p.detach().clone() for _, p in params]
            for _, p in params:
                p.copy_(self.attack.apply(p))
            try:
                self.inner.step(params, hood)
            finally:
                for (_, p), mine in zip(params, own, strict=True):
                    p.copy_(mine)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class ResumableByzantine(Byzantine):
    """A `Byzantine` around a Resumable algorithm: edge resynchronisation delegates to it."""

    inner: Any  # a Resumable GossipAlgorithm

    def resume_payload(self, params: NamedParams) -> Payload | None:
        """What the inner algorithm sends (its tracked state derives from the attacked model)."""
        return self.inner.resume_payload(params)

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        self.inner.resume_edge(neighbour, envelope, round)
