"""Predicted scaling from 8 to 1024 peers, and the timeline simulator's error against runs.

Gossip on a ring, a torus and an exponential graph, and ring all-reduce.

Run: python benchmarks/scaling.py --json docs/scaling.json --plot docs/scaling.png

Scaling table (`gossipcomp.schedule.timeline.simulate`, one processor per peer): per-peer costs
measured here on the model `gossipcomp simulate` trains (digits MLP 64-256-256-10, batch 32,
SGD with momentum, one thread): the local step's median time and its spread (a robust sigma
of log step times, drawn per peer and round), the compressor's compress and decompress times on the
flattened model and its exact wire bytes. Times are this thread's CPU time (torch on one
thread), which is what a peer with a processor of its own would take: on this shared machine
wall time would add waiting for a CPU that other work holds. Links are not measured here (one machine): two
alpha-beta links are assumed, MG-WFBP's fit of 10GbE (0.91 ms, 7.4e-10 s/B) and the same
latency at 1 Gbit/s (8e-9 s/B). Ring all-reduce sends the same payload (summable: identity, or
sign bits through Marsit).

Validation: each ring (`--validate`, default 4, 8, 16 peers) runs as `gossipcomp simulate
--topology ringN --eval-every 0 --workers N` does (same config, `run_simulation`, in a fresh
interpreter): a process per peer, as `gossipcomp peer` runs them, talking gRPC over loopback,
every process sharing this machine's cores. A hook stamps the wall time at the end of every
round, so a round's time is measured inside the run, over the rounds after the first
`--low-rounds` (start-up, set-up and the final evaluation left out). A calibration ring of
another size (`--calibrate`, default 6) is timed beside each measured ring (the order
alternating between `--repeats`). The simulator models the same thing: peers whose CPU tasks
(a local step, two per-neighbour decodes, in the report's compute share) are served by the
machine's usable cores, no link time (loopback transfers are CPU work, already in the costs);
the costs are scaled so that it reproduces the calibration ring's measured round time, and
then predict the other sizes. Nothing of a predicted run goes into its prediction. Reported
beside: the spread of the repeated measurements of a ring ((max - min) / mean), the noise floor
of a measurement on this shared machine. With every peer in one process instead (`--workers
1`) the cost of a peer-round grows with the number of peers (threads contending for one
interpreter lock), which no per-peer cost can model; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.compress import CompressionContext, parse_spec
from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import MAX_WORKERS, run_simulation, usable_cores
from gossipcomp.schedule import LAYOUTS, LinkCost, PeerCosts, simulate
from gossipcomp.topology import build_topology
from gossipcomp.workload.data import load_digits_split
from gossipcomp.workload.models import build_mlp
from gossipcomp.workload.training import make_optimizer

LINKS = {
    "10GbE": LinkCost(0.91e-3, 7.4e-10),  # MG-WFBP's fit for 16 workers on 10GbE
    "1GbE": LinkCost(0.91e-3, 8e-9),
}
COMPRESSORS = ("identity", "sign")
WINDOWS = 5  # consecutive stretches of a timed run, each timed on its own
NO_LINK = LinkCost(0.0, 0.0)  # loopback transfers are CPU work, already in the measured costs


def measure_peer_costs(spec: str, steps: int, seed: int = 0) -> tuple[PeerCosts, dict]:
    """The digits MLP's local step (median, spread) and `spec`'s costs on its flat parameters."""
    torch.manual_seed(seed)
    data = load_digits_split(seed=seed)
    model = build_mlp(seed)
    optimizer = make_optimizer(model, lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    times = []
    for step in range(steps + 3):
        index = torch.randint(0, data.x_train.shape[0], (32,), generator=generator)
        start = time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(data.x_train[index]), data.y_train[index])
        loss.backward()
        optimizer.step()
        if step >= 3:  # three warm-up steps
            times.append(time.thread_time() - start)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    compressor = parse_spec(spec)
    ctx = CompressionContext(seed=seed, sender=0, receiver=1, round=0, tensor_index=0)
    compress, decompress = [], []
    for trial in range(steps // 4 + 2):
        start = time.thread_time()
        payload = compressor.compress(flat, ctx)
        middle = time.thread_time()
        compressor.decompress(payload, ctx)
        if trial >= 2:
            compress.append(middle - start)
            decompress.append(time.thread_time() - middle)
    # a robust sigma of log step times (interquartile range / 1.349): the step's own variation
    quartiles = np.percentile(np.log(times), [25, 75])
    spread = float(quartiles[1] - quartiles[0]) / 1.349
    costs = PeerCosts(
        compute_s=statistics.median(times),
        message_bytes=compressor.wire_bytes(flat.numel()),
        compress_s=statistics.median(compress),
        decompress_s=statistics.median(decompress),
        compute_jitter=min(spread, 3.0),
    )
    return costs, {"spec": spec, "parameters": flat.numel(), **costs.__dict__}


def scaling_table(
    costs: dict[str, PeerCosts], peers: list[int], rounds: int, seed: int
) -> tuple[list[dict], float]:
    """A row per (link, compressor, layout, peers), and the slowest simulation's seconds."""
    rows, slowest = [], 0.0
    for link_name, link in LINKS.items():
        for spec, peer_costs in costs.items():
            for layout in LAYOUTS:
                for n in peers:
                    start = time.perf_counter()
                    timeline = simulate(layout, n, peer_costs, link, rounds, seed=seed)
                    slowest = max(slowest, time.perf_counter() - start)
                    rows.append(
                        {
                            "link": link_name,
                            "compressor": spec,
                            "layout": layout,
                            "peers": n,
                            "round_s": timeline.round_s,
                            "efficiency": timeline.efficiency,
                        }
                    )
    return rows, slowest


