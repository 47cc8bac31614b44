"""Local updates with an outer optimizer and drift correction: accuracy against bytes.

Run: python benchmarks/outer.py --json docs/outer.json --reports outer-reports
     gossipcomp plot outer-reports/*.json --out docs/outer.png

Every run is a real `simulate` (ring8 digits, 8 peers over gRPC on loopback, the defaults:
600 local steps of SGD lr 0.1 momentum 0.9, batch 32), with the same seeds for every
configuration. The reference is D-PSGD at H = 1 (exact gossip after every step). For each
partition, the best configuration within the bytes budget (1/100 of D-PSGD's bytes by label,
1/500 iid) is the one with the highest mean peer accuracy over the seeds among the
candidates; the grid (by label, seeds 0-2 unless --grid-seeds says otherwise) sets plain local
SGD, outer Nesterov and NoLoCo-style side by side, with and without drift correction, at H in
{1, 4, 16, 64}.

Written keys: bylabel_gap_points and bylabel_bytes_ratio (D-PSGD's mean accuracy minus the best
configuration's, in points; its bytes over D-PSGD's), iid_gap_points and iid_bytes_ratio,
allreduce_gap_points and allreduce_bytes_ratio (benchmarks/allreduce_diloco.py, when it runs),
best (the configuration behind each), and runs (every configuration and seed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from results import save
from rich.console import Console
from rich.table import Table

from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.topology import load_topology

BUDGET = {"by-label": 100, "iid": 500}  # at most 1/budget of D-PSGD's bytes at H = 1
KEY = {"by-label": "bylabel", "iid": "iid"}
OUTERS = {"plain": None, "nesterov": "nesterov", "noloco": "noloco"}


@dataclass(frozen=True)
class Setting:
    """One configuration: a label and what it changes in the run's TrainConfig."""

    label: str
    changes: tuple[tuple[str, Any], ...]

    def config(self, base: TrainConfig) -> TrainConfig:
        return replace(base, **dict(self.changes))


def setting(label: str, **changes: Any) -> Setting:
    return Setting(label, tuple(sorted(changes.items())))


REFERENCE = setting("D-PSGD H=1", algorithm="dpsgd")
# the candidates for the figures, per partition, each within its bytes budget; by label also
# the drift corrections side by side on exact gossip (over the budget: a comparison, not a
# candidate): none, tracking at the safe rate (K-GT), and rate 1 (SCAFFOLD, outer/drift.py)
DRIFT_COMPARISON = [
    setting(f"D-PSGD H=4 {name}", algorithm="dpsgd", local_steps=4, drift=drift)
    for name, drift in (
        ("plain", "none"),
        ("tracking", "tracking"),
        ("scaffold", "tracking:rate=1"),
    )
]
CANDIDATES = {
    "by-label": [
        *DRIFT_COMPARISON,
        setting(
            "PowerGossip r2x4 H=6 scaffold",
            algorithm="powergossip:rank=2,steps=4",
            local_steps=6,
            drift="tracking:rate=1",
        ),
        setting("PowerGossip r1 H=2 tracking", local_steps=2, drift="tracking"),
        setting(
            "PowerGossip r1 H=2 noloco tracking", local_steps=2, outer="noloco", drift="tracking"
        ),
        setting(
            "PowerGossip r2x4 H=8 tracking",
            algorithm="powergossip:rank=2,steps=4",
            local_steps=8,
            drift="tracking",
        ),
        setting(
            "PowerGossip r2x4 H=6 tracking",
            algorithm="powergossip:rank=2,steps=4",
            local_steps=6,
            drift="tracking",
        ),
        setting(
            "PowerGossip r2x4 H=8 noloco",
            algorithm="powergossip:rank=2,steps=4",
            local_steps=8,
            outer="noloco",
        ),
        setting(
            "Choco sign H=4 tracking",
            algorithm="choco:compressor=sign",
            local_steps=4,
            drift="tracking",
        ),
    ],
    "iid": [
        setting("DEF sign H=17", algorithm="def:compressor=sign", local_steps=17),
        setting(
            "DEF sign H=17 noloco", algorithm="def:compressor=sign", local_steps=17, outer="noloco"
        ),
        setting("PowerGossip r1 H=8", local_steps=8),
        setting("PowerGossip r1 H=8 noloco", local_steps=8, outer="noloco"),
        setting(
            "PowerGossip r1 H=8 noloco tracking", local_steps=8, outer="noloco", drift="tracking"
        ),
    ],
}


