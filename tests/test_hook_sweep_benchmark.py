"""benchmarks/hook_sweep.py end to end in a tiny configuration (2 gloo ranks, a few steps):
the JSON fields docs/benchmarks.md quotes, and verdicts that follow from the accuracies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hook_sweep_writes_accuracies_and_verdicts_that_follow_from_them(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    arguments = ["--nproc", "2", "--steps", "6", "--lrs", "0.1", "0.3", "--momenta", "0", "0.9"]
    arguments += ["--hooks", "sign", "powersgd rank 2", "--floor", "0.0", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hook_sweep.py"), *arguments],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["buckets"] == 3  # the default cap puts each weight matrix in its own bucket
    hooks = ("allreduce", "powersgd rank 2", "sign")
    cells = [f"lr {lr}, momentum {m}" for m in ("0", "0.9") for lr in ("0.1", "0.3")]
    assert sorted(result["accuracy"]) == sorted(f"{h} | {c}" for h in hooks for c in cells)
    for hook in hooks:
        for cell in cells:
            accuracy = result["accuracy"][f"{hook} | {cell}"]
            plain = result["accuracy"][f"allreduce | {cell}"]
            assert 0.0 <= accuracy <= 1.0
            assert result["trains"][hook][cell] == (accuracy >= plain - result["margin"])
        listed = {
            f"lr {lr:g}, momentum {m}" for m, lrs in result["ranges"][hook].items() for lr in lrs
        }
        assert listed == {cell for cell in cells if result["trains"][hook][cell]}
