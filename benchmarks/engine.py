"""simulate's wall time per round against the same peers' work done one peer at a time.

Run: python benchmarks/engine.py --json docs/engine.json
For each size (8, 16, 32, 64 peers on a ring; PowerGossip rank 1, the digits MLP, test accuracy
only at the end), two runs of the same training, side by side in one invocation:

- simulate: `run_simulation`, what `gossipcomp simulate --quiet` runs (every peer with its own
  gRPC server and channels in this process, each training in its own thread);
- back to back: the same trainers (config, data, models, algorithm, PeerTrainer loop) over the
  in-memory transport, every peer thread pinned to one core, so only one peer computes at a
  time and the wall time is the work itself (local step, mixing, encoding, the inbox's checks
  and mailbox) done serially, plus the thread switches at each wait for a neighbour.

One process against worker processes, as ratios from the same invocation: each size's
one-process cost per peer-round (simulate seconds per round / peers), its growth from the
smallest size to the largest (`per_peer_round_growth`: flat would be 1.0), and one process
against --workers N on the same ring (`one_process_vs_workers`). `report_round_s` is what
`gossipcomp simulate --quiet` reports (the report's wall seconds / rounds, start-up included).

Per round is measured between the moment every peer has finished round --warmup and the moment
every peer has finished round --rounds - 1 (startup, handshakes and the final evaluation left
out). efficiency = back-to-back seconds / (simulate seconds x usable cores): 1.0 would be
simulate spreading exactly that work over every core with nothing added. The back-to-back
seconds are the pinned run's process CPU seconds: on an idle core they equal its wall time
(also written), but on a shared machine a single pinned core's wall time swells with everyone
else's work far more than simulate's hundred threads do (measured at load 10-18 on 2 cores:
20 ms of wall per peer-round against 4.6 ms of CPU). Two parts are written next to it: work_fraction = back-to-back CPU /
simulate CPU (how much of what simulate burns is the work) and core_use = simulate CPU /
(simulate wall x cores) (how much of the cores it keeps busy); efficiency is their product.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.experiment import PeerTrainer, TrainConfig, build_algorithm
from gossipcomp.experiment.simulation import run_simulation, usable_cores
from gossipcomp.peer import Peer
from gossipcomp.topology import Topology, build_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload.data import load_digits_split
from gossipcomp.workload.models import build_model, model_signature


@dataclass
class RoundClock:
    """When each peer first reached each of two rounds (wall and process CPU clocks), filled in
    from the peers' own threads: one slot per rank, so no lock is needed."""

    peers: int
    start_round: int
    end_round: int

    def __post_init__(self) -> None:
        self._reached: dict[int, list[tuple[float, float] | None]] = {
            mark: [None] * self.peers for mark in (self.start_round, self.end_round)
        }

    def on_round(self, rank: int, round_: int) -> None:
        for mark, slots in self._reached.items():
            if round_ >= mark and slots[rank] is None:
                slots[rank] = (time.perf_counter(), time.process_time())

    def per_round(self) -> tuple[float, float]:
        """Wall and CPU seconds per round between the last peer reaching each mark."""
        start, end = (self._last(mark) for mark in (self.start_round, self.end_round))
        rounds = self.end_round - self.start_round
        return (end[0] - start[0]) / rounds, (end[1] - start[1]) / rounds

    def _last(self, mark: int) -> tuple[float, float]:
        slots = self._reached[mark]
        missing = [rank for rank, slot in enumerate(slots) if slot is None]
        if missing:
            raise RuntimeError(f"peers {missing} never reached round {mark}")
        return max(slots, key=lambda slot: slot[0])  # type: ignore[arg-type, return-value]


def simulate_round(
    config: TrainConfig, topology: Topology, warmup: int, workers: int = 1
) -> tuple[float, float, float]:
    """simulate's wall and process CPU seconds per round (with worker processes, the CPU
    seconds are this process's alone: the workers' are not seen), and the report's wall
    seconds per round (start-up and the final evaluation included)."""
    clock = RoundClock(topology.n, warmup, config.rounds - 1)
    report = run_simulation(
        config, topology, progress=clock.on_round, startup_timeout=300.0, workers=workers
    )
    return (*clock.per_round(), report.wall_seconds / config.rounds)


