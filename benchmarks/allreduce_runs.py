"""What the all-reduce benchmarks share: run configurations in gloo ranks, summarise, show.

`run_configs` is the per-rank worker (each configuration `repeats` times, in turn, so a busy
machine slows all of them alike); `summarise` takes, per configuration, rank 0's accuracy (the
mean over repeats), its steady bytes per step, the median step time over ranks and repeats, and
as medians too the communication a step waited for, the rest of the step (compute) and the step
time a planner predicted and the per-collective cost (alpha) it priced (merged sync; 0
otherwise).
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.train import AllreduceConfig, train_rank


def run_configs(
    session: Session, configs: dict[str, AllreduceConfig], repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """This rank's measurements of every configuration, `repeats` rounds of them in turn."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            result = train_rank(session, config)
            looped = result.steps - result.calibration_steps  # the steps comm_seconds covers
            rows[name].append(
                {
                    "accuracy": result.test_accuracy,
                    "payload_bytes_per_step": result.steady_payload_bytes_per_step,
                    "link_bytes_per_step": result.steady_link_bytes_per_step,
                    "groups": result.groups,
                    "step_ms": 1e3 * result.step_seconds,
                    "comm_ms": 1e3 * result.comm_seconds / looped,
                    "compute_ms": 1e3 * result.compute_seconds / looped,
                    "predicted_ms": 1e3 * result.predicted_step_seconds,
                    "alpha_ms": 1e3 * result.planned_latency_s,
                    "contention": result.planned_contention,
                    "gather_piece_bytes": result.gather_piece_bytes,
                }
            )
    return rows


def summarise(
    ranks: Sequence[dict[str, list[dict[str, Any]]]], configs: dict[str, AllreduceConfig]
) -> dict[str, dict[str, Any]]:
    """Per configuration: its sync, compressor, planner and momentum, and the measurements."""
    table = {}
    for name, config in configs.items():
        first = ranks[0][name]
        table[name] = {
            "sync": config.sync,
            "compressor": config.compressor,
            "planner": config.planner,
            "momentum": config.momentum,
            "groups": first[0]["groups"],
            "accuracy": statistics.fmean(run["accuracy"] for run in first),
            "payload_bytes_per_step": first[0]["payload_bytes_per_step"],
            "link_bytes_per_step": first[0]["link_bytes_per_step"],
            **{
                key: statistics.median(run[key] for rank in ranks for run in rank[name])
                for key in (
                    "step_ms",
                    "comm_ms",
                    "compute_ms",
                    "predicted_ms",
                    "alpha_ms",
                    "contention",
                )
            },
            # each repeat's all_gather pieces (bytes; 0: whole), as rank 0 ran them
            "gather_piece_bytes": [run["gather_piece_bytes"] for run in first],
            # each repeat's step time (median over ranks): the run-to-run spread
            "step_ms_repeats": [
                statistics.median(rank[name][i]["step_ms"] for rank in ranks)
                for i in range(len(first))
            ],
        }
    return table


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def show(
    title: str, table: dict[str, dict[str, Any]], *, groups: bool = False, timing: bool = False
) -> Console:
    """Print the summary table (with `timing`: also the communication a step waited for and
    the planner's predicted step); returns the console for the ratio lines."""
    columns = ["method", *(["groups"] if groups else []), "accuracy", "payload B/step"]
    columns += ["link B/step", "step ms", *(["comm ms", "predicted ms"] if timing else [])]
    view = Table(title=title)
    for column in columns:
        view.add_column(column, justify="right")
    for name, row in table.items():
        view.add_row(
            name,
            *([str(row["groups"])] if groups else []),
            f"{row['accuracy']:.4f}",
            f"{row['payload_bytes_per_step']:.0f}",
            f"{row['link_bytes_per_step']:.0f}",
            f"{row['step_ms']:.2f}",
            *([f"{row['comm_ms']:.2f}", f"{row['predicted_ms']:.2f}"] if timing else []),
        )
    console = Console()
    console.print(view)
    return console
