"""How fast the planners decide, and how far their plans land from the exact optimum.

Run: python benchmarks/planner.py --json docs/planner.json
Decision time: for each size (default 50, 100, 200, 1000 tensors) and mode (gossip,
all-reduce), one random instance (`gossipcomp.schedule.random_instance`: sizes, compressor
costs and links spread over orders of magnitude; candidates identity, fp16, sign; the user's
compressor sign); each planner's `plan` is timed `--repeats` times after a warm-up, median
reported in ms, wall and CPU (this thread's time: what the decision costs, without waiting
for a CPU that other work on the machine holds). Gap: over `--instances` random instances of 1 to `--max-tensors` tensors (both
modes), each plan's predicted time against the exhaustive optimum of the same cost model
(`brute_force`: every contiguous partition x every candidate per group for strategy; the user's
compressor only for the merge planners), reported as predicted / optimum - 1. The brute force's
own time at the largest instances is reported beside the planners' for scale.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from results import save
from rich.console import Console
from rich.table import Table

from gossipcomp.schedule import PLANNERS, brute_force, make_planner, predict_iteration
from gossipcomp.schedule import random_instance as draw

CANDIDATES = ("identity", "fp16", "sign")
USER = "sign"
MODES = ("gossip", "allreduce")
SPECS = {name: name for name in PLANNERS} | {"strategy": "strategy:candidates=identity|fp16|user"}


Timings = dict[str, dict[str, dict[str, float]]]  # planner -> mode -> size -> ms


def decision_ms(sizes: list[int], repeats: int, seed: int) -> tuple[Timings, Timings]:
    """Median wall ms and median CPU ms (this thread's) of each planner's decision, per mode
    and size. CPU time is what the decision costs; wall time adds waiting for the CPU, which
    other work on a shared machine inflates."""
    rng = np.random.default_rng(seed)
    wall: Timings = {name: {mode: {} for mode in MODES} for name in SPECS}
    cpu: Timings = {name: {mode: {} for mode in MODES} for name in SPECS}
    for mode in MODES:
        for size in sizes:
            tensors, costs = draw(rng, size, mode, CANDIDATES)  # type: ignore[arg-type]
            for name, spec in SPECS.items():
                planner = make_planner(spec)
                planner.plan(tensors, costs, USER)
                walls, cpus = [], []
                for _ in range(repeats):
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    planner.plan(tensors, costs, USER)
                    walls.append(time.perf_counter() - start)
                    cpus.append(time.thread_time() - start_cpu)
                wall[name][mode][str(size)] = 1e3 * statistics.median(walls)
                cpu[name][mode][str(size)] = 1e3 * statistics.median(cpus)
    return wall, cpu


def _worst(timings: Timings, size: int) -> float:
    """The slowest planner's time at `size`, over both modes."""
    return max(timings[name][mode][str(size)] for name in SPECS for mode in MODES)


def gaps(instances: int, max_tensors: int, seed: int) -> tuple[dict[str, dict], dict[str, float]]:
    """Per planner: worst and mean gap to the brute-force optimum; and brute-force timings."""
    rng = np.random.default_rng(seed + 1)
    found: dict[str, list[float]] = {name: [] for name in SPECS}
    brute_ms: list[float] = []
    for index in range(instances):
        mode = MODES[index % 2]
        n = int(rng.integers(1, max_tensors + 1))
        tensors, costs = draw(rng, n, mode, CANDIDATES)  # type: ignore[arg-type]
        start = time.perf_counter()
        optimum_all = brute_force(tensors, costs, CANDIDATES)
        if n == max_tensors:
            brute_ms.append(1e3 * (time.perf_counter() - start))
        optimum_user = brute_force(tensors, costs, [USER])
        for name, spec in SPECS.items():
            optimum = optimum_all if name == "strategy" else optimum_user
            plan = make_planner(spec).plan(tensors, costs, USER)
            found[name].append(predict_iteration(tensors, plan, costs) / optimum.seconds - 1)
    summary = {
        name: {"max": max(values), "mean": statistics.fmean(values)}
        for name, values in found.items()
    }
    timing = {
        "tensors": max_tensors,
        "median_ms": statistics.median(brute_ms) if brute_ms else float("nan"),
        "instances": len(brute_ms),
    }
    return summary, timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200, 1000])
    parser.add_argument("--repeats", type=int, default=9, help="timed decisions per point")
    parser.add_argument("--instances", type=int, default=300, help="random instances for gaps")
    parser.add_argument("--max-tensors", type=int, default=10, help="largest gap instance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.repeats < 1 or args.instances < 2:
        parser.error("sizes and repeats must be >= 1 and instances >= 2")
    if not 1 <= args.max_tensors <= 10:
        parser.error("--max-tensors must lie in 1..10 (brute force grows as 4^n)")

    load_before = os.getloadavg()[0]
    console = Console()
    decisions, decisions_cpu = decision_ms(args.sizes, args.repeats, args.seed)
    gap_summary, brute = gaps(args.instances, args.max_tensors, args.seed)

    table = Table(
        title="decision ms, wall / CPU (max of gossip, all-reduce), and gap to brute force"
    )
    table.add_column("planner", justify="left")
    for size in args.sizes:
        table.add_column(f"{size} tensors", justify="right")
    table.add_column("max gap", justify="right")
    table.add_column("mean gap", justify="right")
    for name in SPECS:
        cells = [
            f"{max(decisions[name][m][str(size)] for m in MODES):.2f} / "
            f"{max(decisions_cpu[name][m][str(size)] for m in MODES):.2f}"
            for size in args.sizes
        ]
        table.add_row(
            name,
            *cells,
            f"{100 * gap_summary[name]['max']:.2f}%",
            f"{100 * gap_summary[name]['mean']:.2f}%",
        )
    console.print(table)
    console.print(
        f"brute force at {brute['tensors']} tensors: {brute['median_ms']:.0f} ms median "
        f"({brute['instances']} instances); load {load_before:.2f} -> {os.getloadavg()[0]:.2f}"
    )

    if args.json:
        report = {
            "command": "python benchmarks/planner.py " + " ".join(argv or sys.argv[1:]),
            "machine": platform.machine(),
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "candidates": list(CANDIDATES),
            "user_compressor": USER,
            "sizes": args.sizes,
            "decision_ms": decisions,
            "decision_cpu_ms": decisions_cpu,
            "decision_ms_max_at_size": {str(size): _worst(decisions, size) for size in args.sizes},
            "decision_cpu_ms_max_at_size": {
                str(size): _worst(decisions_cpu, size) for size in args.sizes
            },
            "instances": args.instances,
            "max_tensors": args.max_tensors,
            "gap_vs_bruteforce": gap_summary,
            "max_gap_vs_bruteforce": {
                name: gap_summary[name]["max"] for name in ("mergecomp", "strategy")
            },
            "bruteforce_ms": brute,
        }
        save(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
