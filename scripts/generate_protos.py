"""Generate the Python gRPC stubs (with .pyi) from protos/ into gossipcomp/proto/.

Run from anywhere: ``python scripts/generate_protos.py [--out DIR]``. The stubs are committed;
tests/test_proto_stubs.py regenerates them into a temporary folder and fails on any drift.
protoc emits ``from gossipcomp.v1 import ...`` (the proto package path); it is rewritten to the
Python package the stubs live in.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "gossipcomp" / "proto"
PROTO_PACKAGE = "gossipcomp.v1"
PYTHON_PACKAGE = "gossipcomp.proto.v1"


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every .proto under protos/gossipcomp/v1 into out_dir/v1."""
    protos = sorted((PROTO_ROOT / "gossipcomp" / "v1").glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / 'gossipcomp' / 'v1'}")
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        target = out_dir / "v1"
        target.mkdir(parents=True, exist_ok=True)
        for generated in sorted((Path(tmp) / "gossipcomp" / "v1").iterdir()):
            text = generated.read_text()
            text = text.replace(f"from {PROTO_PACKAGE} import", f"from {PYTHON_PACKAGE} import")
            dest = target / generated.name
            dest.write_text(text)
            written.append(dest)
    init = out_dir / "v1" / "__init__.py"
    init.write_text('"""Generated gRPC stubs for gossipcomp.v1 (scripts/generate_protos.py)."""\n')
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package folder")
    args = parser.parse_args(argv)
    if args.out.resolve() == DEFAULT_OUT.resolve() and (DEFAULT_OUT / "v1").exists():
        shutil.rmtree(DEFAULT_OUT / "v1")
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
