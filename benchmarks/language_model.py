"""The character-level language model on 4 peers against one model alone (issue 26).

Run: python benchmarks/language_model.py --json docs/language_model.json
     python benchmarks/language_model.py --outer-grid 1,4,16,64 --seeds 0,1,2 --json PATH
     (benchmarks/outer.py's grid on the language model: plain, outer Nesterov, NoLoCo-style,
     each with and without drift tracking, at each H and seed; PowerGossip rank 1 on ring4)
Every run trains model chartransformer on dataset pysource (the Python standard library's own
source, workload/text.py) for the same local steps, batch size, learning rate and seed: 4 peers
on ring4 over gRPC on loopback (`simulate`) with each gossip algorithm, and one model alone on all
the training windows. Reported: validation loss (mean cross-entropy in nats a character) of the
peers (mean) and of their average model, perplexity, and the bytes the peers sent, also as a
fraction of exact gossip's (D-PSGD).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from outer import grid, parse_seeds, run_one
from rich.console import Console
from rich.table import Table

from gossipcomp.experiment import TrainConfig, build_config_model, load_data
from gossipcomp.experiment.report import Report
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.topology import load_topology
from gossipcomp.workload.training import BatchStream, evaluate, local_step, make_optimizer

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = {"PowerGossip r1": "powergossip:rank=1", "D-PSGD (exact)": "dpsgd"}


@dataclass(frozen=True)
class Alone:
    """One model trained alone on all the training windows."""

    test_loss: float
    test_accuracy: float
    seconds: float


def base_config(rounds: int, batch_size: int, lr: float, seed: int) -> TrainConfig:
    return TrainConfig(
        model="chartransformer",
        dataset="pysource",
        rounds=rounds,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        eval_every=max(1, rounds // 4),
    )


def train_alone(config: TrainConfig) -> Alone:
    """`config`'s model trained alone on all of its data set's training part, for as many local
    steps as each peer takes, with the same batch size, optimizer and seed (rank 0's batches)."""
    data = load_data(config)
    model = build_config_model(config, data)
    optimizer = make_optimizer(model, config.lr, config.momentum)
    stream = BatchStream(data.x_train, data.y_train, config.batch_size, config.seed, 0)
    start = time.perf_counter()
    for _ in range(config.rounds):
        local_step(model, optimizer, stream.next_batch())
    accuracy, loss = evaluate(model, data.x_test, data.y_test)
    return Alone(loss, accuracy, time.perf_counter() - start)


def compare(
    rounds: int, batch_size: int, lr: float, seed: int, algorithms: dict[str, str]
) -> tuple[dict[str, Report], Alone]:
    """Each algorithm's report on ring4, and one model alone, from the same configuration."""
    base = base_config(rounds, batch_size, lr, seed)
    ring4 = load_topology(ROOT / "gossipcomp" / "topologies" / "ring4.yaml")
    reports = {
        label: run_simulation(replace(base, algorithm=spec), ring4)
        for label, spec in algorithms.items()
    }
    return reports, train_alone(base)


def outer_grid(
    rounds: int, batch_size: int, lr: float, seed: int, steps: tuple[int, ...]
) -> list[dict[str, Any]]:
    """benchmarks/outer.py's grid on the language model, 4 peers on ring4, for one seed: one
    record per configuration (a diverged one is recorded as such), with its validation loss."""
    # losses, not times, are compared: a round may wait long on a loaded machine rather than
    # fail (a failed exchange would make a peer train alone that round)
    base = replace(base_config(rounds, batch_size, lr, seed), eval_every=0, round_timeout=600.0)
    ring4 = load_topology(ROOT / "gossipcomp" / "topologies" / "ring4.yaml")
    return [run_one(item, base, "iid", seed, ring4, None) for item in grid(steps)]


def grid_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(title="outer optimizers on the language model (val loss, lower is better)")
    for column in (
        "configuration",
        "seed",
        "val loss",
        "average model",
        "MB sent",
        "failed exchanges",
    ):
        table.add_column(column, justify="right")
    for run in runs:
        diverged = run.get("error") is not None
        table.add_row(
            run["label"],
            str(run["seed"]),
            "diverged" if diverged else f"{run['test_loss']:.3f}",
            "-" if diverged else f"{run['average_model_test_loss']:.3f}",
            "-" if diverged else f"{run['bytes'] / 1e6:.2f}",
            "-" if diverged else str(run["failed_exchanges"]),
        )
    return table


def summary(reports: dict[str, Report], alone: Alone) -> dict[str, object]:
    exact = reports.get("D-PSGD (exact)")
    runs = []
    for label, report in reports.items():
        runs.append(
            {
                "label": label,
                "algorithm": report.algorithm,
                "final_test_loss": report.final_test_loss,
                "final_test_perplexity": report.final_test_perplexity,
                "average_model_test_loss": report.average_model_test_loss,
                "final_test_accuracy": report.final_test_accuracy,
                "bytes_sent_total": report.bytes_sent_total,
                "bytes_vs_exact": None
                if exact is None
                else report.bytes_sent_total / exact.bytes_sent_total,
                "wall_seconds": report.wall_seconds,
                "history": [
                    {
                        "round": p.round,
                        "mean_test_loss": p.mean_test_loss,
                        "bytes": p.bytes_sent_total,
                    }
                    for p in report.history
                ],
            }
        )
    return {
        "alone_test_loss": alone.test_loss,
        "alone_test_perplexity": math.exp(alone.test_loss),
        "alone_test_accuracy": alone.test_accuracy,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="local steps of every model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the comparison")
    parser.add_argument(
        "--seeds", default="0", help="seeds of --outer-grid, comma-separated (e.g. 0,1,2)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--outer-grid",
        metavar="H,H,...",
        help="run benchmarks/outer.py's grid at these local steps instead of the comparison",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.outer_grid:
        steps = tuple(int(h) for h in args.outer_grid.split(",") if h)
        runs = [
            run
            for seed in parse_seeds(args.seeds)
            for run in outer_grid(args.rounds, args.batch_size, args.lr, seed, steps)
        ]
        Console().print(grid_table(runs))
        if args.json is not None:
            args.json.write_text(json.dumps({"outer_grid": runs}, indent=2) + "\n")
        return
    reports, alone = compare(args.rounds, args.batch_size, args.lr, args.seed, ALGORITHMS)
    result = summary(reports, alone)
    table = Table(
        title=f"chartransformer on pysource, {args.rounds} steps of {args.batch_size} windows, "
        f"lr {args.lr}, seed {args.seed}"
    )
    for column in ("run", "val loss", "perplexity", "average model", "MB sent", "vs exact"):
        table.add_column(column, justify="right")
    for run in result["runs"]:  # type: ignore[union-attr]
        ratio = run["bytes_vs_exact"]
        table.add_row(
            run["label"],
            f"{run['final_test_loss']:.3f}",
            f"{run['final_test_perplexity']:.2f}",
            f"{run['average_model_test_loss']:.3f}",
            f"{run['bytes_sent_total'] / 1e6:.2f}",
            "-" if ratio is None else f"1/{1 / ratio:.1f}",
        )
    table.add_row(
        "one model alone, all data",
        f"{alone.test_loss:.3f}",
        f"{math.exp(alone.test_loss):.2f}",
        "-",
        "0",
        "-",
    )
    Console().print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
