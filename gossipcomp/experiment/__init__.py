"""One peer's training run on digits: configuration, the local-step/gossip loop, and its outcome.

Shared by `gossipcomp simulate` (every peer in one process) and `gossipcomp peer` (one peer per
process), so both train exactly the same way. The package: config.py (TrainConfig and its
checks), setup.py (a peer's algorithm, schedule, data and model from a config), outcome.py
(Evaluation, PeerOutcome, the errors that stop a run), restore.py (the checks a checkpoint
passes before it is taken over), trainer.py (PeerTrainer, the training loop). Its names are
imported from here.
"""

from gossipcomp.experiment.config import (
    GROUPED_ALGORITHMS,
    MAX_LOCAL_STEPS,
    MAX_LR,
    MAX_SEED,
    TrainConfig,
)
from gossipcomp.experiment.outcome import (
    Evaluation,
    PeerOutcome,
    TrainingAborted,
    TrainingDiverged,
)
from gossipcomp.experiment.restore import MAX_RUN_SECONDS
from gossipcomp.experiment.setup import (
    REFERENCE_COMPRESSION,
    REFERENCE_LINK,
    build_algorithm,
    build_config_model,
    load_data,
    peer_examples,
    static_schedule,
)
from gossipcomp.experiment.trainer import PeerTrainer

__all__ = [
    "GROUPED_ALGORITHMS",
    "MAX_LOCAL_STEPS",
    "MAX_LR",
    "MAX_RUN_SECONDS",
    "MAX_SEED",
    "REFERENCE_COMPRESSION",
    "REFERENCE_LINK",
    "Evaluation",
    "PeerOutcome",
    "PeerTrainer",
    "TrainConfig",
    "TrainingAborted",
    "TrainingDiverged",
    "build_algorithm",
    "build_config_model",
    "load_data",
    "peer_examples",
    "static_schedule",
]
