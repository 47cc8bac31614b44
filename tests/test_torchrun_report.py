"""Peers launched by torchrun share one command line: a --report without {rank} would be written
by every peer in turn, keeping only the last one's (issue 22, finding 7). It is refused before
anything starts, naming the remedy; {rank}, an explicit --rank, or a launch of one rank are not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossipcomp.cli import build_parser
from gossipcomp.cli.training import fill_rank_in_paths

ROOT = Path(__file__).resolve().parents[1]


def test_a_shared_report_path_under_torchrun_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "gossipcomp", "peer", "--topology", "ring4", "--report", str(out)],
        cwd=ROOT,
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "the 4 peers of this launch" in lines[0] and "keeping only the last" in lines[0]
    assert "put {rank} in the file name, e.g. 'report{rank}.json'" in lines[0], lines[0]
    assert not out.exists()


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
    ],
)
def test_per_rank_or_single_rank_reports_are_accepted(
    arguments: list[str], world: str | None, expected: str
) -> None:
    assert _filled(arguments, 2, world) == Path(expected)


def test_the_refusal_in_process_names_the_flag_and_the_path() -> None:
    with pytest.raises(ValueError, match=r"--report 'r\.json': the 3 peers"):
        _filled(["--report", "r.json"], 0, "3")


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
