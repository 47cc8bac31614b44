"""Command line: `gossipcomp simulate`, `gossipcomp peer`, `gossipcomp coordinator`,
`gossipcomp allreduce`, `gossipcomp plot`, `gossipcomp topology show`, `gossipcomp keys new`.

Argument parsing, checks that fail fast, progress display and reports only; the work happens in
simulation. One module per command (its flags and its run), the flags `simulate` and `peer`
share in training_flags.py (those `allreduce` takes too in gossipcomp.inputs.arguments), and here the
parser that gathers them and `main`, which turns every outcome into an exit status.

A command's module is imported when that command runs, and `main` builds the parser of that
command alone (every command's for `gossipcomp --help` or an unknown command): `gossipcomp
topology show` loads neither torch nor the training stack, `peer --help` and `simulate --help`
neither the all-reduce mode, scikit-learn, matplotlib nor the coordinator's service, `allreduce`
not the gossip peer (tests/test_cli_imports.py). A command module's top imports are what its
parser needs; what only its run needs, it imports there.

Every flag is checked as it is parsed (a finite number in its range, an integer in its range),
and everything else a run needs (the topology, this peer's rank, PowerGossip's rank against the
model, TLS files, where the report and checkpoints go) before training starts, so a mistake costs
seconds, not a run. Exit status: 0 done; 2 the command cannot run as given (a bad flag, file,
address or topology, a neighbour unreachable or refusing at start); 1 training failed (diverged,
a peer heard no neighbour for --max-failed-rounds rounds, or a peer of the simulation did); 1
with a traceback for an internal error (a bug); 130 interrupted. Every error but an internal one
is one line on stderr without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from rich.console import Console
from rich.logging import RichHandler

from gossipcomp import lazy_exports
from gossipcomp.inputs.arguments import Parser, write_error
from gossipcomp.peer import GossipStalled
from gossipcomp.transport.base import HandshakeError, PeerUnreachableError

# the commands, in the order --help lists them: each is the module gossipcomp.cli.<command>, with
# add_parser(sub) (its parser and flags) and run(args, console) -> exit status
COMMANDS = ("simulate", "peer", "coordinator", "allreduce", "plot", "topology", "keys")

# names this package re-exports (each imported from its module on first use)
_EXPORTS = {
    "gossipcomp.cli.simulate": "MIN_ROUND_BYTES",
    "gossipcomp.cli.common": "resolve_topology",
}
_exported, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
__all__ = sorted([*_exported, "COMMANDS", "build_parser", "main"])


def _command(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `gossipcomp`: with every command (None), or with `command` alone, whose
    flags are then all there and whose errors and --help read the same, without importing the
    other commands' modules."""
    parser = Parser(
        prog="gossipcomp",
        description="Communication-efficient decentralized training over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS if command is None else (command,):
        _command(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status is returned (module docstring), never raised."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    named = arguments[0] if arguments and arguments[0] in COMMANDS else None
    try:
        args = build_parser(named).parse_args(arguments)
    except SystemExit as done:  # --help (0), or a usage error already written (2)
        return done.code if isinstance(done.code, int) else 2
    prog = f"gossipcomp {args.command}"
    console = Console(stderr=True)
    handler = RichHandler(console=console, show_path=False)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[handler])
    try:
        return _command(args.command).run(args, console)
    except (ValueError, OSError, HandshakeError, PeerUnreachableError) as error:
        write_error(prog, error)  # ValueError covers TopologyError and CheckpointError
        return 2
    except GossipStalled as error:
        write_error(prog, error)
        return 1
    except KeyboardInterrupt:
        write_error(prog, "interrupted")
        return 130
    except Exception as error:
        if isinstance(error, _training_failures()):
            write_error(prog, error)
            return 1
        traceback.print_exc()  # a bug: say so, with the traceback needed to fix it
        write_error(
            prog,
            f"internal error ({type(error).__name__}: {error}); this is a bug in gossipcomp, "
            "please report it with the traceback above",
        )
        return 1


def _training_failures() -> tuple[type[Exception], ...]:
    """The errors that end training (status 1, one line). Imported only when an error must be
    told apart: their modules are the training stack, which the commands that do not train
    never load."""
    from gossipcomp.experiment import TrainingAborted, TrainingDiverged
    from gossipcomp.experiment.simulation import WorkerFailed

    return (TrainingDiverged, TrainingAborted, WorkerFailed)