class RoundClock:
    """A `run_simulation` progress hook: the wall time at the end of each round (when the last
    peer reports it), so round times come from inside one run, without its start-up, set-up
    and final evaluation."""

    def __init__(self, peers: int) -> None:
        self.peers = peers
        self.reported: dict[int, int] = {}
        self.stamps: dict[int, float] = {}
        self._lock = threading.Lock()

    def __call__(self, rank: int, round: int) -> None:
        with self._lock:
            count = self.reported.get(round, 0) + 1
            self.reported[round] = count
            if count == self.peers:
                self.stamps[round] = time.perf_counter()
                del self.reported[round]  # counts only for rounds still in progress


def time_ring(peers: int, rounds: int, warmup: int) -> dict:
    """Run the ring as `gossipcomp simulate --topology ring<peers> --rounds <rounds>
    --eval-every 0 --workers <peers>` does (same config, `run_simulation`, a process per peer
    talking gRPC over loopback) and time its rounds after the first `warmup`: wall seconds per
    round, per stretch of the run, and the report's compute share."""
    torch.set_num_threads(1)  # as the simulate command does
    clock = RoundClock(peers)
    config = TrainConfig(rounds=rounds, eval_every=0)
    report = run_simulation(config, build_topology("ring", n=peers), progress=clock, workers=peers)
    first, last = warmup, max(clock.stamps)
    if last <= first or first not in clock.stamps:
        raise RuntimeError(f"ring of {peers}: rounds {first} to {last} were not all timed")
    compute = sum(p.compute_seconds for p in report.per_peer)
    comm = sum(p.comm_seconds for p in report.per_peer)
    bounds = np.linspace(first, last, WINDOWS + 1).round().astype(int).tolist()
    return {
        "peers": peers,
        "rounds": [first, last],
        "round_s": (clock.stamps[last] - clock.stamps[first]) / (last - first),
        "window_round_s": [
            (clock.stamps[b] - clock.stamps[a]) / (b - a)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            if b > a
        ],
        "compute_share": compute / (compute + comm) if compute + comm > 0 else 0.5,
    }


