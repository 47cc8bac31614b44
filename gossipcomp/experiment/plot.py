"""Pictures of runs: accuracy against local steps, bytes and wall time, and consensus distance.

`gossipcomp plot A.json B.json --out runs.png` draws one line per report (the peers' mean test
accuracy, the spread from the worst to the best peer shaded) in three panels, and the peers'
final squared distances to the network average in a fourth, so that two runs compare at a
glance. Each line is named after its run (algorithm, compressor, topology, and the peer for a
`peer` report); runs that would read the same get what tells them apart (the settings that
differ, else the path), or the names given with `--label`. Bytes are per peer (a report's total
over its peers, divided by their number), so a `simulate` report of every peer, a `peer` report
of one and an all-reduce report of its ranks compare on one axis. The report's final state ends
every line, so a run without `--eval-every` still plots. Reports are files: each is read by
gossipcomp.inputs.files (regular files, size and nesting bounded) and every field is checked before it
is drawn; all reports together are bounded too, and a line keeps at most MAX_POINTS_DRAWN points.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gossipcomp.experiment.report import Report
from gossipcomp.inputs.files import load_json_file
from gossipcomp.inputs.numbers import checked_number
from gossipcomp.inputs.text import quoted

MAX_REPORT_BYTES = 32 * 2**20  # a report of a 10^5-evaluation run with 10^3 peers is smaller
MAX_TOTAL_REPORT_BYTES = 64 * 2**20  # all reports of one picture: bounds time and memory
MAX_REPORT_DEPTH = 8  # nesting of a report's JSON; reports need 4
MAX_REPORTS = 20  # lines one picture can keep apart
MAX_LABEL = 60  # characters of a line's name
MAX_POINTS_DRAWN = 2000  # points of one line: more than a picture's width shows
MIN_PIXELS, MAX_PIXELS = 300, 6000
DPI = 100
BYTES_AXIS = "MB sent per peer (a report's total / its peers)"
ACCURACY_AXIS = "test accuracy (mean over peers; min-max shaded)"
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Curve:
    """What is drawn of one report: per evaluation (the last one the run's final state), local
    steps, MB sent per peer, seconds (NaN where the report did not record them), and the mean,
    min and max test accuracy over its peers; per peer, its consensus distance. `settings`:
    the run's configuration, to tell apart runs whose labels read the same."""

    label: str
    peers: int
    steps: list[float]
    megabytes: list[float]
    seconds: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]
    distances: list[float]
    settings: tuple[tuple[str, str], ...] = ()


def _short(text: str, limit: int = MAX_LABEL) -> str:
    """`text` (from a file) on one line, at most `limit` characters."""
    text = " ".join(text[: 4 * limit].split())
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def run_label(report: dict[str, Any]) -> str:
    """A run's name from its report: algorithm, compressor (when the algorithm's name does not
    say it), topology, and the peer when the report is one peer's."""
    algorithm, topology = report.get("algorithm"), report.get("topology")
    config = report.get("config") if isinstance(report.get("config"), dict) else {}
    parts = [_short(algorithm, 40) if isinstance(algorithm, str) else "unnamed run"]
    compressor = config.get("compressor")
    if isinstance(compressor, str) and compressor not in parts[0]:
        parts.append(_short(compressor, 30))
    label = " ".join(parts)
    if isinstance(topology, str):
        label += f" on {_short(topology, 30)}"
    peers = report.get("per_peer")
    if report.get("mode") == "peer" and isinstance(peers, list) and len(peers) == 1:
        rank = peers[0].get("rank") if isinstance(peers[0], dict) else None
        if isinstance(rank, int) and not isinstance(rank, bool):
            label += f", peer {rank}"
    return _short(label)


def _settings(report: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    config = report.get("config")
    if not isinstance(config, dict):
        return ()
    items = [(k, v) for k, v in config.items() if isinstance(k, str) and isinstance(v, _SCALARS)]
    return tuple((_short(k, 30), _short(str(v), 30)) for k, v in sorted(items)[:200])


def curve_of(report: Report) -> Curve:
    """What is drawn of a report of this process's own run."""
    return _curve(report.to_dict(), "report")


def load_curve(path: Path, max_bytes: int = MAX_REPORT_BYTES) -> Curve:
    """Read (at most `max_bytes`) and check one report written by `simulate`, `peer` or
    `allreduce` with `--report`."""
    report = load_json_file(
        path, "report", "a JSON report written with --report", max_bytes, MAX_REPORT_DEPTH
    )
    if not isinstance(report, dict):
        raise ValueError(f"{path}: expected a JSON object (a report), got {type(report).__name__}")
    return _curve(report, str(path))


def _final_point(report: dict[str, Any], per_peer: list[Any], path: str) -> dict[str, Any]:
    """The run's final state as one more history point, from the report's own fields."""
    try:
        accuracies = [p["test_accuracy"] for p in per_peer]
        return {
            "round": report["rounds"],
            "mean_test_accuracy": report["final_test_accuracy"],
            "min_test_accuracy": report["min_test_accuracy"],
            "max_test_accuracy": max(
                checked_number(f"{path}: per_peer[].test_accuracy", a, 0, 1) for a in accuracies
            ),
            "bytes_sent_total": report["bytes_sent_total"],
            "wall_seconds": report["wall_seconds"],
        }
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"{path}: missing {quoted(str(error))}; expected a non-empty 'history' list or the "
            "final fields of a report (rounds, final_test_accuracy, per_peer[].test_accuracy, ...)"
        ) from None


