"""The all-reduce benchmarks run end to end in a tiny configuration (the real scripts, in a
subprocess, 2 gloo ranks, a few steps) and write the JSON fields docs/benchmarks.md quotes.

The figures are meaningless at this size; the checks are on what holds at any size: the fields
exist, byte counts are exact, ratios are consistent with the times they come from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGITS_MLP_FLOATS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


def _run(script: str, *arguments: str) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *arguments],
        cwd=ROOT,
        env=env,
        timeout=240,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_allreduce_benchmark_writes_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    _run("allreduce.py", "--nproc", "2", "--steps", "8", "--repeats", "1", "--json", str(out))
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert methods["allreduce"]["payload_bytes_per_step"] == 4 * DIGITS_MLP_FLOATS
    assert (
        methods["allreduce"]["link_bytes_per_step"] == 4 * DIGITS_MLP_FLOATS
    )  # 2 ranks: 2(N-1)/N = 1
    assert methods["torch fp16"]["payload_bytes_per_step"] == 2 * DIGITS_MLP_FLOATS
    assert methods["sign"]["payload_bytes_per_step"] == 4 + (DIGITS_MLP_FLOATS + 7) // 8
    assert (
        methods["powersgd"]["payload_bytes_per_step"]
        == methods["torch powersgd"]["payload_bytes_per_step"]
    )
    ratio = methods["powersgd"]["step_ms"] / methods["torch powersgd"]["step_ms"]
    assert abs(result["powersgd_vs_torch_time"] - ratio) < 1e-9
    marsit = methods["marsit (no momentum)"]["link_bytes_per_step"]
    assert result["marsit_bytes_ratio"] == marsit / (4 * DIGITS_MLP_FLOATS)
    assert 1 / 32 <= result["marsit_bytes_ratio"] < 1 / 32 * 1.01
    for field in ("marsit_accuracy_gap", "ssd_accuracy_gap", "powersgd_accuracy"):
        assert -1.0 <= result[field] <= 1.0


def test_allreduce_merge_benchmark_writes_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "merge.json"
    _run("allreduce_merge.py", "--nproc", "2", "--steps", "8", "--repeats", "1", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["tensors"] >= 100
    methods = result["methods"]
    for spec in ("sign", "topk:ratio=0.01"):
        assert methods[f"{spec} per-tensor"]["groups"] == result["tensors"]
        assert methods[f"{spec} single"]["groups"] == 1
        planned = methods[f"{spec} planned"]["step_ms"]
        ratios = result["ratios"][spec]
        assert (
            abs(ratios["merged_speedup"] - methods[f"{spec} per-tensor"]["step_ms"] / planned)
            < 1e-9
        )
        assert (
            abs(ratios["planned_vs_single"] - methods[f"{spec} single"]["step_ms"] / planned) < 1e-9
        )
    assert result["merged_speedup"] == min(r["merged_speedup"] for r in result["ratios"].values())
    assert result["planned_vs_single"] > 0
