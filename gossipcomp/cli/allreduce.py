"""`gossipcomp allreduce`: the all-reduce command (gossipcomp/allreduce/command.py) under the
command line, its parser and run in the shape every command of gossipcomp.cli has."""

from __future__ import annotations

import argparse

from rich.console import Console

from gossipcomp.allreduce.flags import add_arguments
from gossipcomp.inputs.arguments import HelpWithDefaults


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp allreduce` and its flags."""
    allreduce = sub.add_parser(
        "allreduce",
        help="data-parallel training on torch.distributed with compressed all-reduce",
        formatter_class=HelpWithDefaults,
    )
    add_arguments(allreduce)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run it; it writes its own errors, one line each, and returns the exit status."""
    from gossipcomp.allreduce import command  # torch.distributed: a run, not --help, loads it

    return command.run(args)
