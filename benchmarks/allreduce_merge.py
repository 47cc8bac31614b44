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
import json
import os
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.allreduce.launch import Session, spawn
from gossipcomp.allreduce.train import AllreduceConfig, train_rank

COMPRESSORS = ("sign", "topk:ratio=0.01")
GROUPINGS = ("per-tensor", "single", "planned")


def _worker(session: Session, configs: dict[str, AllreduceConfig], repeats: int) -> dict:
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            result = train_rank(session, config)
            rows[name].append(
                {
                    "accuracy": result.test_accuracy,
                    "step_ms": 1e3 * result.step_seconds,
                    "groups": result.groups,
                    "payload_bytes_per_step": result.steady_payload_bytes_per_step,
                }
            )
    return rows


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
    ranks = spawn(_worker, args.nproc, (configs, args.repeats), timeout_s=60, deadline_s=3600)
    table = {}
    for name, config in configs.items():
        runs = [run for rank in ranks for run in rank[name]]
        table[name] = {
            "compressor": config.compressor,
            "planner": config.planner,
            "groups": ranks[0][name][0]["groups"],
            "accuracy": statistics.fmean(run["accuracy"] for run in ranks[0][name]),
            "payload_bytes_per_step": ranks[0][name][0]["payload_bytes_per_step"],
            "step_ms": statistics.median(run["step_ms"] for run in runs),
        }
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
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }
    show = Table(title=f"merged compressed all-reduce, resmlp, {args.nproc} gloo ranks")
    for column in ("method", "groups", "accuracy", "payload B/step", "step ms"):
        show.add_column(column, justify="right")
    for name, row in table.items():
        show.add_row(
            name,
            str(row["groups"]),
            f"{row['accuracy']:.4f}",
            f"{row['payload_bytes_per_step']:.0f}",
            f"{row['step_ms']:.2f}",
        )
    console = Console()
    console.print(show)
    for spec, r in ratios.items():
        console.print(
            f"{spec}: merged_speedup {r['merged_speedup']:.2f}, "
            f"planned_vs_single {r['planned_vs_single']:.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _model() -> torch.nn.Module:
    from gossipcomp.models import build_resmlp

    return build_resmlp(0)


if __name__ == "__main__":
    sys.exit(main())
