"""Static against time-varying graphs: accuracy against bytes on 16 peers, digits.

Run: python benchmarks/time_varying.py --json docs/time_varying.json
Each run is a real `simulate` (16 peers, gRPC on loopback), same rounds, seed and partition,
on ring16 and exponential16 (static) and on one-peer exponential and base-2 (k: 1) graphs of 16
peers (one neighbour a round), with D-PSGD and rank-1 PowerGossip. Bytes are the serialised
bytes every peer sent. For each run: the final mean test accuracy, the bytes, and the accuracy
of the static runs at the bytes the one-peer exponential run of the same algorithm sent in all
(their last checkpoint within that budget): the comparison at 1/degree of the bytes. On a
power of two, base-2 (k: 1) is the same sequence of matchings as one-peer exponential (a
check: their runs must agree); it differs for other n.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.topology import Topology, topology_from_dict

ONE_PEER = "one-peer exp."


def topologies(n: int) -> dict[str, Topology]:
    """The static and time-varying graphs compared, on `n` peers (a power of two)."""
    return {
        "ring (static)": topology_from_dict({"kind": "ring", "n": n, "name": f"ring{n}"}),
        "exponential (static)": topology_from_dict(
            {"kind": "exponential", "n": n, "name": f"exponential{n}"}
        ),
        ONE_PEER: topology_from_dict({"kind": "one-peer-exponential", "n": n}),
        "base-2": topology_from_dict({"kind": "base-k", "n": n, "k": 1}),
    }


def algorithms(rounds: int, seed: int, eval_every: int) -> dict[str, TrainConfig]:
    base = TrainConfig(rounds=rounds, seed=seed, eval_every=eval_every)
    return {
        "D-PSGD": replace(base, algorithm="dpsgd"),
        "PowerGossip r1": replace(base, algorithm="powergossip", rank=1),
    }


def accuracy_at(history: list[dict], budget: int) -> float | None:
    """The accuracy at the last checkpoint whose bytes stay within `budget` (None: none)."""
    within = [h for h in history if h["bytes"] <= budget]
    return within[-1]["accuracy"] if within else None


def run_one(graph: str, topology: Topology, algorithm: str, config: TrainConfig) -> dict:
    start = time.perf_counter()
    report = run_simulation(config, topology)
    return {
        "graph": graph,
        "topology": topology.name,
        "period": topology.period,
        "degree": max(len(topology.neighbors(r)) for r in range(topology.n)),
        "algorithm": algorithm,
        "partition": config.partition,
        "rounds": config.rounds,
        "final_test_accuracy": report.final_test_accuracy,
        "bytes_sent_total": report.bytes_sent_total,
        "history": [
            {"round": h.round, "accuracy": h.mean_test_accuracy, "bytes": h.bytes_sent_total}
            for h in report.history
        ],
        "seconds": time.perf_counter() - start,
    }


def with_equal_bytes(runs: list[dict]) -> list[dict]:
    """Each run with `accuracy_at_one_peer_bytes`: its accuracy within the bytes the one-peer
    run of its algorithm and partition sent in all."""
    for run in runs:
        one_peer = next(
            (
                r
                for r in runs
                if r["graph"] == ONE_PEER
                and r["algorithm"] == run["algorithm"]
                and r["partition"] == run["partition"]
            ),
            None,
        )
        budget = None if one_peer is None else one_peer["bytes_sent_total"]
        run["accuracy_at_one_peer_bytes"] = (
            None if budget is None else accuracy_at(run["history"], budget)
        )
    return runs


def markdown(runs: list[dict]) -> str:
    lines = [
        "| partition | algorithm | graph | union degree | final accuracy | MB sent | "
        "accuracy at the one-peer run's bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        at = run["accuracy_at_one_peer_bytes"]
        lines.append(
            f"| {run['partition']} | {run['algorithm']} | {run['graph']} | {run['degree']} | "
            f"{run['final_test_accuracy']:.4f} | {run['bytes_sent_total'] / 1e6:.1f} | "
            + ("-" if at is None else f"{at:.4f}")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the runs here")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", type=int, default=16, help="a power of two")
    parser.add_argument("--partitions", nargs="+", default=["by-label"])
    parser.add_argument("--graphs", nargs="*", help="run only graphs whose label has one of these")
    parser.add_argument("--algorithms", nargs="*", help="run only these algorithm labels")
    parser.add_argument(
        "--render", type=Path, help="no runs: print the Markdown table of this JSON"
    )
    args = parser.parse_args()
    if args.render:
        print(markdown(json.loads(args.render.read_text())["runs"]))
        return
    torch.set_num_threads(1)
    graphs = {
        label: topology
        for label, topology in topologies(args.peers).items()
        if not args.graphs or any(g in label for g in args.graphs)
    }
    configs = {
        label: config
        for label, config in algorithms(args.rounds, args.seed, args.eval_every).items()
        if not args.algorithms or label in args.algorithms
    }
    console = Console()
    runs = []
    for partition in args.partitions:
        for algorithm, config in configs.items():
            for graph, topology in graphs.items():
                run = run_one(graph, topology, algorithm, replace(config, partition=partition))
                console.print(
                    f"{partition:9s} {algorithm:15s} {graph:21s} "
                    f"acc {run['final_test_accuracy']:.4f} "
                    f"{run['bytes_sent_total'] / 1e6:9.1f} MB  {run['seconds']:.0f} s"
                )
                runs.append(run)
    runs = with_equal_bytes(runs)
    print(markdown(runs))
    if args.json:
        summary = {"rounds": args.rounds, "seed": args.seed, "peers": args.peers, "runs": runs}
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
