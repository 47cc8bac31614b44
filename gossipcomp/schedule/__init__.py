"""Scheduling without networking: cost model, merge planners, strategy search, timeline simulator.

`TensorInfo`/`TensorGroup`/`check_cover` describe plans; `CostModel`, `fit_link`, `TransferLog`,
`measure_compressor`, `measure_seconds` and `predict_iteration` price them; `make_planner` builds
the planners of `PLANNERS`; `brute_force` finds small instances' exact optimum; `timeline`
simulates rounds of many peers from measured per-peer costs. Imports nothing above compress/
and topology.

Each public name is imported from its module on first use (PEP 562): the command line's flag
tables read `PLANNER_NAMES` (catalog.py) without loading the cost model and torch.
"""

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.schedule.bruteforce": "Optimum brute_force random_instance",
    "gossipcomp.schedule.costs": (
        "CompressorCost CostModel LinkCost TransferLog WireSize fit_link measure_compressor "
        "measure_seconds predict_iteration"
    ),
    "gossipcomp.schedule.groups": "TensorGroup TensorInfo check_cover",
    "gossipcomp.schedule.catalog": "PLANNER_NAMES",
    "gossipcomp.schedule.planners": "PLANNERS MergeComp Planner Strategy make_planner",
    "gossipcomp.schedule.timeline": "LAYOUTS PeerCosts Timeline simulate",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
