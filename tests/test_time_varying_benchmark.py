"""The time-varying benchmark runs end to end in a tiny configuration (4 peers, 4 rounds) and
writes the fields docs/benchmarks.md quotes: one neighbour a round sends 1/degree of the bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_time_varying_benchmark_compares_graphs_at_equal_bytes(tmp_path):
    out = tmp_path / "time_varying.json"
    command = [sys.executable, "benchmarks/time_varying.py", "--peers", "4", "--rounds", "4"]
    command += ["--eval-every", "2", "--algorithms", "D-PSGD", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(command, cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {run["graph"]: run for run in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"ring (static)", "exponential (static)", "one-peer exp.", "base-2"}
    one_peer, ring = runs["one-peer exp."], runs["ring (static)"]
    assert one_peer["period"] == 2 and ring["period"] == 1
    # same model, same rounds: bytes scale with the neighbours a round (ring: 2, one-peer: 1)
    assert ring["bytes_sent_total"] == 2 * one_peer["bytes_sent_total"]
    assert runs["base-2"]["bytes_sent_total"] == one_peer["bytes_sent_total"]
    for run in runs.values():
        assert 0 <= run["final_test_accuracy"] <= 1
        assert run["history"][-1]["bytes"] == run["bytes_sent_total"]
    # the one-peer run's own accuracy within its own bytes is its final accuracy
    assert one_peer["accuracy_at_one_peer_bytes"] == one_peer["final_test_accuracy"]
    table = subprocess.run(
        [sys.executable, "benchmarks/time_varying.py", "--render", str(out)],
        cwd=ROOT, env=env, timeout=120, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "| by-label | D-PSGD | one-peer exp. | 2 |" in table