def _curve(report: dict[str, Any], path: str) -> Curve:
    """Check the fields drawn of `report` (read from `path`)."""
    history, per_peer = report.get("history", []), report.get("per_peer")
    if not isinstance(per_peer, list) or not per_peer:
        raise ValueError(f"{path}: expected a non-empty 'per_peer' list")
    if not isinstance(history, list):
        raise ValueError(f"{path}: expected a 'history' list, got {type(history).__name__}")
    if not all(isinstance(peer, dict) for peer in per_peer):
        raise ValueError(f"{path}: per_peer: expected a list of objects")
    last = history[-1] if history else None
    if not history or (
        isinstance(last, dict) and "rounds" in report and last.get("round") != report["rounds"]
    ):
        history = [*history, _final_point(report, per_peer, path)]  # the run's end
    peers = len(per_peer)
    columns: dict[str, list[float]] = {k: [] for k in ("steps", "mb", "s", "mean", "low", "high")}
    for index, point in enumerate(history):
        where = f"{path}: history[{index}]"
        if not isinstance(point, dict):
            raise ValueError(f"{where}: expected an object, got {type(point).__name__}")
        try:
            mean = checked_number(f"{where}.mean_test_accuracy", point["mean_test_accuracy"], 0, 1)
            low = checked_number(f"{where}.min_test_accuracy", point["min_test_accuracy"], 0, 1)
            columns["steps"].append(checked_number(f"{where}.round", point["round"], 0.0))
            sent = checked_number(f"{where}.bytes_sent_total", point["bytes_sent_total"], 0.0)
        except KeyError as error:
            raise ValueError(f"{where}: missing {error}") from None
        high = point.get("max_test_accuracy", mean)  # older reports: min to mean
        columns["high"].append(max(mean, checked_number(f"{where}.max_test_accuracy", high, 0, 1)))
        seconds = checked_number(f"{where}.wall_seconds", point.get("wall_seconds", 0.0), 0.0)
        columns["s"].append(seconds if seconds > 0 else math.nan)  # 0: not recorded
        columns["mb"].append(sent / peers / 1e6)
        columns["mean"].append(mean)
        columns["low"].append(low)
    distances = [
        checked_number(
            f"{path}: per_peer[{index}].consensus_distance", peer.get("consensus_distance"), 0.0
        )
        for index, peer in enumerate(per_peer)
    ]
    return Curve(
        run_label(report),
        peers,
        columns["steps"],
        columns["mb"],
        columns["s"],
        columns["mean"],
        columns["low"],
        columns["high"],
        distances,
        _settings(report),
    )


def tell_apart(curves: Sequence[Curve], paths: Sequence[str]) -> list[Curve]:
    """`curves` (read from `paths`) renamed where labels collide: first by the settings that
    differ among the runs of one label, then by the shortest end of the path that differs."""
    named = list(curves)
    for label in {c.label for c in curves}:
        group = [i for i, c in enumerate(curves) if c.label == label]
        if len(group) < 2:
            continue
        keys = sorted({k for i in group for k, _ in curves[i].settings})
        differ = [k for k in keys if len({dict(curves[i].settings).get(k) for i in group}) > 1][:3]
        for i in group:
            values = dict(curves[i].settings)
            extra = ", ".join(f"{k}={values.get(k, '-')}" for k in differ)
            named[i] = replace(curves[i], label=_short(f"{label} ({extra})") if extra else label)
        if len({named[i].label for i in group}) < len(group):
            parts = [Path(paths[i]).parts for i in group]
            for depth in range(1, max(len(p) for p in parts) + 1):
                ends = [os.path.join(*p[-depth:]) for p in parts]
                if len(set(ends)) == len(ends):
                    break
            for i, end in zip(group, ends, strict=True):
                label_and_path = f"{_short(named[i].label, 48)} [{end[-40:]}]"
                named[i] = replace(named[i], label=label_and_path)
    return named


def with_labels(curves: Sequence[Curve], labels: Sequence[str]) -> list[Curve]:
    """`curves` named by `labels` (one each, in order), as given with `--label`."""
    if len(labels) != len(curves):
        raise ValueError(
            f"--label given {len(labels)} time(s) for {len(curves)} report(s); expected one "
            "--label per report, in the order of the reports (or none)"
        )
    for label in labels:
        if not label.strip() or len(label) > MAX_LABEL:
            raise ValueError(
                f"--label {quoted(label)}: expected 1 to {MAX_LABEL} characters, not blank"
            )
    return [replace(c, label=label) for c, label in zip(curves, labels, strict=True)]


