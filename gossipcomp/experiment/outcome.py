"""How a run ends: the accuracy history, each peer's outcome, and the errors that stop a run.

Below the trainer and the checkpoint checks, which both build Evaluations; the simulation and
the report read PeerOutcomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossipcomp.peer import PeerStats


@dataclass(frozen=True)
class Evaluation:
    """Test accuracy and cumulative bytes sent after `round` local steps and `gossip_round`
    gossip rounds (the same with one local step per round), `seconds` into the run (0 in an
    older checkpoint's entries), and the test loss (mean cross-entropy in nats a prediction: a
    language model's validation loss; None in an older checkpoint's entries)."""

    round: int
    test_accuracy: float
    bytes_sent: int
    gossip_round: int
    seconds: float = 0.0
    test_loss: float | None = None


@dataclass
class PeerOutcome:
    """How one peer's run ended."""

    rank: int
    test_accuracy: float
    stats: PeerStats
    history: list[Evaluation] = field(default_factory=list)

    @property
    def test_loss(self) -> float | None:
        """The test loss of the last evaluation (None without one, or from an older checkpoint)."""
        return self.history[-1].test_loss if self.history else None


class TrainingAborted(RuntimeError):
    """Another peer of the same simulation failed, so this one stopped."""


class TrainingDiverged(RuntimeError):
    """A peer's parameters became NaN or Inf."""
