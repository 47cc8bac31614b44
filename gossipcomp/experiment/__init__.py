"""One peer's training run on digits: configuration, the local-step/gossip loop, and its outcome.

Shared by `gossipcomp simulate` (every peer in one process) and `gossipcomp peer` (one peer per
process), so both train exactly the same way. The package: settings.py (TrainSettings: the
fields and their defaults, torch-free, for flag tables), config.py (TrainConfig: those fields,
checked), setup.py (a peer's algorithm, schedule, data and model from a config), outcome.py
(Evaluation, PeerOutcome, the errors that stop a run), restore.py (the checks a checkpoint
passes before it is taken over), trainer.py (PeerTrainer, the training loop); and what runs
and reports experiments: simulation/ (every peer in one process, or one peer), report.py,
presentation.py (rich renderings), plot.py (pictures of reports). The public names are
imported from here, each on first use (PEP 562), so a light module of the package (the
presentation the command line shows) does not load the training loop.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.experiment.config": "GROUPED_ALGORITHMS TrainConfig",
    "gossipcomp.experiment.outcome": "Evaluation PeerOutcome TrainingAborted TrainingDiverged",
    "gossipcomp.experiment.restore": "MAX_RUN_SECONDS",
    "gossipcomp.experiment.settings": "MAX_LOCAL_STEPS MAX_LR MAX_SEED TrainSettings",
    "gossipcomp.experiment.setup": (
        "REFERENCE_COMPRESSION REFERENCE_LINK build_algorithm build_config_model "
        "load_data peer_examples static_schedule"
    ),
    "gossipcomp.experiment.trainer": "PeerTrainer",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
