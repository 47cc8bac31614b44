"""The example in examples/ runs as documented and trains."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_custom_loop_example_trains_four_peers():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_loop.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", result.stdout)]
    assert len(accuracies) == 4 and min(accuracies) >= 0.9, result.stdout


def test_own_model_example_trains_six_peers_and_agrees_on_batchnorm_statistics():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_model.py"), "--steps", "150"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", result.stdout)]
    assert len(accuracies) == 7 and min(accuracies) >= 0.9, result.stdout  # 6 peers, central
    assert re.findall(r"150 local steps, 150 gossip rounds", result.stdout), result.stdout
    found = re.search(r"running mean (\d\.\d+), first layer weights (\d\.\d+)", result.stdout)
    assert found, result.stdout
    # gossiped: within a few times the weights' spread (0.021 and 0.010 after 300 steps);
    # the issue measured 0.24 for running means that were never gossiped
    assert float(found[1]) < 0.1, result.stdout
