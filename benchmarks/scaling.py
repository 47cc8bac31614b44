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

Validation (measured and predicted in the same run, so a faster `simulate` is measured as it
is): `gossipcomp simulate` runs every peer in one process, threads taking turns under one
interpreter lock on a shared CPU. A round's time is measured as the difference of the wall
times of two runs with different round counts (start-up cancels), divided by the difference in
rounds. Each measured ring (`--validate`, default 4, 8, 16 peers) is paired with a calibration
ring of another size (`--calibrate`, default 6) run alongside it (short runs, then long runs in
the opposite order), so that other work on this shared machine weighs on both alike; the
pairs are repeated `--repeats` times (sizes interleaved) and averaged. The mean
calibration's wall time per round over its peers is the per-peer cost, split by the report's
compute share into the local step and two per-neighbour decodes; the simulator runs the ring
with cores=1 (the peers' CPU tasks served one at a time) and no link time (loopback transfers
are CPU work, already in the cost), and its round time is compared with the measured one. Not
modelled: the interpreter lock's hand-over overhead, which grows with the number of threads
(the measured cost per peer-round rises by about a fifth from 4 to 16 peers); calibrating at 6
peers splits that error between the sizes. CPU seconds over wall seconds of each measured ring
are reported beside, and the spread of the repeated measurements of a ring ((max - min) /
mean): the noise floor of a measurement on this shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.compress import CompressionContext, parse_spec
from gossipcomp.data import load_digits_split
from gossipcomp.models import build_mlp
from gossipcomp.schedule import LAYOUTS, LinkCost, PeerCosts, simulate
from gossipcomp.training import make_optimizer

LINKS = {
    "10GbE": LinkCost(0.91e-3, 7.4e-10),  # MG-WFBP's fit for 16 workers on 10GbE
    "1GbE": LinkCost(0.91e-3, 8e-9),
}
COMPRESSORS = ("identity", "sign")
SHIPPED_RINGS = (4, 8, 16)


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


