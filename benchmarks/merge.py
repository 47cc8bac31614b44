"""Merged compression on a model of many tensors: per-tensor groups, one group, and the plan.

Run: python benchmarks/merge.py --json docs/merge.json
A deep residual MLP with LayerNorm (`--model resmlp`: 102 parameter tensors) trains on digits on
ring8, every peer in one process over real gRPC (a `simulate` run), once per algorithm and
schedule with the same rounds and seed: `per-tensor` (each parameter compressed on its own),
`single` (all in one buffer) and the planner's plan (`--planner`, default mergecomp); PowerGossip
merges its raw payload only (one wire tensor per group, the same arithmetic). Round time
is each peer's compute + communication seconds per round, averaged over peers (start-up and the
final evaluation left out); the schedules of one algorithm run interleaved, `--repeats` times,
and the median is kept. When the planner picks the one-group plan (`planned_is_single`), planned
and single are one schedule measured twice as often: their runs are pooled, and
`planned_vs_single` is 1 by construction instead of the noise of two samples of the same thing.
Written per algorithm: round time and accuracy per schedule, `merged_speedup` (per-tensor round
time / planned) and `planned_vs_single` (single / planned). Merged groups keep each tensor's
own compression statistics (compress/segmented.py): for sign the merged runs compute the
per-tensor models bit for bit, so their accuracies are the per-tensor one exactly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.cli import resolve_topology
from gossipcomp.experiment import TrainConfig, static_schedule
from gossipcomp.experiment.report import Report
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.workload.models import build_model

ALGORITHMS = {
    "choco-sign": TrainConfig(algorithm="choco", compressor="sign"),
    "def-sign": TrainConfig(algorithm="def", compressor="sign"),
    "powergossip": TrainConfig(algorithm="powergossip"),
}


def round_seconds(report: Report) -> float:
    """Mean over peers of (compute + communication seconds) per round."""
    per_peer = [(p.compute_seconds + p.comm_seconds) / report.rounds for p in report.per_peer]
    return sum(per_peer) / len(per_peer)


def planned_groups(config: TrainConfig) -> tuple[TensorGroup, ...]:
    """The groups `config.schedule` gives the configured model (what every peer applies)."""
    model = build_model(config.model, config.seed)
    schedule = static_schedule(config, list(model.named_parameters()))
    return () if schedule is None else schedule.groups


def run(algorithms: list[str], planner: str, rounds: int, repeats: int, topology_name: str) -> dict:
    topology = resolve_topology(topology_name)
    schedules = ["per-tensor", "single", planner]
    results: dict[str, dict] = {}
    for name in algorithms:
        base = replace(ALGORITHMS[name], model="resmlp", rounds=rounds, eval_every=0, lr=0.05)
        times: dict[str, list[float]] = {s: [] for s in schedules}
        accuracy: dict[str, float] = {}
        for _ in range(repeats):
            for schedule in schedules:  # interleaved: the machine's drift hits all alike
                report = run_simulation(replace(base, schedule=schedule), topology)
                times[schedule].append(round_seconds(report))
                accuracy[schedule] = report.final_test_accuracy
                assert report.mismatched_epoch_exchanges == 0
        same_plan = planned_groups(replace(base, schedule=planner)) == planned_groups(
            replace(base, schedule="single")
        )
        if same_plan:  # one schedule measured twice as often: its runs are pooled
            times["single"] = times[planner] = times["single"] + times[planner]
        median = {s: statistics.median(t) for s, t in times.items()}
        results[name] = {
            "round_seconds": median,
            "round_seconds_each": times,
            "accuracy": accuracy,
            "planned_is_single": same_plan,
            "merged_speedup": median["per-tensor"] / median[planner],
            "planned_vs_single": median["single"] / median[planner],
            "accuracy_gap_vs_per_tensor": accuracy["per-tensor"] - accuracy[planner],
        }
    return {
        "command": "python benchmarks/merge.py",
        "date": time.strftime("%Y-%m-%d"),
        "model": "resmlp",
        "tensors": 102,
        "topology": topology.name,
        "rounds": rounds,
        "repeats": repeats,
        "planner": planner,
        "algorithms": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--algorithms", nargs="+", choices=sorted(ALGORITHMS), default=list(ALGORITHMS)
    )
    parser.add_argument("--planner", default="mergecomp")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--topology", default="ring8")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.algorithms, args.planner, args.rounds, args.repeats, args.topology)
    table = Table(title=f"merged compression, resmlp on {result['topology']}")
    for column in ("algorithm", "schedule", "round ms", "accuracy"):
        table.add_column(column)
    for name, entry in result["algorithms"].items():
        for schedule, seconds in entry["round_seconds"].items():
            accuracy = f"{entry['accuracy'][schedule]:.3f}"
            table.add_row(name, schedule, f"{1000 * seconds:.1f}", accuracy)
        table.add_row(
            name,
            "ratios",
            f"merged_speedup {entry['merged_speedup']:.2f}",
            f"planned_vs_single {entry['planned_vs_single']:.2f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
