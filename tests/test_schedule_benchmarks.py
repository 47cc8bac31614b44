"""The schedule benchmarks run end to end in a tiny configuration (real scripts, subprocesses)
and write the JSON fields docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *arguments: str, timeout: float) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *arguments],
        check=True,
        cwd=ROOT,
        timeout=timeout,
        capture_output=True,
    )


def test_planner_benchmark_reports_decision_times_and_gaps(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    _run(
        "planner.py",
        *("--sizes", "20", "50", "--repeats", "2", "--instances", "12", "--max-tensors", "6"),
        *("--json", str(out)),
        timeout=120,
    )
    report = json.loads(out.read_text())
    for planner in ("per-tensor", "single", "mergecomp", "mgwfbp", "strategy"):
        for mode in ("gossip", "allreduce"):
            times = report["decision_ms"][planner][mode]
            assert set(times) == {"20", "50"} and all(ms > 0 for ms in times.values())
        assert report["gap_vs_bruteforce"][planner]["max"] >= -1e-9
    for field in ("decision_ms_max_at_size", "decision_cpu_ms_max_at_size"):
        assert set(report[field]) == {"20", "50"} and all(v > 0 for v in report[field].values())
    # the exact planners cannot lose to the brute force of their own cost model
    assert report["max_gap_vs_bruteforce"] == {
        "mergecomp": pytest.approx(0, abs=1e-9),
        "strategy": pytest.approx(0, abs=1e-9),
    }
    assert report["bruteforce_ms"]["tensors"] == 6


def test_scaling_benchmark_reports_the_table_plot_and_validation(tmp_path: Path) -> None:
    out, picture = tmp_path / "scaling.json", tmp_path / "scaling.png"
    _run(
        "scaling.py",
        *("--peers", "8", "16", "--rounds", "5", "--steps", "16"),
        *("--validate", "4", "--calibrate", "4", "--low-rounds", "2", "--peer-rounds", "200"),
        *("--repeats", "1"),
        *("--json", str(out), "--plot", str(picture)),
        timeout=300,
    )
    report = json.loads(out.read_text())
    layouts = {"ring", "torus", "exponential", "ring-allreduce"}
    assert {row["layout"] for row in report["scaling"]} == layouts
    assert {row["peers"] for row in report["scaling"]} == {8, 16}
    assert len(report["scaling"]) == 2 * 2 * 4 * 2  # links x compressors x layouts x sizes
    assert all(0 < row["efficiency"] <= 1 and row["round_s"] > 0 for row in report["scaling"])
    (row,) = report["validation"]
    assert row["peers"] == 4 and row["measured_round_s"] > 0 and row["predicted_round_s"] > 0
    assert report["max_relative_error"] == pytest.approx(abs(row["relative_error"]))
    assert report["max_measured_spread"] == 0  # one repeat: nothing to spread
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
