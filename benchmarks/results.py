"""Writing a benchmark's results: the JSON file every benchmark's --json names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save(path: Path | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` as indented JSON (its folder made first); nothing if None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
