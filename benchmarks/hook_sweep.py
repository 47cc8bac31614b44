"""Learning rates and momenta each all-reduce DDP hook trains at: a sweep on digits.

Run: python benchmarks/hook_sweep.py --json docs/hook_sweep.json
N gloo processes (default 2) train the digits MLP through DDP with small buckets
(`--bucket-cap-mb`, default 0.001: each weight matrix in a bucket of its own, 3 buckets) for
every hook at every (learning rate, momentum) of the grid, in the same processes, the cells in
turn. A hook "trains" at a cell when its final test accuracy is at least plain all-reduce's at
the same cell minus `--margin` (default 0.02) and plain all-reduce itself reaches `--floor`
(default 0.9) there; cells where plain all-reduce does not train say nothing about a hook.
Momentum goes where `gossipcomp allreduce` puts it: into the optimizer, except for the sign
codecs, whose hook keeps it before compressing (hooks.takes_momentum).

The JSON has every cell's accuracy, `trains` per hook (cell -> bool) and `ranges` per hook and
momentum: the learning rates it trains at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from allreduce_runs import machine, run_configs, summarise
from results import save
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce import register
from gossipcomp.allreduce.launch import Session, spawn
from gossipcomp.allreduce.train import MODELS, AllreduceConfig

HOOKS = {
    "allreduce": "identity",
    "powersgd rank 2": "powersgd:rank=2",
    "top-1%": "topk:ratio=0.01",
    "sign": "sign",
    "onebit": "onebit",
}
PLAIN = "allreduce"
LRS = (0.01, 0.03, 0.1, 0.3)
MOMENTA = (0.0, 0.9)


def cell(lr: float, momentum: float) -> str:
    return f"lr {lr:g}, momentum {momentum:g}"


def configs(
    hooks: dict[str, str],
    lrs: tuple[float, ...],
    momenta: tuple[float, ...],
    steps: int,
    bucket_cap_mb: float,
) -> dict[str, AllreduceConfig]:
    """One configuration per hook and cell, named "HOOK | CELL"."""
    return {
        f"{name} | {cell(lr, momentum)}": AllreduceConfig(
            compressor=spec,
            lr=lr,
            momentum=momentum,
            steps=steps,
            bucket_cap_mb=bucket_cap_mb,
        )
        for lr in lrs
        for momentum in momenta
        for name, spec in hooks.items()
    }


def buckets(config: AllreduceConfig) -> int:
    """DDP's buckets for `config`'s model after its rebuild: the identity hook's collectives in
    the second step (one a bucket)."""
    ddp = DistributedDataParallel(
        MODELS[config.model](config.seed), bucket_cap_mb=config.bucket_cap_mb
    )
    state = register(ddp, "identity")
    x, y = torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)
    for _ in range(2):  # DDP rebuilds its buckets after the first
        before = state.communicator.traffic.collectives
        F.cross_entropy(ddp(x), y).backward()
    state.communicator.close()
    return state.communicator.traffic.collectives - before


def sweep(
    session: Session, grid: dict[str, AllreduceConfig]
) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """This rank's bucket count and measurements of every cell (benchmarks/allreduce_runs)."""
    return buckets(next(iter(grid.values()))), run_configs(session, grid, 1)


def verdicts(
    table: dict[str, dict[str, Any]],
    hooks: dict[str, str],
    lrs: tuple[float, ...],
    momenta: tuple[float, ...],
    margin: float,
    floor: float,
) -> tuple[dict[str, dict[str, bool]], dict[str, dict[str, list[float]]]]:
    """(trains: hook -> cell -> bool, ranges: hook -> momentum -> learning rates it trains at)."""
    trains: dict[str, dict[str, bool]] = {name: {} for name in hooks}
    ranges: dict[str, dict[str, list[float]]] = {name: {} for name in hooks}
    for momentum in momenta:
        for lr in lrs:
            key = cell(lr, momentum)
            plain = table[f"{PLAIN} | {key}"]["accuracy"]
            for name in hooks:
                accuracy = table[f"{name} | {key}"]["accuracy"]
                ok = plain >= floor and accuracy >= plain - margin
                trains[name][key] = ok
                if ok:
                    ranges[name].setdefault(f"{momentum:g}", []).append(lr)
    return trains, ranges


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.001)
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--momenta", type=float, nargs="+", default=list(MOMENTA))
    parser.add_argument("--hooks", nargs="+", choices=sorted(HOOKS), default=list(HOOKS))
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--floor", type=float, default=0.9)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    hooks = {name: HOOKS[name] for name in dict.fromkeys([PLAIN, *args.hooks])}
    lrs, momenta = tuple(args.lrs), tuple(args.momenta)
    grid = configs(hooks, lrs, momenta, args.steps, args.bucket_cap_mb)
    results = spawn(sweep, args.nproc, (grid,), timeout_s=60, deadline_s=3600)
    table = summarise([rows for _, rows in results], grid)
    trains, ranges = verdicts(table, hooks, lrs, momenta, args.margin, args.floor)
    result = {
        "nproc": args.nproc,
        "steps": args.steps,
        "bucket_cap_mb": args.bucket_cap_mb,
        "buckets": results[0][0],
        "margin": args.margin,
        "floor": args.floor,
        "accuracy": {name: row["accuracy"] for name, row in table.items()},
        "trains": trains,
        "ranges": ranges,
        "machine": machine(),
    }
    view = Table(title=f"final accuracy, {args.nproc} gloo ranks, {args.steps} steps (* trains)")
    view.add_column("hook")
    for momentum in momenta:
        for lr in lrs:
            view.add_column(cell(lr, momentum), justify="right")
    for name in hooks:
        row = []
        for momentum in momenta:
            for lr in lrs:
                key = cell(lr, momentum)
                mark = "*" if trains[name][key] else ""
                row.append(f"{table[f'{name} | {key}']['accuracy']:.3f}{mark}")
        view.add_row(name, *row)
    Console(width=200).print(view)
    save(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
