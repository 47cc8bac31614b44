"""Faults with real processes: a 4-peer ring where peer 2 is killed (SIGKILL) mid-run, and
optionally restarted from its checkpoint (the newest one damaged first, to show the fallback).

Run: python benchmarks/faults.py --rounds 1500 --json docs/faults.json
Prints, per scenario, what each peer reported (rounds, accuracy, failed exchanges, wall time),
how long the survivors took against a fault-free run of the same network in the same
invocation (the ratio is what to read; machines here are noisy), and what peer 2 said.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

# --scenarios name -> (scenario, peer 2 killed, peer 2 restarted from a damaged checkpoint)
SCENARIOS = {
    "none": ("no fault", False, False),
    "killed": ("peer 2 killed", True, False),
    "restarted": ("peer 2 killed and restarted", True, True),
}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def ring_file(directory: Path, n: int) -> Path:
    peers = "\n".join(f"  {r}: 127.0.0.1:{port}" for r, port in enumerate(free_ports(n)))
    path = directory / "ring.yaml"
    path.write_text(f"name: ring{n}\nkind: ring\nn: {n}\npeers:\n{peers}\n")
    return path


def start(
    directory: Path, topology: Path, rank: int, rounds: int, checkpoint_every: int
) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "gossipcomp", "peer", "--topology", str(topology),
        "--rank", str(rank), "--rounds", str(rounds), "--round-timeout", "5",
        "--eval-every", "0", "--quiet", "--report", str(directory / f"peer{rank}.json"),
        "--checkpoint-dir", str(directory / "checkpoints"),
        "--checkpoint-every", str(checkpoint_every),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "500"}
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


STARTUP_SECONDS = 600.0  # four processes importing torch on two busy cores took over 120 s


def wait_for_checkpoint(
    directory: Path, rank: int, at_least: int, process: subprocess.Popen
) -> None:
    """Wait until peer `rank` has written a checkpoint of round >= `at_least` (raise if it
    exits first, or after STARTUP_SECONDS: the wait ends as soon as the file is there)."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        found = [int(p.stem.split("round")[1]) for p in directory.glob(f"rank{rank}-*.ckpt")]
        if found and max(found) >= at_least:
            return
        time.sleep(0.05)
    raise RuntimeError(
        f"peer {rank} wrote no checkpoint of round >= {at_least} "
        + (f"within {STARTUP_SECONDS:g} s" if process.poll() is None else "before it exited")
    )


def scenario(
    name: str, rounds: int, checkpoint_every: int, kill_after: int | None, restart: bool
) -> dict:
    """Run four peers; with `kill_after`, kill peer 2 once that checkpoint is written (and with
    `restart`, damage its newest checkpoint and start it again). Peers still running when
    something fails are killed."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        topology = ring_file(directory, 4)
        began = time.perf_counter()
        peers = {r: start(directory, topology, r, rounds, checkpoint_every) for r in range(4)}
        try:
            if kill_after is not None:
                wait_for_checkpoint(directory / "checkpoints", 2, kill_after, peers[2])
                peers[2].send_signal(signal.SIGKILL)
                peers[2].wait()
                if restart:
                    files = sorted((directory / "checkpoints").glob("rank2-*.ckpt"), reverse=True)
                    damaged = bytearray(files[0].read_bytes())
                    damaged[len(damaged) // 2] ^= 0xFF
                    files[0].write_bytes(bytes(damaged))
                    peers[2] = start(directory, topology, 2, rounds, checkpoint_every)
            said = {}
            for rank, process in peers.items():
                if process.returncode is not None and process.returncode < 0:
                    said[rank] = "killed"
                    continue
                _, stderr = process.communicate(timeout=600)
                if process.returncode != 0:
                    raise RuntimeError(f"peer {rank} failed: {stderr}")
                said[rank] = " ".join(stderr.split())
        finally:
            for process in peers.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
        wall = time.perf_counter() - began
        reports = {}
        for rank in range(4):
            path = directory / f"peer{rank}.json"
            if path.exists():
                report = json.loads(path.read_text())
                row = report["per_peer"][0]
                reports[rank] = {
                    "rounds": report["rounds"],
                    "test_accuracy": row["test_accuracy"],
                    "failed_exchanges": row["failed_exchanges"],
                    "wall_seconds": report["wall_seconds"],
                    "average_model_norm": report["average_model_norm"],
                    "consensus_distance": report["consensus_distance"],
                }
        return {"scenario": name, "wall_seconds": wall, "peers": reports, "peer2_said": said[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--kill-after", type=int, default=100, help="checkpoint round to wait for")
    parser.add_argument(
        "--checkpoint-every", type=int, default=25, help="rounds between checkpoints"
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=list(SCENARIOS),
        default=list(SCENARIOS),
        help="which to run (wall ratios need 'none', the fault-free run)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for key in args.scenarios:
        name, killed, restart = SCENARIOS[key]
        kill_after = args.kill_after if killed else None
        results.append(scenario(name, args.rounds, args.checkpoint_every, kill_after, restart))
    baseline = next((r["wall_seconds"] for r in results if r["scenario"] == "no fault"), None)
    console = Console()
    table = Table(title=f"4-peer ring, {args.rounds} rounds, PowerGossip, processes")
    for column in (
        "scenario",
        "wall / no fault",
        "peer",
        "rounds",
        "accuracy",
        "failed",
        "avg norm",
    ):
        table.add_column(column)
    for result in results:
        result["wall_ratio"] = result["wall_seconds"] / baseline if baseline else None
        ratio = "-" if result["wall_ratio"] is None else f"{result['wall_ratio']:.2f}"
        for rank, row in sorted(result["peers"].items()):
            table.add_row(
                result["scenario"], ratio, str(rank), str(row["rounds"]),
                f"{row['test_accuracy']:.3f}", str(row["failed_exchanges"]),
                f"{row['average_model_norm']:.4f}",
            )  # fmt: skip
    console.print(table)
    for result in results:
        if result["scenario"] == SCENARIOS["restarted"][0]:
            console.print(f"peer 2 after its restart said: {result['peer2_said']}")
    if args.json:
        args.json.write_text(
            json.dumps({"rounds": args.rounds, "results": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