def check_size(width: int, height: int) -> None:
    for what, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what}: expected an integer number of pixels, got {quoted(value)}")
        if not MIN_PIXELS <= value <= MAX_PIXELS:
            raise ValueError(f"{what}: expected {MIN_PIXELS} to {MAX_PIXELS} pixels, got {value}")


def _drawn(values: list[float]) -> np.ndarray:
    """`values` thinned to at most MAX_POINTS_DRAWN, evenly, first and last kept."""
    array = np.asarray(values, dtype=float)
    if len(array) <= MAX_POINTS_DRAWN:
        return array
    return array[np.linspace(0, len(array) - 1, MAX_POINTS_DRAWN).round().astype(int)]


def draw_curves(curves: Sequence[Curve], width: int = 1200, height: int = 900) -> Figure:
    """A figure of `width` x `height` pixels drawing `curves` (module docstring)."""
    check_size(width, height)
    if not 1 <= len(curves) <= MAX_REPORTS:
        raise ValueError(f"expected 1 to {MAX_REPORTS} reports, got {len(curves)}")
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    axes = figure.subplots(2, 2)
    panels = [
        (axes[0][0], "steps", "local steps"),
        (axes[0][1], "megabytes", BYTES_AXIS),
        (axes[1][0], "seconds", "wall time (s)"),
    ]
    for axis, _, xlabel in panels:
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ACCURACY_AXIS)
        axis.grid(True, alpha=0.3)
    distance_axis = axes[1][1]
    for index, curve in enumerate(curves):
        colour = f"C{index % 10}"
        mean, low, high = _drawn(curve.mean), _drawn(curve.low), _drawn(curve.high)
        for axis, field, _ in panels:
            x = _drawn(getattr(curve, field))
            axis.plot(x, mean, color=colour, label=curve.label, marker=".")
            axis.fill_between(x, low, high, color=colour, alpha=0.2, linewidth=0)
        distance_axis.scatter(
            [index + 1] * len(curve.distances), curve.distances, color=colour, alpha=0.6
        )
        average = sum(curve.distances) / len(curve.distances)
        distance_axis.hlines(average, index + 0.7, index + 1.3, color=colour)
    distance_axis.set_xticks(range(1, len(curves) + 1), [str(i + 1) for i in range(len(curves))])
    distance_axis.set_xlim(0.5, len(curves) + 0.5)
    distance_axis.set_xlabel("report (as in the legend, in order)")
    distance_axis.set_ylabel("final ||x_i - mean x||^2 per peer (line: mean)")
    distances = [d for c in curves for d in c.distances]
    if all(d > 0 for d in distances):
        distance_axis.set_yscale("log")
    elif any(d > 0 for d in distances):  # a peer exactly at the average: linear near 0
        positive = [d for d in distances if d > 0]
        distance_axis.set_yscale("symlog", linthresh=min(positive) / 10)
        distance_axis.set_ylim(0, max(positive) * 2)
    distance_axis.grid(True, alpha=0.3)
    legend = [f"{i + 1}. {c.label}" for i, c in enumerate(curves)]
    axes[0][0].legend(axes[0][0].lines, legend, loc="lower right", fontsize="small")
    return figure


def plot_curves(curves: Sequence[Curve], out: Path, width: int = 1200, height: int = 900) -> None:
    """Draw `curves` into a PNG of `width` x `height` pixels at `out`."""
    figure = draw_curves(curves, width, height)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure).print_png(str(out))


def load_curves(paths: Sequence[Path], labels: Sequence[str] = ()) -> list[Curve]:
    """Every report at `paths` read and checked (at most MAX_TOTAL_REPORT_BYTES in all, each
    at most MAX_REPORT_BYTES), named (see tell_apart, or `labels`)."""
    if not 1 <= len(paths) <= MAX_REPORTS:
        raise ValueError(f"{len(paths)} reports: expected 1 to {MAX_REPORTS}")
    sizes = []
    for path in paths:  # all sizes first: too much in all is refused before any is read
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:
            sizes.append(0)  # the reader names the problem
    if sum(sizes) > MAX_TOTAL_REPORT_BYTES:
        largest = max(range(len(paths)), key=sizes.__getitem__)
        raise ValueError(
            f"{len(paths)} report(s) of {sum(sizes)} bytes in all (the largest {paths[largest]}, "
            f"{sizes[largest]} bytes), over the limit of {MAX_TOTAL_REPORT_BYTES} on all reports "
            f"of one picture; expected fewer or smaller reports (each at most {MAX_REPORT_BYTES})"
        )
    left, curves = MAX_TOTAL_REPORT_BYTES, []
    for path, size in zip(paths, sizes, strict=True):  # a file that grew since is refused
        curves.append(load_curve(path, min(MAX_REPORT_BYTES, left)))
        left -= size
    if labels:
        return with_labels(curves, labels)
    return tell_apart(curves, [str(p) for p in paths])


def plot_reports(
    paths: Sequence[Path],
    out: Path,
    width: int = 1200,
    height: int = 900,
    labels: Sequence[str] = (),
) -> None:
    """Check every report, then draw them (nothing is written when one is bad)."""
    check_size(width, height)
    plot_curves(load_curves(paths, labels), out, width, height)
