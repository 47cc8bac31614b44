"""Start-up of the command line: each command as a whole process, this checkout against another
one (an older commit's worktree), in turn A B A B, so a drift of the machine's speed hits both.

Per command: CPU seconds (user + system, the kernel's accounting of the finished child) and
wall seconds, the median of each, and the median of the pairs' ratios A/B. CPU is the figure to
read on a loaded machine: wall time there is mostly waiting for a core.

    git worktree add /tmp/old COMMIT
    python benchmarks/cli_startup.py --against /tmp/old --runs 5 --json cli_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (
    "topology show ring4",
    "peer --help",
    "simulate --help",
    "allreduce --help",
    "coordinator --help",
)


def run_once(tree: Path, arguments: list[str]) -> tuple[float, float]:
    """CPU and wall seconds of `python -m gossipcomp ARGUMENTS` importing from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "gossipcomp", *arguments],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu, wall


def compare(command: str, against: Path, runs: int) -> dict[str, float]:
    """One warm-up each, then `runs` pairs: this checkout (A), then `against` (B)."""
    arguments = shlex.split(command)
    run_once(ROOT, arguments)
    run_once(against, arguments)
    pairs = [(run_once(ROOT, arguments), run_once(against, arguments)) for _ in range(runs)]
    return {
        "cpu_s": statistics.median(a[0] for a, _ in pairs),
        "wall_s": statistics.median(a[1] for a, _ in pairs),
        "against_cpu_s": statistics.median(b[0] for _, b in pairs),
        "against_wall_s": statistics.median(b[1] for _, b in pairs),
        "cpu_ratio": statistics.median(a[0] / b[0] for a, b in pairs),
        "wall_ratio": statistics.median(a[1] / b[1] for a, b in pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="the other checkout (B)")
    parser.add_argument("--runs", type=int, default=5, help="pairs counted per command")
    parser.add_argument("--command", action="append", help="one command line (repeatable)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if not (args.against / "gossipcomp" / "__init__.py").is_file():
        parser.error(f"--against {args.against}: expected a checkout holding gossipcomp/")
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: expected at least 1")
    results = {}
    print(
        f"{'command':24} {'cpu A':>7} {'cpu B':>7} {'A/B':>6} {'wall A':>7} {'wall B':>7} {'A/B':>6}"
    )
    for command in args.command or COMMANDS:
        r = results[command] = compare(command, args.against.resolve(), args.runs)
        print(
            f"{command:24} {r['cpu_s']:7.2f} {r['against_cpu_s']:7.2f} {r['cpu_ratio']:6.2f} "
            f"{r['wall_s']:7.2f} {r['against_wall_s']:7.2f} {r['wall_ratio']:6.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "commands": results}, indent=2))


if __name__ == "__main__":
    main()
