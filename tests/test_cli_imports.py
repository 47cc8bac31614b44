"""The command line loads what the command asked for and nothing else: its start-up cost is
the tests' too (tests/test_hostile_flags.py and every test that starts `gossipcomp peer`
processes), and under load importing the all-reduce mode, scikit-learn and matplotlib for
every command took about 30 s. Each command is run in a fresh interpreter, as a user runs it,
and the modules it must not have loaded are named."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import loaded_modules

from gossipcomp.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]

# what the training and all-reduce stacks, the coordinator's service and plotting load
TRAINING = ("torch", "sklearn", "gossipcomp.experiment.simulation", "gossipcomp.peer.node")
NOT_ALLREDUCE = ("gossipcomp.allreduce", "matplotlib")
NOT_SERVICE = ("gossipcomp.coordinator.service", "gossipcomp.coordinator.planning")
PEER_STACK = ("grpc", "gossipcomp.peer.node", "gossipcomp.transport.grpc_transport")

CASES = [
    (["topology", "show", "ring4"], (*TRAINING, *NOT_ALLREDUCE, *NOT_SERVICE, "grpc")),
    (["topology", "--help"], (*TRAINING, *NOT_ALLREDUCE, "grpc")),
    (["keys", "--help"], (*TRAINING, *NOT_ALLREDUCE, "grpc")),
    # a command's --help builds its parser from name tables (gossip/catalog.py and the like):
    # the registries behind them, and torch, load only when a run needs them
    (["peer", "--help"], (*TRAINING, *NOT_ALLREDUCE, *NOT_SERVICE, *PEER_STACK)),
    (["simulate", "--help"], (*TRAINING, *NOT_ALLREDUCE, *NOT_SERVICE, *PEER_STACK)),
    (["coordinator", "--help"], (*TRAINING, *NOT_ALLREDUCE, *NOT_SERVICE, *PEER_STACK)),
    (["allreduce", "--help"], (*TRAINING, "matplotlib", *PEER_STACK)),
]


def _run(argv: list[str], *absent: str) -> list[str]:
    """The modules of `absent` (names and what is under them) loaded after `gossipcomp ARGV`
    ran in a fresh interpreter, which must end with status 0."""
    statement = (
        "import contextlib, io\n"
        "from gossipcomp.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main({argv!r})\n"
        "assert status == 0, status"
    )
    names = loaded_modules(statement, *absent)
    return [m for m in names if any(m == a or m.startswith(a + ".") for a in absent)]


@pytest.mark.parametrize(("argv", "absent"), CASES, ids=lambda v: "-".join(v[:2]))
def test_a_command_loads_only_what_it_runs(argv: list[str], absent: tuple[str, ...]) -> None:
    assert _run(argv, *absent) == []


def test_a_simulation_loads_neither_the_allreduce_mode_nor_matplotlib() -> None:
    """A whole (one-round) run of `simulate` without --plot."""
    argv = ["simulate", "--topology", "ring4", "--rounds", "1", "--quiet", "--workers", "1"]
    assert _run(argv, *NOT_ALLREDUCE) == []


def _help(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        parser.parse_args(argv)
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_one_commands_parser_is_the_whole_parsers(command: str) -> None:
    """`main` builds only the parser of the command given: its --help (every flag, default and
    group) is the one the parser of every command shows."""
    whole = _help(build_parser(), [command, "--help"])
    assert _help(build_parser(command), [command, "--help"]) == whole
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([command, "--help"]) == 0
    assert out.getvalue() == whole and "--help" in whole


def test_the_start_up_benchmark_runs_in_a_tiny_configuration(tmp_path: Path) -> None:
    """benchmarks/cli_startup.py (docs/benchmarks.md quotes it), one pair, this checkout
    against itself: every field is there, and with one pair the ratios are those of its times."""
    out = tmp_path / "startup.json"
    script = ROOT / "benchmarks" / "cli_startup.py"
    command = ["--against", str(ROOT), "--runs", "1", "--command", "keys --help"]
    done = subprocess.run(
        [sys.executable, str(script), *command, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())["commands"]["keys --help"]
    assert all(figures[k] > 0 for k in ("cpu_s", "wall_s", "against_cpu_s", "against_wall_s"))
    assert figures["cpu_ratio"] == pytest.approx(figures["cpu_s"] / figures["against_cpu_s"])
    assert figures["wall_ratio"] == pytest.approx(figures["wall_s"] / figures["against_wall_s"])


def test_the_name_tables_are_the_registries_names() -> None:
    """The torch-free name tables the flags offer are the keys of the registries a run builds
    from, in order, each class registered under its own name; the settings a parser shows are
    the defaults of the config a run checks."""
    from dataclasses import fields

    from gossipcomp.allreduce.settings import MODEL_NAMES as ALLREDUCE_MODEL_NAMES
    from gossipcomp.allreduce.settings import AllreduceSettings
    from gossipcomp.allreduce.train import MODELS as ALLREDUCE_MODELS
    from gossipcomp.allreduce.train import AllreduceConfig
    from gossipcomp.experiment import TrainConfig, TrainSettings
    from gossipcomp.gossip import ALGORITHMS, ATTACKS
    from gossipcomp.gossip.catalog import ALGORITHM_NAMES, ATTACK_NAMES
    from gossipcomp.schedule import PLANNERS
    from gossipcomp.schedule.catalog import PLANNER_NAMES
    from gossipcomp.workload.catalog import DATASET_NAMES, MODEL_NAMES
    from gossipcomp.workload.data import DATASETS
    from gossipcomp.workload.models import MODELS

    assert tuple(ALGORITHMS) == ALGORITHM_NAMES
    assert all(cls.name == name for name, cls in ALGORITHMS.items())
    assert tuple(PLANNERS) == PLANNER_NAMES
    assert all(cls.name == name for name, cls in PLANNERS.items())
    assert tuple(ATTACKS) == ATTACK_NAMES
    assert (tuple(DATASETS), tuple(MODELS)) == (DATASET_NAMES, MODEL_NAMES)
    assert tuple(ALLREDUCE_MODELS) == ALLREDUCE_MODEL_NAMES
    for checked, settings in ((TrainConfig, TrainSettings), (AllreduceConfig, AllreduceSettings)):
        assert fields(checked) == fields(settings) and checked() == checked(**vars(settings()))