def timed_run(peers: int, warmup: int, peer_rounds: int) -> dict:
    """`time_ring` in a fresh interpreter (as a `simulate` command runs): warmup rounds, then
    max(2, peer_rounds // peers) timed rounds."""
    rounds = warmup + max(2, peer_rounds // peers)
    command = [sys.executable, __file__, "--time-ring", str(peers), str(rounds), str(warmup)]
    done = subprocess.run(command, check=True, timeout=1800, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured_pair(
    peers: int, calibrate: int, warmup: int, peer_rounds: int, first: str
) -> tuple[dict, dict]:
    """A ring of `peers` and the calibration ring, timed one after the other (`first` says
    which goes first; repeats alternate, so a drift of other work weighs on both alike). A
    ring as large as the calibration ring is its own calibration (in-sample: a check only)."""
    if peers == calibrate:
        own = timed_run(peers, warmup, peer_rounds)
        return own, own
    order = ("ring", "calibration") if first == "ring" else ("calibration", "ring")
    sizes = {"ring": peers, "calibration": calibrate}
    runs = {key: timed_run(sizes[key], warmup, peer_rounds) for key in order}
    return runs["ring"], runs["calibration"]


def calibrated_costs(calibration: dict, cores: int) -> PeerCosts:
    """Per-peer costs that make the simulator reproduce the calibration ring: a local step and
    two per-neighbour decodes in the report's compute share, scaled so that the simulated ring
    of the calibration's size on `cores` shared processors (no link time: loopback transfers
    are CPU work, inside the costs) takes the calibration's measured round time. Every cost
    of the peers' processes (gRPC's threads, process switches, the peers' own work) is in
    that one scale."""
    share = calibration["compute_share"]
    unit = PeerCosts(compute_s=share, message_bytes=0, decompress_s=(1 - share) / 2)
    unit_round = simulate("ring", calibration["peers"], unit, NO_LINK, 30, cores=cores).round_s
    return scaled(unit, calibration["round_s"] / unit_round)


def scaled(costs: PeerCosts, factor: float) -> PeerCosts:
    """`costs` with every CPU task `factor` times as long."""
    return replace(
        costs,
        compute_s=costs.compute_s * factor,
        compress_s=costs.compress_s * factor,
        decompress_s=costs.decompress_s * factor,
    )


def validation(
    peers: list[int], warmup: int, peer_rounds: int, calibrate: int, repeats: int
) -> dict:
    """For each ring of `peers`, `repeats` times (sizes interleaved, the order within a pair
    alternating): time it and the calibration ring, each peer in its own process. The
    prediction for a run of a ring: the simulator with the costs calibrated on the ring timed
    beside it, on the machine's usable cores shared by all peers, against the run's measured
    round time. Nothing of the predicted run goes into its prediction."""
    cores = usable_cores()
    rows, calibrations = [], []
    pairs: dict[int, list[tuple[dict, dict]]] = {n: [] for n in peers}
    for repeat in range(repeats):
        for n in peers:
            first = "ring" if repeat % 2 else "calibration"
            pairs[n].append(measured_pair(n, calibrate, warmup, peer_rounds, first))
    for n, measured in pairs.items():
        predicted = []
        for _, calibration in measured:
            costs = calibrated_costs(calibration, cores)
            predicted.append(simulate("ring", n, costs, NO_LINK, 30, cores=cores).round_s)
            calibrations.append({**calibration, "per_peer_costs": costs.__dict__, "for_peers": n})
        measured_s = [ring["round_s"] for ring, _ in measured]
        rows.append(
            {
                "peers": n,
                "predicted_round_s": statistics.fmean(predicted),
                "measured_round_s": statistics.fmean(measured_s),
                "relative_error": statistics.fmean(predicted) / statistics.fmean(measured_s) - 1,
                "relative_error_each": [
                    p / m - 1 for p, m in zip(predicted, measured_s, strict=True)
                ],
                "measured_each_s": measured_s,
                "predicted_each_s": predicted,
                # how much the same measurement moved between repeats: the noise floor
                "measured_spread": _spread(measured_s),
                "rounds": measured[0][0]["rounds"],
            }
        )
    return {
        "cores": cores,
        "calibrations": calibrations,
        "validation": rows,
        "max_relative_error": max(abs(r["relative_error"]) for r in rows),
        "max_measured_spread": max(r["measured_spread"] for r in rows),
    }


def _spread(values: list[float]) -> float:
    """(max - min) / mean: 0 for a single value."""
    return (max(values) - min(values)) / statistics.fmean(values)


def plot(rows: list[dict], path: Path) -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2 * len(LINKS), figsize=(16, 4), sharey=True)
    panels = [(link, spec) for link in LINKS for spec in COMPRESSORS]
    for axis, (link, spec) in zip(axes, panels, strict=True):
        for layout in LAYOUTS:
            points = [
                r for r in rows if (r["link"], r["compressor"], r["layout"]) == (link, spec, layout)
            ]
            axis.plot(
                [p["peers"] for p in points],
                [p["efficiency"] for p in points],
                marker="o",
                label=layout,
            )
        axis.set_xscale("log", base=2)
        axis.set_title(f"{spec}, {link}")
        axis.set_xlabel("peers")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (compute / round)")
    axes[0].legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2**k for k in range(3, 11)])
    parser.add_argument("--rounds", type=int, default=100, help="simulated rounds per point")
    parser.add_argument("--steps", type=int, default=200, help="timed local steps")
    parser.add_argument(
        "--validate",
        type=int,
        nargs="*",
        default=[4, 8, 16],
        help="ring sizes to measure with gossipcomp simulate (none: skip)",
    )
    parser.add_argument(
        "--calibrate",
        type=int,
        default=6,
        help="ring size whose measured run calibrates the per-peer cost",
    )
    parser.add_argument(
        "--low-rounds", type=int, default=20, help="rounds left out at the start of a timed run"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured pairs per ring size (averaged)"
    )
    parser.add_argument(
        "--peer-rounds",
        type=int,
        default=2000,
        help="peer-rounds timed in each run (rounds: this over the ring's size)",
    )
    parser.add_argument("--time-ring", type=int, nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if args.time_ring:  # the child of `timed_run`: one timed ring, its figures as JSON
        print(json.dumps(time_ring(*args.time_ring)))
        return 0
    if min(args.low_rounds, args.peer_rounds, args.repeats) < 1 or args.calibrate < 3:
        parser.error("expected --low-rounds, --peer-rounds, --repeats >= 1, --calibrate >= 3")
    sizes = [*args.validate, args.calibrate] if args.validate else []
    if not all(3 <= n <= MAX_WORKERS for n in sizes):
        parser.error(f"--validate, --calibrate: expected ring sizes of 3 to {MAX_WORKERS}")
    if args.rounds < 3 or args.steps < 8 or min(args.peers) < 3:
        parser.error("expected --rounds >= 3, --steps >= 8, --peers >= 3")

    torch.set_num_threads(1)  # the per-peer costs are one peer's, on one core
    console = Console()
    load_before = os.getloadavg()[0]
    measured_costs = {spec: measure_peer_costs(spec, args.steps, args.seed) for spec in COMPRESSORS}
    costs = {spec: value[0] for spec, value in measured_costs.items()}
    rows, slowest = scaling_table(costs, args.peers, args.rounds, args.seed)
    checked = None
    if args.validate:
        checked = validation(
            args.validate, args.low_rounds, args.peer_rounds, args.calibrate, args.repeats
        )

    table = Table(title=f"predicted scaling efficiency (compute / round), {args.rounds} rounds")
    for column in ("link", "compressor", "layout", *map(str, args.peers)):
        table.add_column(column, justify="right")
    for link in LINKS:
        for spec in COMPRESSORS:
            for layout in LAYOUTS:
                cells = [
                    r
                    for r in rows
                    if (r["link"], r["compressor"], r["layout"]) == (link, spec, layout)
                ]
                table.add_row(link, spec, layout, *(f"{r['efficiency']:.3f}" for r in cells))
    console.print(table)
    console.print(f"slowest simulation: {slowest:.3f} s")
    if checked:
        check = Table(
            title=f"simulate vs predicted round time (calibrated on ring{args.calibrate})"
        )
        for column in ("peers", "measured ms", "predicted ms", "error", "spread"):
            check.add_column(column, justify="right")
        for r in checked["validation"]:
            check.add_row(
                str(r["peers"]),
                f"{1e3 * r['measured_round_s']:.1f}",
                f"{1e3 * r['predicted_round_s']:.1f}",
                f"{100 * r['relative_error']:+.1f}%",
                f"{100 * r['measured_spread']:.0f}%",
            )
        console.print(check)
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        report = {
            "command": "python benchmarks/scaling.py " + " ".join(argv or sys.argv[1:]),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "torch_threads": torch.get_num_threads(),
            "peer_costs": {spec: value[1] for spec, value in measured_costs.items()},
            "links": {name: link.__dict__ for name, link in LINKS.items()},
            "rounds": args.rounds,
            "slowest_simulation_s": slowest,
            "scaling": rows,
            "validation": checked["validation"] if checked else [],
            "max_relative_error": checked["max_relative_error"] if checked else None,
            "max_measured_spread": checked["max_measured_spread"] if checked else None,
            "validation_cores": checked["cores"] if checked else None,
            "calibration": checked and {k: checked[k] for k in ("calibrations",)},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
