"""Scheduling without networking: cost model, merge planners, strategy search, timeline simulator.

`TensorInfo`/`TensorGroup`/`check_cover` describe plans; `CostModel`, `fit_link`, `TransferLog`,
`measure_compressor`, `measure_seconds` and `predict_iteration` price them; `make_planner` builds
the planners of `PLANNERS`; `brute_force` finds small instances' exact optimum; `timeline`
simulates rounds of many peers from measured per-peer costs. Imports nothing above compress/
and topology.
"""

from gossipcomp.schedule.bruteforce import Optimum, brute_force, random_instance
from gossipcomp.schedule.costs import (
    CompressorCost,
    CostModel,
    LinkCost,
    TransferLog,
    WireSize,
    fit_link,
    measure_compressor,
    measure_seconds,
    predict_iteration,
)
from gossipcomp.schedule.groups import TensorGroup, TensorInfo, check_cover
from gossipcomp.schedule.planners import PLANNERS, MergeComp, Planner, Strategy, make_planner
from gossipcomp.schedule.timeline import LAYOUTS, PeerCosts, Timeline, simulate

__all__ = [
    "LAYOUTS",
    "PLANNERS",
    "CompressorCost",
    "CostModel",
    "LinkCost",
    "MergeComp",
    "Optimum",
    "PeerCosts",
    "Planner",
    "Strategy",
    "Timeline",
    "TensorGroup",
    "TensorInfo",
    "TransferLog",
    "WireSize",
    "brute_force",
    "check_cover",
    "fit_link",
    "make_planner",
    "measure_compressor",
    "measure_seconds",
    "predict_iteration",
    "random_instance",
    "simulate",
]
