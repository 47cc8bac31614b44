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
