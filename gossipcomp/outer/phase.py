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

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gossipcomp.gossip.state import require_keys
from gossipcomp.inputs.text import quoted
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
        """`trained`: the model's trained parameters (views: updated in place)."""
        if isinstance(steps_per_phase, bool) or not isinstance(steps_per_phase, int):
            raise ValueError(f"local steps: expected an integer, got {quoted(steps_per_phase)}")
        self.trained = list(trained)
        self.steps_per_phase = steps_per_phase
        self.optimizer = None if optimizer is None or optimizer.identity else optimizer
        self.drift = drift
        self.steps_in_phase = 0
        self.anchor: list[torch.Tensor] = (
            [p.detach().clone() for p in self.trained] if self.optimizer is not None else []
        )

    @property
    def active(self) -> bool:
        """Whether anything happens besides plain local SGD."""
        return self.optimizer is not None or self.drift is not None

    def restart(self) -> None:
        """Take the model as it is now as the phase's anchor (a peer made or restored)."""
        if self.optimizer is not None:
            self.anchor = [p.detach().clone() for p in self.trained]
        self.steps_in_phase = 0

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

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore, after checking every part; ValueError (and nothing changed) otherwise."""
        require_keys(state, STATE_KEYS, "outer phases")
        steps = state["steps_in_phase"]
        if (
            isinstance(steps, bool)
            or not isinstance(steps, int)
            or not 0 <= steps < max(1, self.steps_per_phase)
        ):
            raise ValueError(
                f"outer phases: steps_in_phase expected an integer in "
                f"[0, {self.steps_per_phase}), got {quoted(steps)}"
            )
        for part, mine in (("optimizer", self.optimizer), ("drift", self.drift)):
            if (state[part] is None) != (mine is None):
                raise ValueError(
                    f"outer phases: the checkpoint {'has no' if state[part] is None else 'has a'} "
                    f"{part} state, this run {'uses one' if mine is not None else 'does not'}"
                )
        anchor = (
            checked_finite("outer anchor", self.trained, state["anchor"])
            if self.optimizer is not None
            else checked_finite("outer anchor", [], state["anchor"])
        )
        # load into scratch copies first: a bad part must leave everything as it was
        optimizer = drift = None
        if self.optimizer is not None:
            optimizer = OuterSGD(
                self.optimizer.lr,
                self.optimizer.momentum,
                self.optimizer.nesterov,
                self.optimizer.name,
            )
            optimizer.load_state_dict(state["optimizer"], self.trained)
        if self.drift is not None:
            drift = DriftTracker(self.drift.rate)
            drift.load_state_dict(state["drift"], self.trained)
        self.optimizer, self.drift, self.anchor = optimizer, drift, anchor
        self.steps_in_phase = steps
