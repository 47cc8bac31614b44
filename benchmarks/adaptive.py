"""Bandwidth-adaptive compression against fixed compression, on links whose bandwidth changes.

Run: python benchmarks/adaptive.py --json docs/adaptive.json --plot docs/adaptive.png

A ring of peers (8 by default) trains `--model` (wide-mlp: 1.1M parameters) on digits, every
link at `--mbit` (100 Mbit/s) until one link (`--slow-link`, 0-1) drops to `--slow-mbit`
(10 Mbit/s) a third of the way in. Side by side in one invocation, the same run with:

- D-PSGD (exact gossip: the whole model over every link every round);
- PowerGossip at each fixed rank of `--ranks` (1 2 4 8 16 32 64);
- adaptive: PowerGossip whose rank per link the coordinator sets from what each link carried
  in the last rounds (`gossipcomp coordinator --adaptive`), within the round budget.

Links (`--links`):
- `shaped` (default; root on Linux): every peer is a real `gossipcomp peer` process in its own
  network namespace, the links veth pairs limited by tc tbf (benchmarks/shaped_links.py), the
  coordinator in a control namespace with unshaped links. The drop is by round: when either end
  of the slow link has finished round rounds/3 (seen from the checkpoint it writes at that round;
  every peer checkpoints at the same rounds in every configuration, nothing else), the link's
  tc qdisc is changed at both ends. After the last round the link is set back to `--mbit` so
  that the reports' closing measurement (tens of rounds of exact averaging to estimate the
  network average) does not take minutes; no figure below includes it.
- `throttled`: the same comparison in one `gossipcomp simulate` process, its links throttled in
  process (`--link-rate`, `--link-change I-J:MBIT@ROUND`); no namespaces needed (tests).

Figures per configuration: time to 0.90 accuracy (`time_to_090`): the wall time at the first
evaluation (every `--eval-every` rounds) at which the mean over peers of their test accuracy
reaches it. On shaped links the wall time of a round is the smallest of the peers' clocks at it:
each peer's clock starts when it has connected to its neighbours, and no peer passes a round
before the last one to start has begun, so the smallest clock is the time since the whole
network was up (start-up, torch imports included, is not counted). Also: final accuracy, round
time (before the drop, and after it from `--settle-rounds` rounds on), bytes, and for adaptive
the level per link over time. Ratios: `adaptive_vs_best_fixed` (adaptive's time over the
fastest fixed rank's), `adaptive_vs_dpsgd`, and `round_time_vs_budget`: after adapting, the
communication part of a round (wall time per round minus the peers' mean compute time per
round) over the round budget (`--round-budget`, or else what the coordinator used: the slowest
peer's compute time per round).

All peers share this machine's cores: on a 2-core machine 8 peer processes each get a quarter
of a core, so compute per round, and with it the default budget, is that of a loaded machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shaped_links  # noqa: E402  (the sibling module: benchmarks/ is no package)

PEER_PORT = 50100
COORDINATOR_PORT = 50099
POLL_SECONDS = 0.05
TARGET = 0.90


@dataclass(frozen=True)
class Workload:
    """What every configuration trains, and how its links behave."""

    peers: int = 8
    rounds: int = 90
    change_fraction: float = 1 / 3
    slow_link: tuple[int, int] = (0, 1)
    mbit: float = 100.0
    slow_mbit: float = 10.0
    model: str = "wide-mlp"
    dataset: str = "digits"
    partition: str = "dirichlet:0.5"
    lr: float = 0.1
    batch_size: int = 32
    seed: int = 0
    eval_every: int = 2
    settle_rounds: int = 10
    round_budget: float | None = None
    round_timeout: float = 60.0
    target: float = TARGET

    @property
    def change_round(self) -> int:
        """The round after which the slow link drops."""
        return max(1, round(self.rounds * self.change_fraction))

    def training_flags(self) -> list[str]:
        return [
            "--model", self.model, "--dataset", self.dataset, "--partition", self.partition,
            "--lr", f"{self.lr:g}", "--batch-size", str(self.batch_size), "--seed",
            str(self.seed), "--rounds", str(self.rounds), "--eval-every", str(self.eval_every),
            "--round-timeout", f"{self.round_timeout:g}", "--quiet",
        ]  # fmt: skip


@dataclass(frozen=True)
class Configuration:
    """One column of the comparison: a name and the algorithm flags of its peers."""

    name: str
    algorithm_flags: tuple[str, ...]
    adaptive: bool = False
    rank: int | None = None


def configurations(families: Sequence[str], ranks: Sequence[int]) -> list[Configuration]:
    chosen = []
    if "dpsgd" in families:
        chosen.append(Configuration("dpsgd", ("--algorithm", "dpsgd")))
    if "fixed" in families:
        for r in ranks:
            flags = ("--algorithm", "powergossip", "--low-rank", str(r))
            chosen.append(Configuration(f"rank={r}", flags, rank=r))
    if "adaptive" in families:
        chosen.append(Configuration("adaptive", ("--algorithm", "powergossip"), adaptive=True))
    return chosen


class Unsupported(RuntimeError):
    """This gossipcomp lacks a flag the configuration needs (the adaptive mode not landed)."""


def gossipcomp(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "gossipcomp", *arguments]


@functools.cache
def _help(command: str) -> str:
    shown = subprocess.run(
        gossipcomp(command, "--help"), capture_output=True, text=True, timeout=300, check=False
    )
    return shown.stdout


def require_flags(command: str, flags: Sequence[str]) -> None:
    """Raise Unsupported naming the first of `flags` that `gossipcomp COMMAND --help` lacks."""
    for flag in flags:
        if flag not in _help(command):
            raise Unsupported(f"`gossipcomp {command}` has no {flag} yet")


def ring_edges(n: int) -> list[tuple[int, int]]:
    return [shaped_links.edge(i, (i + 1) % n) for i in range(n)]


def write_topology(path: Path, n: int, peers: dict[int, dict[str, str]] | None) -> Path:
    spec: dict[str, Any] = {"name": f"ring{n}", "kind": "ring", "n": n, "weights": "metropolis"}
    if peers is not None:
        spec["peers"] = peers
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@dataclass
class Run:
    """What one configuration measured, in the form every analysis below reads."""

    points: list[tuple[int, float, float]]  # (round, mean test accuracy over peers, seconds)
    final_accuracy: float
    min_final_accuracy: float
    bytes_sent_total: int
    compute_seconds_per_round: list[float]  # per peer
    failed_exchanges: int  # over all peers: exchanges given up (deadline, neighbour down)
    link_levels: list[dict[str, Any]]  # every end's {reporter, round, link, level}
    # (effective round, budget_s) of the schedules in force, as the first peer saw them
    budgets: list[tuple[int, float]] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)  # link events, seconds after start
    qdisc: list[str] = field(default_factory=list)


def _compute_per_round(rows: Sequence[dict[str, Any]]) -> list[float]:
    return [row["compute_seconds"] / max(1, row.get("gossip_rounds") or 1) for row in rows]


def _budgets(report: dict[str, Any]) -> list[tuple[int, float]]:
    """(effective round, round budget) of every schedule the report's first peer had in
    force (every peer has the same ones); schedules without a budget are left out."""
    rows = report.get("per_peer", [])
    epochs = rows[0].get("schedule_epochs", []) if rows else report.get("schedule_epochs", [])
    return [
        (int(s["effective_round"]), float(s["budget_s"]))
        for s in epochs
        if isinstance(s, dict) and s.get("budget_s")
    ]


def budget_in_force(budgets: Sequence[tuple[int, float]], start: int, end: int) -> float | None:
    """The mean over rounds start+1..end of the budget in force at each (None when no
    schedule with a budget was in force by then)."""
    in_force = []
    for r in range(start + 1, end + 1):
        current = [b for effective, b in budgets if effective <= r]
        if current:
            in_force.append(current[-1])
    return sum(in_force) / len(in_force) if in_force else None


def _levels(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every level change the report's peers saw, each as {reporter, round, link, level}."""
    return [
        {**entry, "reporter": row["rank"]}
        for row in report.get("per_peer", [])
        for entry in row.get("link_levels", [])
    ]


