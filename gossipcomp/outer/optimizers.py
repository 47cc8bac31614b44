"""Outer optimizers of local-update training (the DiLoCo family), by name from spec strings.

A phase of H local steps moves a peer from its anchor x0 to x; gossip (or an all-reduce) then
mixes the models into x_mix. The outer optimizer turns the phase's outer gradient
g = x0 - x_mix (the averaged pseudo-gradient, plus the anchor's disagreement with its
neighbours' over gossip) into the next anchor, which the peer trains from:

    sgd:lr=1,momentum=0     x0 <- x0 - lr * v,             v <- momentum * v + g
    nesterov:lr=0.7,momentum=0.9   (DiLoCo)  x0 <- x0 - lr * (g + momentum * v)
    noloco:lr=0.7,momentum=0.5     heavy ball on g, as NoLoCo's modified Nesterov step

`sgd` with lr 1 and no momentum takes the mixed model as it is: today's gossip, bit for bit.
NoLoCo's step weighs the averaged pseudo-gradient (beta) and the pull toward the partner's
weights (gamma) apart; one exchange of models per phase carries their sum, so here
beta = gamma = lr (ALGORITHMS.md, "Outer optimizers"). Specs are refused, naming what is
wrong, when a name, key or value is unknown or out of range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from gossipcomp.gossip.state import checked_tensors
from gossipcomp.inputs.numbers import checked_number
from gossipcomp.inputs.text import quoted, spec_options

MAX_OUTER_SPEC_CHARS = 200
MAX_OUTER_LR = 10.0  # an outer step ten times the phase's own move is a typing mistake


@dataclass
class OuterSGD:
    """SGD on the outer gradient, with optional (Nesterov) momentum; state: the velocity."""

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    name: str = "sgd"
    velocity: list[torch.Tensor] = field(default_factory=list, repr=False)

    DEFAULTS: ClassVar[Mapping[str, Mapping[str, float]]] = {
        "sgd": {"lr": 1.0, "momentum": 0.0},
        "nesterov": {"lr": 0.7, "momentum": 0.9},
        "noloco": {"lr": 0.7, "momentum": 0.5},
    }

    def __post_init__(self) -> None:
        checked_number("outer optimizer lr", self.lr, 0.0, MAX_OUTER_LR, closed_low=False)
        checked_number("outer optimizer momentum", self.momentum, 0.0, 1.0, closed_high=False)

    @property
    def spec(self) -> str:
        """The canonical spec string that rebuilds this optimizer."""
        return f"{self.name}:lr={self.lr!r},momentum={self.momentum!r}"

    @property
    def identity(self) -> bool:
        """Whether the step takes the mixed model unchanged (lr 1, no momentum)."""
        return self.lr == 1.0 and self.momentum == 0.0

    def step(self, anchor: Sequence[torch.Tensor], mixed: Sequence[torch.Tensor]) -> None:
        """Move `anchor` (in place) by the outer gradient anchor - mixed."""
        if self.identity:
            for a, m in zip(anchor, mixed, strict=True):
                a.copy_(m)
            return
        if not self.velocity and self.momentum:
            self.velocity = [torch.zeros_like(a) for a in anchor]
        for index, (a, m) in enumerate(zip(anchor, mixed, strict=True)):
            gradient = a - m
            if self.momentum:
                v = self.velocity[index]
                v.mul_(self.momentum).add_(gradient)
                update = gradient.add(v, alpha=self.momentum) if self.nesterov else v
            else:
                update = gradient
            a.sub_(update, alpha=self.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "velocity": [v.clone() for v in self.velocity]}

    def load_state_dict(self, state: Mapping[str, Any], like: Sequence[torch.Tensor]) -> None:
        """Restore a velocity shaped like `like` (the anchor); ValueError on any mismatch."""
        if not isinstance(state, Mapping) or state.get("spec") != self.spec:
            raise ValueError(
                f"outer optimizer: saved {quoted(spec_of(state))}, this run uses {self.spec}"
            )
        self.velocity = checked_finite("outer velocity", like, state.get("velocity"), empty=True)


OUTER_OPTIMIZERS = tuple(OuterSGD.DEFAULTS)


def parse_outer(spec: str) -> OuterSGD:
    """Build an outer optimizer from "NAME[:key=value,...]" (NAME in OUTER_OPTIMIZERS)."""
    if not isinstance(spec, str) or len(spec) > MAX_OUTER_SPEC_CHARS:
        raise ValueError(
            f"outer optimizer spec: expected a string of at most {MAX_OUTER_SPEC_CHARS} "
            f"characters, got {quoted(spec)}"
        )
    name, _, arguments = spec.strip().partition(":")
    name = name.strip()
    if name not in OuterSGD.DEFAULTS:
        raise ValueError(
            f"unknown outer optimizer {quoted(name)}; known: {', '.join(OUTER_OPTIMIZERS)}"
        )
    values = dict(OuterSGD.DEFAULTS[name])
    for key, raw in spec_options(arguments, f"outer optimizer {name}", values).items():
        try:
            values[key] = float(raw)
        except ValueError:
            raise ValueError(
                f"outer optimizer {name}: {key} expected a number, got {quoted(raw)}"
            ) from None
    return OuterSGD(values["lr"], values["momentum"], nesterov=name == "nesterov", name=name)


def checked_finite(
    what: str, current: Sequence[torch.Tensor], saved: Any, *, empty: bool = False
) -> list[torch.Tensor]:
    """Copies of saved tensors matching `current` one for one (shape, dtype) and finite; with
    `empty`, an empty list is accepted too (no state yet). ValueError naming `what`."""
    if empty and isinstance(saved, list) and not saved:
        return []
    return checked_tensors(what, current, saved)  # finite: checked there


def spec_of(state: Any) -> Any:
    """The spec a saved state names (for an error message), whatever the state is."""
    return state.get("spec") if isinstance(state, Mapping) else type(state).__name__