def in_memory_trainers(topology: Topology, config: TrainConfig) -> list[PeerTrainer]:
    """A PeerTrainer per rank, as simulate builds them, over one in-memory hub."""
    data = load_digits_split(seed=config.seed)
    hub = InMemoryHub()
    trainers = []
    for rank in range(topology.n):
        model = build_model(config.model, config.seed)
        identity = Identity(rank, topology.hash, model_signature(model))
        transport = InMemoryTransport(identity, topology.neighbors(rank), hub)
        peer = Peer(model, topology, rank, build_algorithm(config, topology, rank), transport)
        trainers.append(PeerTrainer(peer, data, config))
    for trainer in trainers:
        trainer.peer.start(10, {})
    return trainers


def _run_pinned(trainers: Sequence[PeerTrainer], core: int, clock: RoundClock) -> None:
    """Every trainer in its own thread, each thread pinned to `core` (on Linux the affinity
    of pid 0 is the calling thread's), so their work runs one after another."""
    errors: list[BaseException] = []

    def run(trainer: PeerTrainer) -> None:
        os.sched_setaffinity(0, {core})
        rank = trainer.peer.rank
        try:
            trainer.run(on_round=lambda r: clock.on_round(rank, r))
        except BaseException as error:  # re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def back_to_back_round(config: TrainConfig, topology: Topology, warmup: int) -> tuple[float, float]:
    """Wall and process CPU seconds per round of the in-memory peers on one core."""
    trainers = in_memory_trainers(topology, config)
    clock = RoundClock(topology.n, warmup, config.rounds - 1)
    try:
        _run_pinned(trainers, min(os.sched_getaffinity(0)), clock)
    finally:
        for trainer in trainers:
            trainer.peer.close()
    return clock.per_round()


RUN_FIELDS = ("simulate", "simulate_cpu", "report", "back_to_back", "back_to_back_cpu")


def measure(
    peers: int, rounds: int, warmup: int, cores: int, repeats: int, workers: int = 1
) -> dict:
    """Both runs `repeats` times, alternating (the machine is shared); medians of each time.
    With `workers` > 1, a third run: simulate with its peers over that many processes."""
    topology = build_topology("ring", n=peers)
    config = TrainConfig(algorithm="powergossip", rank=1, rounds=rounds, eval_every=0)
    load_before = os.getloadavg()[0]
    runs, spread = [], []
    for _ in range(repeats):
        runs.append(
            (
                *simulate_round(config, topology, warmup),
                *back_to_back_round(config, topology, warmup),
            )
        )
        if workers > 1:
            spread.append(simulate_round(config, topology, warmup, workers)[0])
    simulate_s, simulate_cpu_s, report_s, serial_s, serial_cpu_s = (
        statistics.median(t) for t in zip(*runs, strict=True)
    )
    with_workers = (
        {
            "workers": workers,
            "simulate_workers_round_s": statistics.median(spread),
            "efficiency_workers": serial_cpu_s / (statistics.median(spread) * cores),
            "one_process_vs_workers": simulate_s / statistics.median(spread),
        }
        if spread
        else {}
    )
    return {
        **with_workers,
        "peers": peers,
        "simulate_round_s": simulate_s,
        "simulate_cpu_round_s": simulate_cpu_s,
        "simulate_per_peer_ms": 1e3 * simulate_s / peers,
        "report_round_s": report_s,
        "back_to_back_round_s": serial_s,
        "back_to_back_cpu_round_s": serial_cpu_s,
        "back_to_back_per_peer_ms": 1e3 * serial_cpu_s / peers,
        "efficiency": serial_cpu_s / (simulate_s * cores),
        "work_fraction": serial_cpu_s / simulate_cpu_s,
        "core_use": simulate_cpu_s / (simulate_s * cores),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "runs_s": [dict(zip(RUN_FIELDS, run, strict=True)) for run in runs],
    }


def per_peer_round_growth(rows: Sequence[dict]) -> float:
    """One process's cost per peer-round at the largest size over the smallest (rows in the
    order measured, any order of sizes)."""
    by_size = sorted(rows, key=lambda row: row["peers"])
    return by_size[-1]["simulate_per_peer_ms"] / by_size[0]["simulate_per_peer_ms"]


