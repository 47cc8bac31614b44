"""Local-update training with an outer optimizer (the DiLoCo family) and drift correction."""

from gossipcomp.outer.drift import DRIFT_CORRECTIONS, DriftTracker, parse_drift
from gossipcomp.outer.optimizers import OUTER_OPTIMIZERS, OuterSGD, parse_outer
from gossipcomp.outer.phase import LocalPhases

__all__ = [
    "DRIFT_CORRECTIONS",
    "OUTER_OPTIMIZERS",
    "DriftTracker",
    "LocalPhases",
    "OuterSGD",
    "parse_drift",
    "parse_outer",
]
