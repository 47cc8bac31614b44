"""The committed gRPC stubs are exactly what scripts/generate_protos.py makes from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "generate_protos", ROOT / "scripts" / "generate_protos.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = {p.name: p.read_text() for p in module.generate(tmp_path)}
    committed_dir = ROOT / "gossipcomp" / "proto" / "v1"
    committed = {
        p.name: p.read_text()
        for p in committed_dir.iterdir()
        if p.is_file() and p.suffix in (".py", ".pyi")
    }
    assert set(fresh) == set(committed), "stub files differ: run scripts/generate_protos.py"
    for name, text in fresh.items():
        assert committed[name] == text, (
            f"{name} drifted from protos/: run scripts/generate_protos.py"
        )
