"""Pictures of runs: accuracy against local steps, bytes and wall time, and consensus distance.

`gossipcomp plot A.json B.json --out runs.png` draws one line per report (the peers' mean test
accuracy, the spread from the worst to the best peer shaded) in three panels, and the peers'
final squared distances to the network average in a fourth, so that two runs compare at a
glance. Reports are files, so every field is checked before it is drawn.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gossipcomp.report import Report
from gossipcomp.text import quoted

MAX_REPORT_BYTES = 64 * 2**20  # a report of a 10^6-round run with 10^3 peers is far smaller
MAX_REPORTS = 20  # lines one picture can keep apart
MIN_PIXELS, MAX_PIXELS = 300, 6000
DPI = 100


@dataclass(frozen=True)
class Curve:
    """What is drawn of one report: per evaluation, local steps, MB sent, seconds, and the
    mean, min and max test accuracy over its peers; per peer, its consensus distance."""

    label: str
    steps: list[float]
    megabytes: list[float]
    seconds: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]
    distances: list[float]


def _number(value: Any, where: str, low: float = 0.0, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {quoted(value)}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{where}: expected a finite number in [{low:g}, {high:g}], got {value}")
    return float(value)


def curve_of(report: Report, label: str) -> Curve:
    """What is drawn of a report of this process's own run."""
    return _curve(report.to_dict(), label, "report")


def load_curve(path: Path) -> Curve:
    """Read and check one report written by `simulate --report` or `peer --report`."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise ValueError(f"{path}: cannot read ({error.strerror or error})") from None
    if size > MAX_REPORT_BYTES:
        raise ValueError(f"{path}: {size} bytes; expected a report of at most {MAX_REPORT_BYTES}")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON report ({quoted(str(error))})") from None
    if not isinstance(report, dict):
        raise ValueError(f"{path}: expected a JSON object (a report), got {type(report).__name__}")
    name = report.get("algorithm")
    label = path.stem if not isinstance(name, str) else f"{path.stem} ({quoted(name)})"
    return _curve(report, label, str(path))


def _curve(report: dict[str, Any], label: str, path: str) -> Curve:
    """Check the fields drawn of `report` (read from `path`)."""
    history, per_peer = report.get("history"), report.get("per_peer")
    if not isinstance(history, list) or not history:
        raise ValueError(f"{path}: expected a non-empty 'history' list (run with --eval-every)")
    if not isinstance(per_peer, list) or not per_peer:
        raise ValueError(f"{path}: expected a non-empty 'per_peer' list")
    columns: dict[str, list[float]] = {k: [] for k in ("steps", "mb", "s", "mean", "low", "high")}
    for index, point in enumerate(history):
        where = f"{path}: history[{index}]"
        if not isinstance(point, dict):
            raise ValueError(f"{where}: expected an object, got {type(point).__name__}")
        try:
            mean = _number(point["mean_test_accuracy"], f"{where}.mean_test_accuracy", 0, 1)
            low = _number(point["min_test_accuracy"], f"{where}.min_test_accuracy", 0, 1)
            columns["steps"].append(_number(point["round"], f"{where}.round"))
            columns["mb"].append(_number(point["bytes_sent_total"], f"{where}.bytes") / 1e6)
        except KeyError as error:
            raise ValueError(f"{where}: missing {error}") from None
        high = point.get("max_test_accuracy", mean)  # older reports: min to mean
        columns["high"].append(max(mean, _number(high, f"{where}.max_test_accuracy", 0, 1)))
        columns["s"].append(_number(point.get("wall_seconds", 0.0), f"{where}.wall_seconds"))
        columns["mean"].append(mean)
        columns["low"].append(low)
    distances = []
    for index, peer in enumerate(per_peer):
        if not isinstance(peer, dict):
            raise ValueError(f"{path}: per_peer[{index}]: expected an object")
        distances.append(
            _number(peer.get("consensus_distance"), f"{path}: per_peer[{index}].consensus_distance")
        )
    return Curve(
        label,
        columns["steps"],
        columns["mb"],
        columns["s"],
        columns["mean"],
        columns["low"],
        columns["high"],
        distances,
    )


def check_size(width: int, height: int) -> None:
    for what, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what}: expected an integer number of pixels, got {quoted(value)}")
        if not MIN_PIXELS <= value <= MAX_PIXELS:
            raise ValueError(f"{what}: expected {MIN_PIXELS} to {MAX_PIXELS} pixels, got {value}")


def plot_curves(curves: Sequence[Curve], out: Path, width: int = 1200, height: int = 900) -> None:
    """Draw `curves` into a PNG of `width` x `height` pixels at `out`."""
    check_size(width, height)
    if not 1 <= len(curves) <= MAX_REPORTS:
        raise ValueError(f"expected 1 to {MAX_REPORTS} reports, got {len(curves)}")
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    axes = figure.subplots(2, 2)
    panels = [
        (axes[0][0], "steps", "local steps"),
        (axes[0][1], "megabytes", "MB sent (all peers)"),
        (axes[1][0], "seconds", "wall time (s)"),
    ]
    for index, curve in enumerate(curves):
        colour = f"C{index % 10}"
        for axis, field, xlabel in panels:
            x = getattr(curve, field)
            axis.plot(x, curve.mean, color=colour, label=curve.label, marker=".")
            axis.fill_between(x, curve.low, curve.high, color=colour, alpha=0.2, linewidth=0)
            axis.set_xlabel(xlabel)
            axis.set_ylabel("test accuracy (mean; min-max shaded)")
            axis.grid(True, alpha=0.3)
        distance_axis = axes[1][1]
        distance_axis.scatter(
            [index] * len(curve.distances), curve.distances, color=colour, alpha=0.6
        )
        mean = sum(curve.distances) / len(curve.distances)
        distance_axis.hlines(mean, index - 0.3, index + 0.3, color=colour)
    distance_axis = axes[1][1]
    distance_axis.set_xticks(range(len(curves)), [str(i + 1) for i in range(len(curves))])
    distance_axis.set_xlabel("report (as in the legend, in order)")
    distance_axis.set_ylabel("final ||x_i - mean x||^2 per peer (line: mean)")
    distances = [d for c in curves for d in c.distances]
    if all(d > 0 for d in distances):
        distance_axis.set_yscale("log")
    elif any(d > 0 for d in distances):  # a peer exactly at the average: linear near 0
        distance_axis.set_yscale("symlog", linthresh=min(d for d in distances if d > 0))
        distance_axis.set_ylim(bottom=0)
    distance_axis.grid(True, alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure).print_png(str(out))


def plot_reports(paths: Sequence[Path], out: Path, width: int = 1200, height: int = 900) -> None:
    """Check every report, then draw them (nothing is written when one is bad)."""
    check_size(width, height)
    plot_curves([load_curve(p) for p in paths], out, width, height)
