"""`gossipcomp topology show`: a topology's peers, degrees, spectral gap and mixing weights."""

from __future__ import annotations

import argparse

from rich.console import Console

from gossipcomp.cli.common import resolve_topology
from gossipcomp.experiment.presentation import format_topology


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp topology show FILE`."""
    topo = sub.add_parser("topology", help="inspect topology files")
    topo_sub = topo.add_subparsers(dest="topology_command", required=True)
    show = topo_sub.add_parser("show", help="peers, degrees, spectral gap and mixing weights")
    show.add_argument("file", help="topology YAML file (or shipped name)")


def run(args: argparse.Namespace, console: Console) -> int:
    """Print the topology (on stdout: it is the command's output)."""
    Console().print(format_topology(resolve_topology(args.file)))
    return 0
