"""A lying neighbour on ring8 digits: plain averaging against clipped gossip, side by side.

Run: python benchmarks/byzantine.py --json docs/byzantine.json
For each algorithm (D-PSGD, and Choco with compressors), each a real `simulate` (8 peers, gRPC on
loopback, same seed and rounds): fault-free; one peer (rank --liar) sending an attacked model
(sign_flip: -scale x; scale: scale x) with plain averaging, with adaptive clipping and with a
fixed radius; and the clipped runs without a liar too (what clipping costs when nobody lies).
Reports the honest peers' mean and min test accuracy and their ratio to the fault-free run; a
run whose models blew up (NaN/Inf) is reported as diverged, with the error, instead.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    algorithm: str  # label of the algorithm column
    attack: str | None  # None: fault-free
    clip: str | None  # None: plain averaging
    config: TrainConfig


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    for spec in args.algorithms:
        algorithm, _, compressor = spec.partition(":")
        base = TrainConfig(
            algorithm=algorithm,
            compressor=compressor or None,
            rounds=args.rounds,
            seed=args.seed,
            eval_every=0,
            attack_scale=args.attack_scale,
        )
        clips = [None, "adaptive", *(f"fixed:{tau}" for tau in args.taus)]
        for clip in clips:
            out.append(Case(spec, None, clip, replace(base, clip=clip)))
        for attack in args.attacks:
            lying = replace(base, byzantine=(args.liar,), attack=attack)
            for clip in clips:
                out.append(Case(spec, attack, clip, replace(lying, clip=clip)))
    return out


def run_one(case: Case, topology) -> dict:
    start = time.perf_counter()
    row = {
        "algorithm": case.algorithm,
        "attack": case.attack,
        "attack_scale": case.config.attack_scale if case.attack else None,
        "byzantine": list(case.config.byzantine),
        "clip": case.clip,
        "rounds": case.config.rounds,
    }
    try:
        report = run_simulation(case.config, topology)
    except RuntimeError as error:  # diverged: a result, not a failure of the benchmark
        return {
            **row,
            "diverged": str(error),
            "honest_mean_accuracy": None,
            "honest_min_accuracy": None,
            "seconds": time.perf_counter() - start,
        }
    return {
        **row,
        "diverged": None,
        "honest_mean_accuracy": report.honest_test_accuracy,
        "honest_min_accuracy": report.honest_min_test_accuracy,
        "per_peer_accuracy": [p.test_accuracy for p in report.per_peer],
        "bytes_sent_total": report.bytes_sent_total,
        "seconds": time.perf_counter() - start,
    }


def with_ratios(runs: list[dict]) -> list[dict]:
    """Each run's honest mean over the fault-free, unclipped run of the same algorithm."""
    for run in runs:
        reference = next(
            r
            for r in runs
            if r["algorithm"] == run["algorithm"] and r["attack"] is None and r["clip"] is None
        )
        mean, fault_free = run["honest_mean_accuracy"], reference["honest_mean_accuracy"]
        diverged = mean is None or fault_free is None
        run["ratio_to_fault_free"] = None if diverged else mean / fault_free
        run["points_below_fault_free"] = None if diverged else 100 * (fault_free - mean)
    return runs


def table(runs: list[dict], title: str) -> Table:
    t = Table(title=title)
    for column in ("algorithm", "liar", "mixing", "honest mean", "honest min", "/ fault-free", "s"):
        t.add_column(column, justify="right")
    for run in runs:
        if run["diverged"]:
            measured = ["diverged", "-", "-"]
        else:
            measured = [
                f"{run['honest_mean_accuracy']:.4f}",
                f"{run['honest_min_accuracy']:.4f}",
                "-" if run["ratio_to_fault_free"] is None else f"{run['ratio_to_fault_free']:.3f}",
            ]
        t.add_row(
            run["algorithm"],
            run["attack"] or "none",
            run["clip"] or "plain",
            *measured,
            f"{run['seconds']:.1f}",
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the runs here")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--liar", type=int, default=3, help="the Byzantine rank")
    parser.add_argument("--attacks", nargs="+", default=["sign_flip", "scale"])
    parser.add_argument("--attack-scale", type=float, default=4.0)
    parser.add_argument("--taus", nargs="+", type=float, default=[0.3], help="fixed radii")
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["dpsgd", "choco:topk:ratio=0.05", "choco:sign"],
        help="ALGORITHM or ALGORITHM:COMPRESSOR",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    topology = load_topology(ROOT / "topologies" / "ring8.yaml")
    console = Console()
    runs = []
    for case in cases(args):
        runs.append(run_one(case, topology))
        last = runs[-1]
        outcome = (
            f"diverged: {last['diverged']}"
            if last["diverged"]
            else f"honest mean {last['honest_mean_accuracy']:.4f} "
            f"min {last['honest_min_accuracy']:.4f}"
        )
        console.print(
            f"{case.algorithm} liar={case.attack} clip={case.clip}: {outcome} "
            f"({last['seconds']:.1f} s)",
            highlight=False,
        )
    with_ratios(runs)
    title = (
        f"ring8 digits, {args.rounds} rounds, rank {args.liar} lying "
        f"(x{args.attack_scale}): honest peers' test accuracy"
    )
    console.print(table(runs, title))
    if args.json:
        command = shlex.join(["python", "benchmarks/byzantine.py", *sys.argv[1:]])
        payload = {
            "command": command,
            "topology": topology.name,
            "rounds": args.rounds,
            "seed": args.seed,
            "liar": args.liar,
            "attack_scale": args.attack_scale,
            "runs": runs,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
