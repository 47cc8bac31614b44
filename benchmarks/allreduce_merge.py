"""Merged compressed all-reduce: per-tensor collectives, one group, and planned groups.

Run: python benchmarks/allreduce_merge.py --json docs/allreduce_merge.json
N gloo processes (default 4) train the residual MLP (102 parameter tensors) on digits with
`MergedSync` under three groupings for each compressor (sign, top-1%): one compressed collective
per tensor, one group of everything, and the groups of a gossipcomp.schedule planner (default
mergecomp, on costs measured at start: the compressor timed here, the collective timed between
the ranks), each group launched as soon as backward completes it. Step time: the median wall
time of a step after the first five, median over ranks and over `--repeats` rounds (the
groupings run in turn within each round). Ratios: merged_speedup = per-tensor / planned,
planned_vs_single = single / planned, per compressor; accuracy after the same steps.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
from allreduce_runs import machine, run_configs, save, show, summarise

from gossipcomp.allreduce.launch import spawn
from gossipcomp.allreduce.train import AllreduceConfig

COMPRESSORS = ("sign", "topk:ratio=0.01")
GROUPINGS = ("per-tensor", "single", "planned")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--planner", default="mergecomp")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    base = AllreduceConfig(sync="merged", model="resmlp", steps=args.steps, momentum=0.0)
    configs = {
        f"{spec} {grouping}": replace(
            base, compressor=spec, planner=args.planner if grouping == "planned" else grouping
        )
        for spec in COMPRESSORS
        for grouping in GROUPINGS
    }
    ranks = spawn(run_configs, args.nproc, (configs, args.repeats), timeout_s=60, deadline_s=3600)
    table = summarise(ranks, configs)
    ratios = {}
    for spec in COMPRESSORS:
        planned = table[f"{spec} planned"]["step_ms"]
        ratios[spec] = {
            "merged_speedup": table[f"{spec} per-tensor"]["step_ms"] / planned,
            "planned_vs_single": table[f"{spec} single"]["step_ms"] / planned,
        }
    result = {
        "nproc": args.nproc,
        "steps": args.steps,
        "repeats": args.repeats,
        "planner": args.planner,
        "tensors": len(list(torch.nn.Module.parameters(_model()))),
        "methods": table,
        "ratios": ratios,
        "merged_speedup": min(r["merged_speedup"] for r in ratios.values()),
        "planned_vs_single": min(r["planned_vs_single"] for r in ratios.values()),
        "machine": machine(),
    }
    console = show(
        f"merged compressed all-reduce, resmlp, {args.nproc} gloo ranks", table, groups=True
    )
    for spec, r in ratios.items():
        console.print(
            f"{spec}: merged_speedup {r['merged_speedup']:.2f}, "
            f"planned_vs_single {r['planned_vs_single']:.2f}"
        )
    save(args.json, result)
    return 0


def _model() -> torch.nn.Module:
    from gossipcomp.models import build_resmlp

    return build_resmlp(0)


if __name__ == "__main__":
    sys.exit(main())
