"""The documented check for what the test suite cannot run: the commands of the README and its
guides (docs/guides/*.md) that start several processes (peers, a coordinator, torchrun) or train
for minutes, run as printed.

    python scripts/check_docs_commands.py            # every 'check' block, as printed
    python scripts/check_docs_commands.py --quick    # the same with --rounds/--steps 40

scripts/docs_blocks.py says which blocks these are. They run in the order of
docs_blocks.doc_files(), each file's in document order, in one new folder (so the TLS
walk-through's keys serve the coordinator block after it in the security guide), each under bash
with a time limit. Two readings of the text: the Python block marked MARKER is saved as
train_peer.py (the file the launch line after it runs), and a line for one peer of a network
(`--rank 2`, "on each peer") is run for every rank of ring4 at once. Every background process
is waited on one by one, so a peer that fails fails its block (a bare `wait` would not say). `--quick` inserts
`--rounds 40` after `gossipcomp simulate` and `gossipcomp peer` (a printed `--rounds` still wins)
and `--steps 40` after `gossipcomp allreduce`. The demo of the README's first line
(`gossipcomp simulate`) runs first. Exit status 1 when any block failed; a table at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_blocks import MARKER, Block, all_blocks, coverage  # noqa: E402

RANKS = 4  # the guides' multi-process examples run ring4


def _each_peer(text: str) -> str:
    """A line for one peer (`--rank 2`) becomes the same line for every rank, started together."""
    lines = []
    for line in text.splitlines():
        if re.search(r"gossipcomp peer .*--rank 2\b", line) and "$r" not in line:
            command = line.split("#")[0].rstrip().replace("--rank 2", "--rank $r")
            command = command.replace("peer2.json", "peer$r.json")
            line = f"for r in $(seq 0 {RANKS - 1}); do {command} & done; wait"
        lines.append(line)
    return "\n".join(lines)


def _every_job_checked(text: str) -> str:
    """`wait` alone, or on a list, says nothing of a process that failed: wait on each."""
    text = re.sub(r"\bwait \$(\w+)", r"for job in $\1; do wait $job; done", text)
    return re.sub(r"\bwait$", "for job in $(jobs -p); do wait $job; done", text, flags=re.M)


def _quick(text: str, rounds: int) -> str:
    text = re.sub(r"gossipcomp (simulate|peer)\b", rf"gossipcomp \1 --rounds {rounds}", text)
    return re.sub(r"gossipcomp allreduce\b", f"gossipcomp allreduce --steps {rounds}", text)


def _checked_here(file: str) -> bool:
    """The README and its guides; docs/benchmarks.md's blocks are the benchmarks' own runs."""
    return file == "README.md" or file.startswith("docs/guides/")


def _run(name: str, script: str, folder: Path, limit: float) -> tuple[int, float, str]:
    start = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", script],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=limit,
        )
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout:
        code, out = 124, f"timed out after {limit:.0f} s\n{timeout.stdout or ''}"
    seconds = time.monotonic() - start
    tail = "\n".join(out.strip().splitlines()[-6:])
    print(f"== {name}: status {code} in {seconds:.0f} s\n{tail}\n", flush=True)
    return code, seconds, tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="--rounds/--steps 40")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds per block")
    args = parser.parse_args()
    blocks: list[Block] = [
        b
        for b in all_blocks()
        if _checked_here(b.file) and (coverage(b) == "check" or "> secure-ring4.yaml" in b.text)
    ]
    folder = Path(tempfile.mkdtemp(prefix="gossipcomp-docs-"))
    env_note = f"in {folder} with {sys.executable}"
    print(f"checking {len(blocks)} blocks of the README and its guides {env_note}\n", flush=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    demo = _quick("gossipcomp simulate", 40) if args.quick else "gossipcomp simulate"
    results = [("README.md:3 (demo)", *_run("demo", demo, folder, args.limit))]
    for block in blocks:
        name = f"{block.file}:{block.line}"
        if block.language == "python":
            if block.text.startswith(MARKER):
                (folder / "train_peer.py").write_text(block.text + "\n")
                print(f"== {name}: saved as train_peer.py for the launch line\n")
            continue
        script = _every_job_checked(_each_peer(block.text))
        if args.quick:
            script = _quick(script, 40)
        results.append((name, *_run(name, script, folder, args.limit)))
    width = max(len(name) for name, *_ in results)
    print(f"{'block':{width}} status  seconds")
    for name, code, seconds, _ in results:
        print(f"{name:{width}} {code:6}  {seconds:7.0f}")
    return 1 if any(code for _, code, _, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
