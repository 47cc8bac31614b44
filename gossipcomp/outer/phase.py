"""LocalPhases: one peer's phases of local steps, ended by gossip and an outer step.

The peer trains its model for H local steps from an anchor, gossips (the algorithm mixes the
models, compressed as it always does), and then the outer optimizer moves the anchor by
anchor - mixed and the model restarts from the new anchor; a drift tracker, when asked for,
corrects each local step. Only the model's trained parameters take the outer step and the
correction; gossiped buffers (BatchNorm's statistics) keep the mixed value. With no outer
optimizer (or `sgd` at lr 1 without momentum) and no drift correction this does nothing, so
the peer runs exactly as plain local SGD.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossipcomp.gossip.state import require_keys
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.outer.drift import DriftTracker
from gossipcomp.outer.optimizers import OuterSGD, checked_finite

STATE_KEYS = {"steps_in_phase", "anchor", "optimizer", "drift"}


class LocalPhases:
    """Anchor, outer optimizer state and drift correction of one peer."""

    def __init__(
        self,
        trained: Sequence[torch.Tensor],
        steps_per_phase: int,
        optimizer: OuterSGD | None = None,
        drift: DriftTracker | None = None,
    ) -> None:
        """`trained`: the model's trained parameters (updated in place). `optimizer` and
        `drift` are taken as specs: this peer uses fresh copies of them."""
        checked_integer("local steps", steps_per_phase, 1)
        self.trained = list(trained)
        self.steps_per_phase = steps_per_phase
        # copies with no state: one spec may be given to every peer of a process
        self.optimizer = (
            None
            if optimizer is None or optimizer.identity
            else dataclasses.replace(optimizer, velocity=[])
        )
        self.drift = None if drift is None else dataclasses.replace(drift, correction=[])
        self.steps_in_phase = 0
        self.anchor: list[torch.Tensor] = (
            [p.detach().clone() for p in self.trained] if self.optimizer is not None else []
        )

    @property
    def active(self) -> bool:
        """Whether anything happens besides plain local SGD."""
        return self.optimizer is not None or self.drift is not None

    def local_step(self) -> None:
        """Count one local step, applying its share of the drift correction."""
        if self.drift is not None and self.drift.correction:
            self.drift.local_step(self.trained, self.steps_per_phase)
        self.steps_in_phase += 1

    def ends(self) -> list[torch.Tensor] | None:
        """Copies of the phase's end models, taken just before gossip (when the drift
        tracker needs them)."""
        if self.drift is None:
            return None
        return [p.detach().clone() for p in self.trained]

    def finish(self, ends: list[torch.Tensor] | None) -> None:
        """After gossip mixed the models: correct the drift, take the outer step, restart."""
        with torch.no_grad():
            if self.drift is not None and ends is not None:
                self.drift.update(ends, self.trained)
            if self.optimizer is not None:
                self.optimizer.step(self.anchor, self.trained)
                for p, a in zip(self.trained, self.anchor, strict=True):
                    p.copy_(a)
        self.steps_in_phase = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_in_phase": self.steps_in_phase,
            "anchor": [a.clone() for a in self.anchor],
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "drift": None if self.drift is None else self.drift.state_dict(),
        }

    def checked(self, state: Any) -> CheckedPhases:
        """A saved state checked against this peer's model and settings, ready for
        `restore`; ValueError naming what is wrong (nothing changes here)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"outer phases: expected a mapping, got {type(state).__name__}")
        require_keys(state, STATE_KEYS, "outer phases")
        steps = checked_integer(
            "outer phases: steps_in_phase", state["steps_in_phase"], 0, self.steps_per_phase - 1
        )
        for part, mine in (("optimizer", self.optimizer), ("drift", self.drift)):
            if (state[part] is None) != (mine is None):
                saved = "has no" if state[part] is None else "has a"
                now = "uses one" if mine is not None else "does not"
                raise ValueError(
                    f"outer phases: the checkpoint {saved} {part} state, this run {now}"
                )
        like = self.trained if self.optimizer is not None else []
        anchor = checked_finite("outer anchor", like, state["anchor"])
        optimizer = drift = None
        if self.optimizer is not None:  # scratch copies: a bad part leaves this peer's alone
            optimizer = dataclasses.replace(self.optimizer, velocity=[])
            optimizer.load_state_dict(state["optimizer"], self.trained)
        if self.drift is not None:
            drift = dataclasses.replace(self.drift, correction=[])
            drift.load_state_dict(state["drift"], self.trained)
        return CheckedPhases(steps, anchor, optimizer, drift)

    def restore(self, checked: CheckedPhases) -> None:
        """Take over what `checked` returned."""
        self.steps_in_phase = checked.steps_in_phase
        self.anchor = checked.anchor
        self.optimizer, self.drift = checked.optimizer, checked.drift


@dataclass(frozen=True)
class CheckedPhases:
    """A checked saved state of `LocalPhases`."""

    steps_in_phase: int
    anchor: list[torch.Tensor]
    optimizer: OuterSGD | None
    drift: DriftTracker | None