def run_simulate(topology: str, rounds: int, folder: Path) -> tuple[dict, float]:
    """One `gossipcomp simulate` run: its report and the child CPU seconds it used."""
    report = folder / f"{Path(topology).stem}_{rounds}.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, "-m", "gossipcomp", "simulate", "--topology", topology]
    command += ["--rounds", str(rounds), "--eval-every", "0", "--quiet", "--report", str(report)]
    subprocess.run(command, check=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(report.read_text()), cpu


def ring_topology(peers: int, folder: Path) -> str:
    """A shipped ring's name (ring4, ring8, ring16), or a ring YAML written into `folder`."""
    if peers in SHIPPED_RINGS:
        return f"ring{peers}"
    path = folder / f"ring{peers}.yaml"
    path.write_text(f"name: ring{peers}\nkind: ring\nn: {peers}\nweights: metropolis\n")
    return str(path)


def _round_figures(peers: int, rounds: tuple[int, int], runs: list[tuple[dict, float]]) -> dict:
    """Seconds per round from a short and a long run (start-up cancels in the difference)."""
    (short, cpu_short), (long, cpu_long) = runs
    wall = long["wall_seconds"] - short["wall_seconds"]
    if wall <= 0:
        raise RuntimeError(
            f"ring of {peers}: the run of {rounds[1]} rounds took {long['wall_seconds']:.2f} s, "
            f"no longer than the run of {rounds[0]} ({short['wall_seconds']:.2f} s): start-up "
            "noise hides the rounds; expected a larger --peer-rounds"
        )
    compute = sum(p["compute_seconds"] for p in long["per_peer"])
    comm = sum(p["comm_seconds"] for p in long["per_peer"])
    return {
        "peers": peers,
        "rounds": list(rounds),
        "round_s": wall / (rounds[1] - rounds[0]),
        "cpu_per_wall": (cpu_long - cpu_short) / max(wall, 1e-9),
        "compute_share": compute / (compute + comm) if compute + comm > 0 else 0.5,
    }


def measured_pair(
    peers: int, calibrate: int, low: int, peer_rounds: int, folder: Path
) -> tuple[dict, dict]:
    """Round figures of a ring of `peers` and of the calibration ring, measured alongside: the
    short runs, then the long ones in the opposite order (calibration, ring, ring, calibration),
    so that a drift in other work on the machine weighs on both alike. A long run has
    max(2, peer_rounds // size) rounds more than the short one. A ring as large as the
    calibration ring is its own calibration (in-sample)."""
    if peers == calibrate:  # the ring calibrates itself (in-sample: a quick check only)
        topology = ring_topology(peers, folder)
        rounds = (low, low + max(2, peer_rounds // peers))
        own = _round_figures(peers, rounds, [run_simulate(topology, r, folder) for r in rounds])
        return own, own
    sizes = {"ring": peers, "calibration": calibrate}
    topology = {key: ring_topology(n, folder) for key, n in sizes.items()}
    rounds = {key: (low, low + max(2, peer_rounds // n)) for key, n in sizes.items()}
    runs: dict[str, list[tuple[dict, float]]] = {"ring": [], "calibration": []}
    for key, which in (("calibration", 0), ("ring", 0), ("ring", 1), ("calibration", 1)):
        runs[key].append(run_simulate(topology[key], rounds[key][which], folder))
    ring, calibration = (_round_figures(sizes[k], rounds[k], runs[k]) for k in sizes)
    return ring, calibration


def shared_cpu_costs(calibration: dict) -> PeerCosts:
    """Per-peer costs of a ring peer under `simulate` from a calibration measurement: its wall
    time per round over its peers, split by the report's compute share into the local step
    and two per-neighbour decodes."""
    per_peer = calibration["round_s"] / calibration["peers"]
    share = calibration["compute_share"]
    return PeerCosts(
        compute_s=share * per_peer, message_bytes=0, decompress_s=(1 - share) * per_peer / 2
    )


def validation(peers: list[int], low: int, peer_rounds: int, calibrate: int, repeats: int) -> dict:
    """For each ring of `peers`, `repeats` times (sizes interleaved): measure it alongside the
    calibration ring. Per size, the mean calibration gives the per-peer costs, whose prediction
    is compared with the mean measured round time."""
    pairs: dict[int, list[tuple[dict, dict]]] = {n: [] for n in peers}
    with tempfile.TemporaryDirectory(prefix="scaling-") as name:
        for _ in range(repeats):
            for n in peers:
                pairs[n].append(measured_pair(n, calibrate, low, peer_rounds, Path(name)))
    rows, calibrations = [], []
    for n, measured in pairs.items():
        ring_s = statistics.fmean(ring["round_s"] for ring, _ in measured)
        calibration = {
            "peers": calibrate,
            "round_s": statistics.fmean(cal["round_s"] for _, cal in measured),
            "compute_share": statistics.fmean(cal["compute_share"] for _, cal in measured),
        }
        costs = shared_cpu_costs(calibration)
        predicted = simulate("ring", n, costs, LinkCost(0.0, 0.0), rounds=30, cores=1)
        calibrations.append({**calibration, "shared_cpu_costs": costs.__dict__, "for_peers": n})
        rows.append(
            {
                "peers": n,
                "predicted_round_s": predicted.round_s,
                "measured_round_s": ring_s,
                "relative_error": predicted.round_s / ring_s - 1,
                "measured_each_s": [ring["round_s"] for ring, _ in measured],
                "calibration_each_s": [cal["round_s"] for _, cal in measured],
                # how much the same measurement moved between repeats: the noise floor
                "measured_spread": _spread([ring["round_s"] for ring, _ in measured]),
                "rounds": measured[0][0]["rounds"],
                "cpu_per_wall": statistics.fmean(ring["cpu_per_wall"] for ring, _ in measured),
            }
        )
    return {
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
    parser.add_argument("--low-rounds", type=int, default=20, help="rounds of the short run")
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured pairs per ring size (averaged)"
    )
    parser.add_argument(
        "--peer-rounds",
        type=int,
        default=2000,
        help="the long run has this many peer-rounds more than the short one",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if min(args.low_rounds, args.peer_rounds, args.repeats) < 1 or args.calibrate < 3:
        parser.error("expected --low-rounds, --peer-rounds, --repeats >= 1, --calibrate >= 3")
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
        for column in ("peers", "measured ms", "predicted ms", "error", "spread", "cpu/wall"):
            check.add_column(column, justify="right")
        for r in checked["validation"]:
            check.add_row(
                str(r["peers"]),
                f"{1e3 * r['measured_round_s']:.1f}",
                f"{1e3 * r['predicted_round_s']:.1f}",
                f"{100 * r['relative_error']:+.1f}%",
                f"{100 * r['measured_spread']:.0f}%",
                f"{r['cpu_per_wall']:.2f}",
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
            "calibration": checked and {k: checked[k] for k in ("calibrations",)},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
