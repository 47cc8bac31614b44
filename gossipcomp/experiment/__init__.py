"""One peer's training run on digits: configuration, the local-step/gossip loop, and its outcome.

Shared by `gossipcomp simulate` (every peer in one process) and `gossipcomp peer` (one peer per
process), so both train exactly the same way. The package: config.py (TrainConfig and its
checks), setup.py (a peer's algorithm, schedule, data and model from a config), outcome.py
(Evaluation, PeerOutcome, the errors that stop a run), restore.py (the checks a checkpoint
passes before it is taken over), trainer.py (PeerTrainer, the training loop); and what runs
and reports experiments: simulation/ (every peer in one process, or one peer), report.py,
presentation.py (rich renderings), plot.py (pictures of reports). The public names are
imported from here, each on first use (PEP 562), so a light module of the package (the
presentation the command line shows) does not load the training loop.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "GROUPED_ALGORITHMS": "gossipcomp.experiment.config",
    "MAX_LOCAL_STEPS": "gossipcomp.experiment.config",
    "MAX_LR": "gossipcomp.experiment.config",
    "MAX_SEED": "gossipcomp.experiment.config",
    "TrainConfig": "gossipcomp.experiment.config",
    "Evaluation": "gossipcomp.experiment.outcome",
    "PeerOutcome": "gossipcomp.experiment.outcome",
    "TrainingAborted": "gossipcomp.experiment.outcome",
    "TrainingDiverged": "gossipcomp.experiment.outcome",
    "MAX_RUN_SECONDS": "gossipcomp.experiment.restore",
    "REFERENCE_COMPRESSION": "gossipcomp.experiment.setup",
    "REFERENCE_LINK": "gossipcomp.experiment.setup",
    "build_algorithm": "gossipcomp.experiment.setup",
    "build_config_model": "gossipcomp.experiment.setup",
    "load_data": "gossipcomp.experiment.setup",
    "peer_examples": "gossipcomp.experiment.setup",
    "static_schedule": "gossipcomp.experiment.setup",
    "PeerTrainer": "gossipcomp.experiment.trainer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
