"""The merged-compression benchmark runs end to end in a tiny configuration and writes the
fields docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_merge_benchmark_writes_its_ratios(tmp_path):
    out = tmp_path / "merge.json"
    command = [sys.executable, "benchmarks/merge.py", "--rounds", "3", "--repeats", "1"]
    command += ["--algorithms", "choco-sign", "--topology", "ring4", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    entry = result["algorithms"]["choco-sign"]
    assert set(entry["round_seconds"]) == {"per-tensor", "single", "mergecomp"}
    assert entry["merged_speedup"] > 0 and entry["planned_vs_single"] > 0
    assert all(0.0 <= a <= 1.0 for a in entry["accuracy"].values())
    # merged sign keeps each tensor's scale: the merged runs are the per-tensor run bit for bit
    assert entry["accuracy"]["single"] == entry["accuracy"]["per-tensor"]
    assert entry["accuracy_gap_vs_per_tensor"] == 0.0
    if entry["planned_is_single"]:  # one schedule measured twice: pooled, not noise
        assert entry["planned_vs_single"] == 1.0
    assert result["tensors"] == 102
