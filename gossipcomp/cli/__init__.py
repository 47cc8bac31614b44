"""Command line: `gossipcomp simulate`, `gossipcomp peer`, `gossipcomp coordinator`,
`gossipcomp allreduce`, `gossipcomp plot`, `gossipcomp topology show`, `gossipcomp keys new`.

Argument parsing, checks that fail fast, progress display and reports only; the work happens in
simulation. One module per command (its flags and its run), the flags `simulate` and `peer`
share in training_flags.py (those `allreduce` takes too in gossipcomp.inputs.arguments), and here the
parser that gathers them and `main`, which turns every outcome into an exit status.

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
import logging
import traceback
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.logging import RichHandler

from gossipcomp.allreduce import command as allreduce_command
from gossipcomp.cli import coordinator, keys, peer, plot, simulate, topology
from gossipcomp.cli.common import resolve_topology
from gossipcomp.cli.simulate import MIN_ROUND_BYTES
from gossipcomp.experiment import TrainingAborted, TrainingDiverged
from gossipcomp.experiment.simulation import WorkerFailed
from gossipcomp.inputs.arguments import HelpWithDefaults, Parser, write_error
from gossipcomp.peer import LEVELS_LOGGER, GossipStalled
from gossipcomp.transport.base import HandshakeError, PeerUnreachableError

__all__ = ["MIN_ROUND_BYTES", "build_parser", "main", "resolve_topology"]


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser under `gossipcomp`, in the order --help lists them."""
    parser = Parser(
        prog="gossipcomp",
        description="Communication-efficient decentralized training over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    simulate.add_parser(sub)
    peer.add_parser(sub)
    coordinator.add_parser(sub)
    allreduce = sub.add_parser(
        "allreduce",
        help="data-parallel training on torch.distributed with compressed all-reduce",
        formatter_class=HelpWithDefaults,
    )
    allreduce_command.add_arguments(allreduce)
    plot.add_parser(sub)
    topology.add_parser(sub)
    keys.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status is returned (module docstring), never raised."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or a usage error already written (2)
        return done.code if isinstance(done.code, int) else 2
    prog = f"gossipcomp {args.command}"
    console = Console(stderr=True)
    handler = RichHandler(console=console, show_path=False)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[handler])
    if not getattr(args, "quiet", False):
        logging.getLogger(LEVELS_LOGGER).setLevel(logging.INFO)  # link level changes are news
    try:
        return _run(args, console)
    except (ValueError, OSError, HandshakeError, PeerUnreachableError) as error:
        write_error(prog, error)  # ValueError covers TopologyError and CheckpointError
        return 2
    except (TrainingDiverged, TrainingAborted, GossipStalled, WorkerFailed) as error:
        write_error(prog, error)
        return 1
    except KeyboardInterrupt:
        write_error(prog, "interrupted")
        return 130
    except Exception as error:  # a bug: say so, with the traceback needed to fix it
        traceback.print_exc()
        write_error(
            prog,
            f"internal error ({type(error).__name__}: {error}); this is a bug in gossipcomp, "
            "please report it with the traceback above",
        )
        return 1


def _run(args: argparse.Namespace, console: Console) -> int:
    """The command, after parsing: every check first, then the work, then the report."""
    return _COMMANDS[args.command](args, console)


def _allreduce(args: argparse.Namespace, console: Console) -> int:
    return allreduce_command.run(args)  # writes its own errors, one line each


_COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "simulate": simulate.run,
    "peer": peer.run,
    "coordinator": coordinator.run,
    "allreduce": _allreduce,
    "plot": plot.run,
    "topology": topology.run,
    "keys": keys.run,
}
