"""Accuracy against bytes on the wire: every gossip algorithm on ring8 digits, iid and by-label.

Run: python benchmarks/learning.py --json docs/learning.json --plot docs/learning.png
Each run is a real `simulate` (8 peers, gRPC on loopback) with the same rounds and seed; bytes
are the serialised bytes every peer sent. For each run: final mean test accuracy, bytes sent,
and the bytes at the first checkpoint where mean accuracy reached 0.90 (null if never).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.report import Report
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.90


@dataclass(frozen=True)
class Variant:
    label: str
    config: TrainConfig  # partition filled in per run


def variants(rounds: int, seed: int) -> list[Variant]:
    base = TrainConfig(rounds=rounds, seed=seed, eval_every=10)
    return [
        Variant("D-PSGD", replace(base, algorithm="dpsgd")),
        *(
            Variant(f"PowerGossip r{r}", replace(base, algorithm="powergossip", rank=r))
            for r in (1, 2, 4)
        ),
        Variant(
            "PowerGossip r2 x4 steps",
            replace(base, algorithm="powergossip", rank=2, gossip_steps=4),
        ),
        Variant("Choco top-1%", replace(base, algorithm="choco", compressor="topk:ratio=0.01")),
        Variant("Choco sign", replace(base, algorithm="choco", compressor="sign")),
        Variant(
            "Choco sign x4 steps g0.7",
            replace(base, algorithm="choco", compressor="sign", gossip_steps=4, consensus_step=0.7),
        ),
        Variant("DEF-ATC sign", replace(base, algorithm="def", compressor="sign")),
        Variant("DEF-ATC top-1%", replace(base, algorithm="def", compressor="topk:ratio=0.01")),
    ]


def bytes_to(report: Report, target: float) -> int | None:
    for point in report.history:
        if point.mean_test_accuracy >= target:
            return point.bytes_sent_total
    return None


def run_one(variant: Variant, partition: str, topology) -> dict:
    config = replace(variant.config, partition=partition)
    start = time.perf_counter()
    report = run_simulation(config, topology)
    return {
        "label": variant.label,
        "algorithm": config.algorithm,
        "compressor": config.compressor,
        "rank": config.rank if config.algorithm == "powergossip" else None,
        "gossip_steps": config.gossip_steps,
        "consensus_step": config.consensus_step,
        "zeta": config.zeta if config.algorithm == "def" else None,
        "gamma": config.gamma if config.algorithm == "def" else None,
        "partition": partition,
        "rounds": config.rounds,
        "final_test_accuracy": report.final_test_accuracy,
        "min_test_accuracy": report.min_test_accuracy,
        "bytes_sent_total": report.bytes_sent_total,
        f"bytes_to_{TARGET:.2f}".replace(".", "_"): bytes_to(report, TARGET),
        "history": [
            {"round": h.round, "accuracy": h.mean_test_accuracy, "bytes": h.bytes_sent_total}
            for h in report.history
        ],
        "seconds": time.perf_counter() - start,
    }


def table(runs: list[dict]) -> Table:
    t = Table(title="ring8 digits: accuracy against bytes (one seed, same rounds)")
    for column in (
        "partition",
        "run",
        "accuracy",
        "vs D-PSGD",
        "MB sent",
        "bytes / D-PSGD",
        "MB to 0.90",
    ):
        t.add_column(column, justify="right")
    for run in runs:
        reference = next(
            r for r in runs if r["partition"] == run["partition"] and r["algorithm"] == "dpsgd"
        )
        to_target = run["bytes_to_0_90"]
        t.add_row(
            run["partition"],
            run["label"],
            f"{run['final_test_accuracy']:.4f}",
            f"{100 * (run['final_test_accuracy'] - reference['final_test_accuracy']):+.1f} pt",
            f"{run['bytes_sent_total'] / 1e6:.1f}",
            f"1/{reference['bytes_sent_total'] / run['bytes_sent_total']:.0f}",
            "-" if to_target is None else f"{to_target / 1e6:.1f}",
        )
    return t


def markdown(runs: list[dict]) -> str:
    """The results as a Markdown table, gaps and byte ratios against D-PSGD of the same partition."""
    lines = [
        "| partition | run | final accuracy | vs D-PSGD | MB sent | bytes vs D-PSGD | MB to 0.90 |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        reference = next(
            r for r in runs if r["partition"] == run["partition"] and r["algorithm"] == "dpsgd"
        )
        to_target = run["bytes_to_0_90"]
        lines.append(
            f"| {run['partition']} | {run['label']} | {run['final_test_accuracy']:.4f} | "
            f"{100 * (run['final_test_accuracy'] - reference['final_test_accuracy']):+.1f} pt | "
            f"{run['bytes_sent_total'] / 1e6:.1f} | "
            f"1/{reference['bytes_sent_total'] / run['bytes_sent_total']:.1f} | "
            + ("never" if to_target is None else f"{to_target / 1e6:.1f}")
            + " |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    partitions = sorted({r["partition"] for r in runs}, key=lambda p: p != "iid")
    fig, axes = plt.subplots(
        1, len(partitions), figsize=(6.5 * len(partitions), 4.8), squeeze=False
    )
    for ax, partition in zip(axes[0], partitions, strict=True):
        for run in (r for r in runs if r["partition"] == partition):
            xs = [h["bytes"] for h in run["history"]]
            ys = [h["accuracy"] for h in run["history"]]
            ax.plot(xs, ys, label=run["label"], marker=".", markersize=3)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent, all peers (serialised)")
        ax.set_ylabel("mean test accuracy")
        ax.set_ylim(0.0, 1.0)
        ax.axhline(TARGET, color="grey", linewidth=0.6, linestyle="--")
        ax.set_title(f"ring8, digits, {partition}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the runs here")
    parser.add_argument("--plot", type=Path, help="write a PNG of accuracy against bytes here")
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partitions", nargs="+", default=["iid", "by-label"])
    parser.add_argument(
        "--only", nargs="*", help="run only variants whose label contains one of these"
    )
    parser.add_argument(
        "--render", type=Path, help="no runs: print the Markdown table (and --plot) of this JSON"
    )
    args = parser.parse_args()
    if args.render:
        runs = json.loads(args.render.read_text())["runs"]
        print(markdown(runs))
        if args.plot:
            plot(runs, args.plot)
        return
    torch.set_num_threads(1)
    topology = load_topology(ROOT / "topologies" / "ring8.yaml")
    chosen = [
        v
        for v in variants(args.rounds, args.seed)
        if not args.only or v.label == "D-PSGD" or any(o in v.label for o in args.only)
    ]
    console = Console()
    runs = []
    for partition in args.partitions:
        for variant in chosen:
            run = run_one(variant, partition, topology)
            console.print(
                f"{partition:9s} {variant.label:18s} acc {run['final_test_accuracy']:.4f} "
                f"{run['bytes_sent_total'] / 1e6:9.1f} MB  {run['seconds']:.0f} s"
            )
            runs.append(run)
    console.print(table(runs))
    if args.json:
        args.json.write_text(
            json.dumps({"rounds": args.rounds, "seed": args.seed, "runs": runs}, indent=1) + "\n"
        )
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
