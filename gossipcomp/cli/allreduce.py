"""`gossipcomp allreduce`: the all-reduce command (gossipcomp/allreduce/command.py) under the
command line, its parser and run in the shape every command of gossipcomp.cli has."""

from __future__ import annotations

import argparse

from rich.console import Console

from gossipcomp.allreduce import command
from gossipcomp.inputs.arguments import HelpWithDefaults


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp allreduce` and its flags."""
    allreduce = sub.add_parser(
        "allreduce",
        help="data-parallel training on torch.distributed with compressed all-reduce",
        formatter_class=HelpWithDefaults,
    )
    command.add_arguments(allreduce)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run it; it writes its own errors, one line each, and returns the exit status."""
    return command.run(args)