def grid(steps: tuple[int, ...]) -> list[Setting]:
    """Plain local SGD, outer Nesterov and NoLoCo-style, with and without drift correction,
    at each H (PowerGossip rank 1, the default algorithm)."""
    return [
        setting(
            f"PowerGossip r1 H={h} {name}" + (" tracking" if drift != "none" else ""),
            local_steps=h,
            outer=outer,
            drift=drift,
        )
        for h in steps
        for name, outer in OUTERS.items()
        for drift in ("none", "tracking")
    ]


def parse_seeds(text: str) -> list[int]:
    """Comma-separated non-negative seeds ('' for none), in the order given, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"seeds: expected non-negative integers like 0,1,2, got {part[:20]!r}")
        if int(part) not in seeds:
            seeds.append(int(part))
    return seeds


def run_one(
    item: Setting, base: TrainConfig, partition: str, seed: int, topology: Any, reports: Path | None
) -> dict[str, Any]:
    """One simulation; a run that diverges is recorded as such (accuracy 0), not dropped."""
    config = replace(item.config(base), partition=partition, seed=seed)
    start = time.perf_counter()
    record: dict[str, Any] = {
        "label": item.label,
        "partition": partition,
        "seed": seed,
        "algorithm": config.algorithm,
        "local_steps": config.local_steps,
        "outer": config.outer,
        "drift": config.drift,
    }
    try:
        report = run_simulation(config, topology)
    except Exception as error:  # a diverged configuration is a result, shown as one
        record.update(error=str(error)[:200], mean_accuracy=0.0, min_accuracy=0.0, bytes=None)
        return record
    if reports is not None:
        name = f"{partition}-{item.label}-s{seed}".replace(" ", "_").replace("=", "")
        report.write_json(reports / f"{name}.json")
    record.update(
        mean_accuracy=report.final_test_accuracy,
        min_accuracy=report.min_test_accuracy,
        failed_exchanges=sum(p.failed_exchanges for p in report.per_peer),
        test_loss=report.final_test_loss,
        average_model_test_loss=report.average_model_test_loss,
        average_model_accuracy=report.average_model_test_accuracy,
        bytes=report.bytes_sent_total,
        gossip_rounds=report.gossip_rounds,
        seconds=time.perf_counter() - start,
    )
    return record


def _mean(runs: list[dict[str, Any]], label: str, partition: str, key: str) -> float:
    values = [r[key] for r in runs if r["label"] == label and r["partition"] == partition]
    return statistics.fmean(values) if values and None not in values else float("nan")


def summarise(runs: list[dict[str, Any]], partition: str) -> dict[str, Any]:
    """The gap (points) and bytes ratio of the best candidate within the budget."""
    reference_accuracy = _mean(runs, REFERENCE.label, partition, "mean_accuracy")
    reference_bytes = _mean(runs, REFERENCE.label, partition, "bytes")
    best: tuple[float, str, float] | None = None
    labels = {r["label"] for r in runs if r["partition"] == partition} - {REFERENCE.label}
    for label in sorted(labels):
        ratio = _mean(runs, label, partition, "bytes") / reference_bytes
        accuracy = _mean(runs, label, partition, "mean_accuracy")
        seeds = {r["seed"] for r in runs if r["label"] == label and r["partition"] == partition}
        reference_seeds = {
            r["seed"] for r in runs if r["label"] == REFERENCE.label and r["partition"] == partition
        }
        if seeds != reference_seeds or not ratio <= 1 / BUDGET[partition]:
            continue  # the figure compares configurations over the same seeds, in budget
        if best is None or accuracy > best[0]:
            best = (accuracy, label, ratio)
    key = KEY[partition]
    if best is None:
        return {f"{key}_gap_points": None, f"{key}_bytes_ratio": None, f"{key}_best": None}
    return {
        f"{key}_gap_points": 100 * (reference_accuracy - best[0]),
        f"{key}_bytes_ratio": best[2],
        f"{key}_best": best[1],
        f"{key}_reference_accuracy": reference_accuracy,
        f"{key}_best_accuracy": best[0],
    }


def table(runs: list[dict[str, Any]]) -> Table:
    t = Table(title="ring8 digits: outer optimizers and drift correction")
    for column in ("partition", "configuration", "seeds", "mean acc", "min acc", "bytes / D-PSGD"):
        t.add_column(column, justify="right")
    for partition in sorted({r["partition"] for r in runs}):
        reference_bytes = _mean(runs, REFERENCE.label, partition, "bytes")
        seen: list[str] = []
        for r in runs:
            if r["partition"] != partition or r["label"] in seen:
                continue
            seen.append(r["label"])
            label = r["label"]
            mine = [x for x in runs if x["label"] == label and x["partition"] == partition]
            ratio = _mean(runs, label, partition, "bytes") / reference_bytes
            t.add_row(
                partition,
                label,
                str(len(mine)),
                f"{_mean(runs, label, partition, 'mean_accuracy'):.4f}",
                f"{_mean(runs, label, partition, 'min_accuracy'):.4f}",
                _ratio_text(mine, reference_bytes, ratio),
            )
    return t


def _ratio_text(runs: list[dict[str, Any]], reference_bytes: float, ratio: float) -> str:
    if any(r["bytes"] is None for r in runs):
        return "diverged"
    if reference_bytes != reference_bytes:  # no reference among these runs (see --merge)
        return "no reference"
    return f"1/{1 / ratio:.0f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--reports", type=Path, help="write each run's report here (for plot)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the figures' runs")
    parser.add_argument("--rounds", type=int, default=600, help="local steps of every run")
    parser.add_argument("--topology", default="ring8")
    parser.add_argument(
        "--grid-steps", default="1,4,16,64", help="H values of the grid ('' for none)"
    )
    parser.add_argument(
        "--grid-seeds",
        default="0,1,2",
        help="seeds of the grid, comma-separated (a part of them, to split a run over processes)",
    )
    parser.add_argument(
        "--partitions", default="by-label,iid", help="partitions of the figures ('' for none)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="LABEL",
        help="run only these configurations (the reference too only if named); with --merge "
        "of the other runs afterwards",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="summarise the runs of these earlier --json files instead of running any",
    )
    parser.add_argument(
        "--allreduce-from",
        type=Path,
        help="the all-reduce figure: a --json of benchmarks/allreduce_diloco.py",
    )
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    if args.merge:
        for path in args.merge:
            runs += json.loads(path.read_text())["runs"]
    else:
        with _quiet_peers():
            runs = run_all(args)
    result: dict[str, Any] = {"rounds": args.rounds, "seeds": args.seeds, "topology": args.topology}
    for partition in sorted({r["partition"] for r in runs if r["label"] == REFERENCE.label}):
        result.update(summarise(runs, partition))
    result["allreduce_gap_points"] = result["allreduce_bytes_ratio"] = None
    if args.allreduce_from is not None:
        allreduce = json.loads(args.allreduce_from.read_text())
        for key in ("allreduce_gap_points", "allreduce_bytes_ratio"):
            result[key] = allreduce[key]
        result["allreduce_best"] = allreduce.get("best")
    result["runs"] = runs
    Console().print(table(runs))
    save(args.json, result)
    return result


@contextlib.contextmanager
def _quiet_peers() -> Iterator[None]:
    """Diverging grid points warn once per peer and round; the table reports them. Only
    gossipcomp's own loggers are raised, and only while the runs last, so a caller (the test
    suite runs this benchmark in-process) keeps its logging as it was."""
    logger = logging.getLogger("gossipcomp")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The figures' runs (every seed) and the grid (each of its seeds)."""
    topology = load_topology(args.topology)
    base = TrainConfig(rounds=args.rounds, eval_every=0)
    if args.reports is not None:
        args.reports.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for partition in [p for p in args.partitions.split(",") if p]:
        for seed in range(args.seeds):
            for item in [REFERENCE, *CANDIDATES[partition]]:
                if args.only and item.label not in args.only:
                    continue
                runs.append(run_one(item, base, partition, seed, topology, args.reports))
    steps = tuple(int(h) for h in args.grid_steps.split(",") if h)
    for seed in parse_seeds(args.grid_seeds):
        for item in grid(steps):
            if args.only and item.label not in args.only:
                continue
            runs.append(run_one(item, base, "by-label", seed, topology, args.reports))
    return runs


if __name__ == "__main__":
    main()