def table(rows: Sequence[dict], cores: int) -> Table:
    t = Table(title=f"ring, PowerGossip rank 1: seconds per round ({cores} usable cores)")
    columns: dict[str, Callable[[dict], str]] = {
        "peers": lambda r: str(r["peers"]),
        "simulate ms": lambda r: f"{1e3 * r['simulate_round_s']:.1f}",
        "simulate CPU ms": lambda r: f"{1e3 * r['simulate_cpu_round_s']:.1f}",
        "per peer-round ms": lambda r: f"{r['simulate_per_peer_ms']:.2f}",
        "report ms": lambda r: f"{1e3 * r['report_round_s']:.1f}",
        "back to back CPU ms": lambda r: f"{1e3 * r['back_to_back_cpu_round_s']:.1f}",
        "(wall ms)": lambda r: f"{1e3 * r['back_to_back_round_s']:.1f}",
        "per peer ms": lambda r: f"{r['back_to_back_per_peer_ms']:.2f}",
        "efficiency": lambda r: f"{r['efficiency']:.3f}",
        "workers ms": lambda r: (
            f"{1e3 * r['simulate_workers_round_s']:.1f}" if "workers" in r else "-"
        ),
        "efficiency (workers)": lambda r: (
            f"{r['efficiency_workers']:.3f}" if "workers" in r else "-"
        ),
        "one process / workers": lambda r: (
            f"{r['one_process_vs_workers']:.2f}" if "workers" in r else "-"
        ),
        "work fraction": lambda r: f"{r['work_fraction']:.2f}",
        "core use": lambda r: f"{r['core_use']:.2f}",
        "load": lambda r: f"{r['load_average_1min'][0]:.1f}",
    }
    for name in columns:
        t.add_column(name, justify="right")
    for row in rows:
        t.add_row(*(cell(row) for cell in columns.values()))
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=40, help="rounds per run")
    parser.add_argument(
        "--warmup", type=int, default=5, help="rounds before timing starts (of --rounds)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each kind per size (medians reported)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="also time simulate --workers N (1: only the single process)",
    )
    args = parser.parse_args()
    if not 1 <= args.warmup <= args.rounds - 2:
        parser.error(f"--warmup must be in [1, --rounds - 2], got {args.warmup}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.peers) < 3:
        parser.error(f"a ring needs at least 3 peers, got {min(args.peers)}")
    torch.set_num_threads(1)
    cores = usable_cores()
    console = Console()
    rows = []
    for peers in args.peers:
        rows.append(measure(peers, args.rounds, args.warmup, cores, args.repeats, args.workers))
        row = rows[-1]
        console.print(
            f"{peers} peers: simulate {1e3 * row['simulate_round_s']:.1f} ms a round, back to "
            f"back {1e3 * row['back_to_back_cpu_round_s']:.1f} ms CPU "
            f"({1e3 * row['back_to_back_round_s']:.1f} ms wall), "
            f"efficiency {row['efficiency']:.3f}"
            + (
                f"; with {args.workers} workers {1e3 * row['simulate_workers_round_s']:.1f} ms, "
                f"efficiency {row['efficiency_workers']:.3f}"
                if "workers" in row
                else ""
            ),
            highlight=False,
        )
    console.print(table(rows, cores))
    growth = per_peer_round_growth(rows)
    console.print(
        f"one process, cost per peer-round at {rows[-1]['peers']} peers over {rows[0]['peers']}: "
        f"{growth:.2f}",
        highlight=False,
    )
    if args.json:
        report = {
            "command": shlex.join(["python", "benchmarks/engine.py", *sys.argv[1:]]),
            "algorithm": "powergossip rank 1",
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "repeats": args.repeats,
            "timed_rounds": args.rounds - 1 - args.warmup,
            "cores": cores,
            "torch": torch.__version__,
            "sizes": rows,
            "efficiency": {str(row["peers"]): row["efficiency"] for row in rows},
            "workers": args.workers,
            "efficiency_workers": {
                str(row["peers"]): row["efficiency_workers"] for row in rows if "workers" in row
            },
            "per_peer_round_growth": growth,
            "one_process_vs_workers": {
                str(row["peers"]): row["one_process_vs_workers"] for row in rows if "workers" in row
            },
            "load_average_1min": os.getloadavg()[0],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