def from_peer_reports(reports: Sequence[dict[str, Any]]) -> Run:
    """Join per-peer reports: per evaluated round, the mean accuracy over peers and the
    smallest of their clocks (module docstring)."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for report in reports:
        for point in report["history"]:
            by_round.setdefault(point["round"], []).append(
                (point["mean_test_accuracy"], point["wall_seconds"])
            )
    points = [
        (r, sum(a for a, _ in rows) / len(rows), min(s for _, s in rows))
        for r, rows in sorted(by_round.items())
        if len(rows) == len(reports)
    ]
    rows = [row for report in reports for row in report["per_peer"]]
    accuracies = [row["test_accuracy"] for row in rows]
    levels = [entry for report in reports for entry in _levels(report)]
    return Run(
        points=points,
        final_accuracy=sum(accuracies) / len(accuracies),
        min_final_accuracy=min(accuracies),
        bytes_sent_total=sum(int(r["bytes_sent_total"]) for r in reports),
        compute_seconds_per_round=_compute_per_round(rows),
        failed_exchanges=sum(int(row["failed_exchanges"]) for row in rows),
        link_levels=levels,
        budgets=_budgets(reports[0]),
    )


def from_simulate_report(report: dict[str, Any]) -> Run:
    points = [(p["round"], p["mean_test_accuracy"], p["wall_seconds"]) for p in report["history"]]
    return Run(
        points=points,
        final_accuracy=report["final_test_accuracy"],
        min_final_accuracy=report["min_test_accuracy"],
        bytes_sent_total=int(report["bytes_sent_total"]),
        compute_seconds_per_round=_compute_per_round(report["per_peer"]),
        failed_exchanges=sum(int(row["failed_exchanges"]) for row in report["per_peer"]),
        link_levels=_levels(report),
        budgets=_budgets(report),
    )


class ShapedRunner:
    """Each configuration as real peer processes in the namespaces of `network`."""

    links = "shaped"

    def __init__(self, network: shaped_links.ShapedNetwork, workload: Workload, timeout: float):
        self.network, self.workload, self.timeout = network, workload, timeout

    def check(self, configuration: Configuration) -> None:
        if configuration.adaptive:
            require_flags("coordinator", ["--adaptive"])

    def run(self, configuration: Configuration, directory: Path) -> Run:
        w, network = self.workload, self.network
        topology = write_topology(
            directory / "ring.yaml", w.peers, network.topology_peers(PEER_PORT)
        )
        for link in network.edges:
            if network.rates[link] != w.mbit:
                network.set_rate(link, w.mbit)
        every = math.gcd(w.change_round, w.rounds)  # checkpoints at the change and at the end
        checkpoints = directory / "checkpoints"
        processes: list[tuple[str, subprocess.Popen]] = []
        try:
            flags = list(configuration.algorithm_flags)
            if configuration.adaptive:
                address = f"{shaped_links.CONTROL_ADDRESS}:{COORDINATOR_PORT}"
                budget = [] if w.round_budget is None else ["--round-budget", f"{w.round_budget:g}"]
                processes.append(("coordinator", self._start(
                    "control", directory / "coordinator.log",
                    gossipcomp("coordinator", "--topology", str(topology), "--address", address,
                               "--insecure", "--adaptive", "--report-every", "1", *budget),
                )))  # fmt: skip
                flags += ["--coordinator", address, "--report-every", "1"]
            for rank in range(w.peers):
                argv = gossipcomp(
                    "peer", "--topology", str(topology), "--rank", str(rank), "--insecure",
                    "--startup-timeout", "600", *flags, *w.training_flags(),
                    "--report", str(directory / "peer{rank}.json"),
                    "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(every),
                    "--checkpoint-keep", "1",
                )  # fmt: skip
                processes.append(
                    (f"peer {rank}", self._start(rank, directory / f"peer{rank}.log", argv))
                )
            events, qdisc = self._drive(processes[-w.peers :], checkpoints, directory)
        finally:
            for _, process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        reports = [json.loads((directory / f"peer{r}.json").read_text()) for r in range(w.peers)]
        run = from_peer_reports(reports)
        run.events, run.qdisc = events, qdisc
        return run

    def _start(self, where: int | str, log: Path, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
        with log.open("w") as out:
            return self.network.popen(where, argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def _drive(
        self, peers: list[tuple[str, subprocess.Popen]], checkpoints: Path, directory: Path
    ) -> tuple[dict[str, float], list[str]]:
        """Drop the slow link when either of its ends has checkpointed round change_round,
        put it back when every peer has checkpointed the last round; wait for the peers."""
        w, network = self.workload, self.network
        began, deadline = time.monotonic(), time.monotonic() + self.timeout
        events: dict[str, float] = {}
        qdisc: list[str] = []
        while True:
            failed = [(n, p) for n, p in peers if p.poll() not in (None, 0)]
            if failed:
                name, process = failed[0]
                log = directory / f"peer{name.split()[-1]}.log"
                raise RuntimeError(f"{name} exited with status {process.returncode}: {_tail(log)}")
            if all(p.poll() == 0 for _, p in peers):
                return events, qdisc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the peers did not finish within {self.timeout:g} s")
            rounds = [_checkpointed(checkpoints, r) for r in range(w.peers)]
            if "drop" not in events and max(rounds[r] for r in w.slow_link) >= w.change_round:
                network.set_rate(w.slow_link, w.slow_mbit)
                events["drop"] = time.monotonic() - began
                qdisc.append(network.qdisc(w.slow_link))
            if "drop" in events and "restore" not in events and min(rounds) >= w.rounds:
                network.set_rate(w.slow_link, w.mbit)
                events["restore"] = time.monotonic() - began
            time.sleep(POLL_SECONDS)


def _checkpointed(directory: Path, rank: int) -> int:
    """The newest round peer `rank` has a checkpoint of (0 when none)."""
    found = [0]
    for path in directory.glob(f"rank{rank}-round*.ckpt"):
        try:
            found.append(int(path.stem.split("round")[1]))
        except ValueError:
            continue
    return max(found)


def _tail(path: Path, characters: int = 1500) -> str:
    try:
        return " ".join(path.read_text(errors="replace")[-characters:].split())
    except OSError:
        return "(no log)"


class ThrottledRunner:
    """Each configuration as one `gossipcomp simulate`, its links throttled in process."""

    links = "throttled"

    def __init__(self, workload: Workload, timeout: float):
        self.workload, self.timeout = workload, timeout

    def check(self, configuration: Configuration) -> None:
        require_flags("simulate", ["--link-rate", "--link-change"])
        if configuration.adaptive:
            require_flags("simulate", ["--adaptive"])

    def run(self, configuration: Configuration, directory: Path) -> Run:
        w = self.workload
        topology = write_topology(directory / "ring.yaml", w.peers, None)
        a, b = w.slow_link
        argv = gossipcomp(
            "simulate", "--topology", str(topology), *configuration.algorithm_flags,
            *w.training_flags(), "--link-rate", f"{w.mbit:g}",
            "--link-change", f"{a}-{b}:{w.slow_mbit:g}@{w.change_round}",
            "--link-change", f"{a}-{b}:{w.mbit:g}@{w.rounds}",  # the closing measurement
            "--report", str(directory / "report.json"),
        )  # fmt: skip
        if configuration.adaptive:
            argv += ["--adaptive", "--report-every", "1"]
            if w.round_budget is not None:
                argv += ["--round-budget", f"{w.round_budget:g}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=self.timeout, check=False
        )
        if done.returncode != 0:
            said = " ".join((done.stderr or done.stdout)[-1500:].split())
            raise RuntimeError(f"gossipcomp simulate exited with status {done.returncode}: {said}")
        return from_simulate_report(json.loads((directory / "report.json").read_text()))


# analysis ---------------------------------------------------------------------------------------
def seconds_at(points: Sequence[tuple[int, float, float]], round: int) -> float | None:
    """Seconds at the first evaluation at or after `round`."""
    return next((s for r, _, s in points if r >= round), None)


def round_seconds(points: Sequence[tuple[int, float, float]], start: int, end: int) -> float | None:
    """Wall seconds per round between the evaluations at or after `start` and `end`."""
    first = next(((r, s) for r, _, s in points if r >= start), None)
    last = next(((r, s) for r, _, s in points if r >= end), None)
    if first is None or last is None or last[0] <= first[0]:
        return None
    return (last[1] - first[1]) / (last[0] - first[0])


def level_timeline(run: Run) -> dict[str, list[tuple[int, str]]]:
    """Per link ("i-j"), the (round, level) changes, each change once (the ends agree)."""
    changes: dict[str, set[tuple[int, str]]] = {}
    for entry in run.link_levels:
        i, j = entry["link"]
        changes.setdefault(f"{i}-{j}", set()).add((int(entry["round"]), str(entry["level"])))
    return {key: sorted(found) for key, found in sorted(changes.items())}


def ends_disagree(run: Run) -> int:
    """Level changes that not both ends of their link reported at the same round (0 when the
    two ends of every edge always switched together)."""
    reporters: dict[tuple[int, int, int, str], set[int]] = {}
    for entry in run.link_levels:
        i, j = entry["link"]
        key = (i, j, int(entry["round"]), str(entry["level"]))
        reporters.setdefault(key, set()).add(int(entry["reporter"]))
    return sum(1 for (i, j, _, _), ends in reporters.items() if ends != {i, j})


def summarise(configuration: Configuration, run: Run, w: Workload) -> dict[str, Any]:
    reached = next(((r, s) for r, a, s in run.points if a >= w.target), None)
    rounds_done = run.points[-1][0] if run.points else 0
    training = run.points[-1][2] if run.points else None
    compute = sum(run.compute_seconds_per_round) / len(run.compute_seconds_per_round)
    after = round_seconds(run.points, w.change_round + w.settle_rounds, rounds_done)
    summary: dict[str, Any] = {
        "name": configuration.name,
        "rank": configuration.rank,
        "adaptive": configuration.adaptive,
        "time_to_090": reached[1] if reached else None,
        "round_reached_090": reached[0] if reached else None,
        "final_accuracy": run.final_accuracy,
        "min_final_accuracy": run.min_final_accuracy,
        "training_seconds": training,
        "round_seconds": training / rounds_done if training and rounds_done else None,
        "round_seconds_before_change": round_seconds(run.points, 0, w.change_round),
        "round_seconds_after_change": after,
        "compute_seconds_per_round": compute,
        "change_seconds": seconds_at(run.points, w.change_round),
        "bytes_sent_total": run.bytes_sent_total,
        "bytes_per_round": run.bytes_sent_total / rounds_done if rounds_done else None,
        "failed_exchanges": run.failed_exchanges,
        "history": [list(point) for point in run.points],
        "link_events_seconds": run.events,
        "qdisc_after_change": run.qdisc,
    }
    if configuration.adaptive:
        timeline = level_timeline(run)
        settled = w.change_round + w.settle_rounds
        budget = w.round_budget or budget_in_force(run.budgets, settled, rounds_done)
        source = "--round-budget" if w.round_budget else "published schedules (mean after settling)"
        if budget is None:  # the coordinator's default: the slowest peer's compute per round
            budget, source = max(run.compute_seconds_per_round), "slowest peer's compute/round"
        comm = None if after is None else after - compute
        summary.update(
            {
                "link_levels": timeline,
                "final_levels": {k: changes[-1][1] for k, changes in timeline.items()},
                "level_changes_one_end_only": ends_disagree(run),
                "budget_seconds": budget,
                "budget_source": source,
                "communication_seconds_per_round_after_change": comm,
                "round_time_vs_budget": None if comm is None else comm / budget,
            }
        )
    return summary


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    by_name = {r["name"]: r for r in results}
    fixed = [r for r in results if r["rank"] is not None and r["time_to_090"] is not None]
    best = min(fixed, key=lambda r: r["time_to_090"]) if fixed else None
    adaptive, dpsgd = by_name.get("adaptive"), by_name.get("dpsgd")
    time_of = lambda r: r["time_to_090"] if r else None  # noqa: E731
    ratios = {
        "best_fixed": best["name"] if best else None,
        "adaptive_vs_best_fixed": _ratio(time_of(adaptive), time_of(best)),
        "adaptive_vs_dpsgd": _ratio(time_of(adaptive), time_of(dpsgd)),
        "round_time_vs_budget": adaptive.get("round_time_vs_budget") if adaptive else None,
    }
    goals = {"adaptive_vs_best_fixed": 0.8, "adaptive_vs_dpsgd": 0.2, "round_time_vs_budget": 1.25}
    ratios["goals"] = {
        key: {"goal": f"<= {goal}", "met": None if ratios[key] is None else ratios[key] <= goal}
        for key, goal in goals.items()
    }
    return ratios


# plot -------------------------------------------------------------------------------------------
def plot(results: list[dict[str, Any]], w: Workload, path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, (accuracy, levels) = plt.subplots(2, 1, figsize=(10, 9))
    for result in results:
        history = np.array(result["history"], dtype=float).reshape(-1, 3)
        style = {"linewidth": 2.5, "color": "black"} if result["adaptive"] else {"linewidth": 1}
        (line,) = accuracy.plot(history[:, 2], history[:, 1], label=result["name"], **style)
        if result["change_seconds"] is not None:
            accuracy.axvline(result["change_seconds"], color=line.get_color(), linestyle=":",
                             linewidth=0.8)  # fmt: skip
    accuracy.axhline(w.target, color="grey", linestyle="--", linewidth=0.8)
    accuracy.set(xlabel="wall seconds", ylabel="mean test accuracy over peers", ylim=(0, 1))
    accuracy.set_xscale("log")
    accuracy.set_title(
        f"ring of {w.peers}, {w.model} on {w.dataset}: links {w.mbit:g} Mbit/s, link "
        f"{w.slow_link[0]}-{w.slow_link[1]} at {w.slow_mbit:g} from round {w.change_round} "
        "(dotted)"
    )
    accuracy.legend(fontsize=8, ncol=2)
    adaptive = next((r for r in results if r["adaptive"]), None)
    if adaptive is None or not adaptive.get("link_levels"):
        levels.text(0.5, 0.5, note or "no adaptive run", ha="center", va="center", wrap=True)
        levels.set_axis_off()
    else:
        history = np.array(adaptive["history"], dtype=float).reshape(-1, 3)
        end = history[-1, 2]
        links = adaptive["link_levels"]
        for index, (link, changes) in enumerate(links.items()):
            xs = [float(np.interp(r, history[:, 0], history[:, 2])) for r, _ in changes] + [end]
            apart = 2 ** (0.04 * (index - len(links) / 2))  # links at one level stay visible
            ys = [_level_number(level) * apart for _, level in changes]
            ys.append(ys[-1])
            slow = link == f"{w.slow_link[0]}-{w.slow_link[1]}"
            levels.step(xs, ys, where="post", label=f"link {link}" + (" (slow)" if slow else ""),
                        linewidth=2.5 if slow else 1)  # fmt: skip
        if adaptive["change_seconds"] is not None:
            levels.axvline(adaptive["change_seconds"], color="grey", linestyle=":")
        levels.set_yscale("log", base=2)
        levels.set(xlabel="wall seconds", ylabel="PowerGossip rank in force",
                   title="adaptive: level per link (lines set slightly apart)")  # fmt: skip
        levels.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _level_number(level: str) -> float:
    """4 for "rank=4"; NaN for a label with no number."""
    digits = level.rsplit("=", 1)[-1]
    try:
        return float(digits)
    except ValueError:
        return math.nan


# command line -----------------------------------------------------------------------------------
def _link(text: str) -> tuple[int, int]:
    try:
        a, b = (int(part) for part in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I-J (two ranks), got {text[:40]!r}") from None
    return shaped_links.edge(a, b)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = Workload()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--links", choices=["shaped", "throttled"], default="shaped",
                        help="real peer processes on shaped links (root), or one simulate "
                        "process with throttled links")  # fmt: skip
    parser.add_argument("--configs", nargs="+", choices=["dpsgd", "fixed", "adaptive"],
                        default=["dpsgd", "fixed", "adaptive"],
                        help="which configurations to run (fixed: one per --ranks)")  # fmt: skip
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                        help="PowerGossip's fixed ranks")  # fmt: skip
    parser.add_argument("--peers", type=int, default=d.peers)
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--change-at", type=float, default=d.change_fraction,
                        help="fraction of the rounds after which the slow link drops")  # fmt: skip
    parser.add_argument("--slow-link", type=_link, default=d.slow_link)
    parser.add_argument("--mbit", type=float, default=d.mbit)
    parser.add_argument("--slow-mbit", type=float, default=d.slow_mbit)
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--dataset", default=d.dataset)
    parser.add_argument("--partition", default=d.partition)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--settle-rounds", type=int, default=d.settle_rounds,
                        help="rounds after the drop before round time counts as adapted")  # fmt: skip
    parser.add_argument("--round-budget", type=float, default=None)
    parser.add_argument("--round-timeout", type=float, default=d.round_timeout)
    parser.add_argument("--keep", type=Path, help="keep each configuration's reports and logs "
                        "in KEEP/NAME (a new folder) instead of a temporary one")  # fmt: skip
    parser.add_argument("--config-timeout", type=float, default=1800.0,
                        help="seconds one configuration may take")  # fmt: skip
    args = parser.parse_args(argv)
    problems = []
    if not 3 <= args.peers <= shaped_links.MAX_PEERS:
        problems.append(f"--peers: expected 3 to {shaped_links.MAX_PEERS}, got {args.peers}")
    if args.rounds < 3:
        problems.append(f"--rounds: expected at least 3, got {args.rounds}")
    if not 0 < args.change_at < 1:
        problems.append(f"--change-at: expected a fraction in (0, 1), got {args.change_at}")
    if max(args.slow_link) >= args.peers or args.slow_link not in ring_edges(args.peers):
        problems.append(f"--slow-link {args.slow_link[0]}-{args.slow_link[1]}: not a ring edge")
    if any(r < 1 for r in args.ranks):
        problems.append("--ranks: expected ranks >= 1")
    if args.eval_every < 1:
        problems.append("--eval-every: expected at least 1 (time to accuracy needs evaluations)")
    if args.round_budget is not None and args.round_budget <= 0:
        problems.append("--round-budget: expected seconds > 0")
    for flag in ("mbit", "slow_mbit"):
        try:
            shaped_links.check_mbit(getattr(args, flag), f"--{flag.replace('_', '-')}")
        except ValueError as error:
            problems.append(str(error))
    if problems:
        parser.error("; ".join(problems))
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(
        peers=args.peers, rounds=args.rounds, change_fraction=args.change_at,
        slow_link=args.slow_link, mbit=args.mbit, slow_mbit=args.slow_mbit, model=args.model,
        dataset=args.dataset, partition=args.partition, lr=args.lr, batch_size=args.batch_size,
        seed=args.seed, eval_every=args.eval_every, settle_rounds=args.settle_rounds,
        round_budget=args.round_budget, round_timeout=args.round_timeout,
    )  # fmt: skip


def run_all(
    runner: ShapedRunner | ThrottledRunner,
    chosen: list[Configuration],
    w: Workload,
    keep: Path | None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Run every configuration in turn (in `keep`/NAME when given, else a temporary folder);
    those this gossipcomp cannot run are skipped, with the reason."""
    results, skipped = [], {}
    for configuration in chosen:
        try:
            runner.check(configuration)
        except Unsupported as why:
            skipped[configuration.name] = f"skipped: {why}"
            print(f"{configuration.name}: skipped: {why}", flush=True)
            continue
        began = time.perf_counter()
        if keep is not None:
            directory = keep / configuration.name
            directory.mkdir(parents=True, exist_ok=False)
            run = runner.run(configuration, directory)
        else:
            with tempfile.TemporaryDirectory(prefix="adaptive-") as tmp:
                run = runner.run(configuration, Path(tmp))
        result = summarise(configuration, run, w)
        result["invocation_seconds"] = time.perf_counter() - began
        results.append(result)
        reached = result["time_to_090"]
        print(
            f"{configuration.name:>9}: "
            + (
                f"{w.target:.2f} after {reached:7.1f} s"
                if reached
                else f"{w.target:.2f} not reached"
            )
            + f", final {result['final_accuracy']:.3f}, {result['round_seconds'] or 0:.3f} s/round"
            + f" ({result['round_seconds_before_change'] or 0:.3f} before the drop,"
            + f" {result['round_seconds_after_change'] or 0:.3f} after),"
            + f" {result['bytes_sent_total'] / 1e6:.1f} MB",
            flush=True,
        )
    return results, skipped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    w = workload_of(args)
    chosen = configurations(args.configs, args.ranks)
    load_before = os.getloadavg()[0]
    try:
        if args.links == "shaped":
            edges = ring_edges(w.peers)
            with shaped_links.ShapedNetwork(w.peers, edges, w.mbit, control=True) as network:
                runner = ShapedRunner(network, w, args.config_timeout)
                results, skipped = run_all(runner, chosen, w, args.keep)
        else:
            results, skipped = run_all(
                ThrottledRunner(w, args.config_timeout), chosen, w, args.keep
            )
    except shaped_links.NamespacesUnavailable as error:
        print(f"adaptive.py: network namespaces are not available ({error}); run as root on "
              "Linux, or use --links throttled", file=sys.stderr)  # fmt: skip
        return 1
    report = {
        "links": args.links,
        "workload": {**asdict(w), "change_round": w.change_round},
        "command": " ".join(
            ["python", "benchmarks/adaptive.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "configurations": results,
        "skipped": skipped,
        **compare(results),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    for key in ("adaptive_vs_best_fixed", "adaptive_vs_dpsgd", "round_time_vs_budget"):
        value = report[key]
        print(f"{key}: " + ("n/a" if value is None else f"{value:.3f}"))
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, w, args.plot, "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
