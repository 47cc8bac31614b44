"""Peers launched by torchrun share one command line: a --report without {rank} would be written
by every peer in turn, keeping only the last one's (issue 22, finding 7). Each peer of such a
launch writes its own file by default (issue 27): the rank goes before the suffix; {rank}, an
explicit --rank, or a launch of one rank keep the path given. Four real processes writing
their own reports: tests/test_rendezvous.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossipcomp.cli import build_parser
from gossipcomp.cli.training import fill_rank_in_paths

ROOT = Path(__file__).resolve().parents[1]


def _filled(arguments: list[str], rank: int, world: str | None) -> Path:
    args = build_parser().parse_args(["peer", "--topology", "ring4", *arguments])
    saved = os.environ.get("WORLD_SIZE")
    try:
        if world is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = world
        fill_rank_in_paths(args, rank)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved
    return args.report


@pytest.mark.parametrize(
    ("arguments", "world", "expected"),
    [
        (["--report", "r{rank}.json"], "4", "r2.json"),  # one file per peer
        (["--report", "r.json", "--rank", "2"], "4", "r.json"),  # a command line of its own
        (["--report", "r.json"], "1", "r.json"),  # one rank: nothing to overwrite
        (["--report", "r.json"], None, "r.json"),  # RANK without a launcher's WORLD_SIZE
        (["--report", "out/r.json"], "4", "out/r.rank2.json"),  # one command line, 4 peers
        (["--report", "r"], "3", "r.rank2"),  # no suffix: the rank goes last
    ],
)
def test_each_rank_of_a_launch_writes_its_own_report(
    arguments: list[str], world: str | None, expected: str
) -> None:
    assert _filled(arguments, 2, world) == Path(expected)


def test_allreduce_refuses_rank_in_its_one_report(tmp_path: Path) -> None:
    """All-reduce writes one report of every rank from rank 0 (nothing to overwrite); a {rank}
    copied from the peer command would name a file literally 'r{rank}.json'."""
    out = tmp_path / "r{rank}.json"
    done = subprocess.run(
        [sys.executable, "-m", "gossipcomp.allreduce", "--nproc", "2", "--report", str(out)],
        cwd=ROOT,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert "writes one report holding every rank" in done.stderr
    assert "expected a path without {rank}" in done.stderr
    assert not out.exists()
