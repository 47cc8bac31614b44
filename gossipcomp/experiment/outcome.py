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
    older checkpoint's entries)."""

    round: int
    test_accuracy: float
    bytes_sent: int
    gossip_round: int
    seconds: float = 0.0


@dataclass
class PeerOutcome:
    """How one peer's run ended."""

    rank: int
    test_accuracy: float
    stats: PeerStats
    history: list[Evaluation] = field(default_factory=list)


class TrainingAborted(RuntimeError):
    """Another peer of the same simulation failed, so this one stopped."""


class TrainingDiverged(RuntimeError):
    """A peer's parameters became NaN or Inf."""
