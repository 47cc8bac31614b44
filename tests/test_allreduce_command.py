"""`gossipcomp allreduce` (here `python -m gossipcomp.allreduce`, the same code): local
processes and torchrun write simulate's report fields; bad input is one line and status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from gossipcomp.experiment.report import PeerReport, Report

ROOT = Path(__file__).resolve().parents[1]


def _run(*arguments: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = launcher or [sys.executable, "-m", "gossipcomp.allreduce"]
    return subprocess.run(
        [*command, *arguments],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
        timeout=180,
        capture_output=True,
        text=True,
    )


def _check_report(path: Path, ranks: int, steps: int) -> dict:
    report = json.loads(path.read_text())
    assert set(report) == {f.name for f in fields(Report)}
    assert report["mode"] == "allreduce" and report["rounds"] == steps
    assert [p["rank"] for p in report["per_peer"]] == list(range(ranks))
    for peer in report["per_peer"]:
        assert set(peer) == {f.name for f in fields(PeerReport)}
    assert report["consensus_distance"] == 0.0  # all-reduce keeps one model
    assert report["final_test_accuracy"] > 0.5
    return report


def test_local_processes_write_simulates_report_fields(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = _run(
        "--nproc",
        "2",
        "--steps",
        "40",
        "--compressor",
        "topk:ratio=0.05",
        "--eval-every",
        "20",
        "--report",
        str(out),
        "--quiet",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = _check_report(out, 2, 40)
    assert report["config"]["payload_bytes_per_step"] == 8 * 4251  # k = 5% of 85002, 8 B each
    assert [h["round"] for h in report["history"]] == [20, 40]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_launch_writes_the_report_from_rank_0(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    torchrun = [
        shutil.which("torchrun") or "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "gossipcomp.allreduce",
    ]
    done = _run(
        "--steps",
        "30",
        "--sync",
        "ssd",
        "--ssd-k",
        "3",
        "--ssd-warmup",
        "5",
        "--report",
        str(out),
        "--quiet",
        launcher=torchrun,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _check_report(out, 2, 30)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--nproc", "0"], "nproc must be in [1, 64], got 0"),
        (["--nproc", "2", "--compressor", "nonsense"], "unknown compressor 'nonsense'"),
        (["--nproc", "2", "--sync", "merged", "--compressor", "powersgd:rank=2"], "ddp-hook"),
        (["--nproc", "2", "--sync", "merged", "--planner", "nope"], "unknown planner 'nope'"),
        (["--nproc", "2", "--lr", "nan"], "learning rate must be a finite number"),
        (["--nproc", "2", "--sync", "marsit", "--compressor", "torch:fp16"], "torch's hooks"),
    ],
)
def test_bad_input_is_one_line_and_status_2(arguments: list[str], expected: str) -> None:
    done = _run(*arguments)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 2 and expected in done.stderr, done.stderr


def test_no_nproc_outside_torchrun_says_what_is_missing() -> None:
    env_free = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-m", "gossipcomp.allreduce", "--steps", "5"],
        cwd=ROOT,
        env=env_free,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "RANK is not set; start ranks with torchrun or gossipcomp allreduce" in done.stderr
