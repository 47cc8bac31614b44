"""`gossipcomp plot`: draw reports (accuracy against steps, bytes and time; consensus distance)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from gossipcomp.cli.common import check_plot_path
from gossipcomp.experiment.plot import MAX_PIXELS, MAX_REPORTS, MIN_PIXELS, plot_reports
from gossipcomp.inputs.arguments import HelpWithDefaults, integer


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp plot` and its flags."""
    plot = sub.add_parser(
        "plot",
        formatter_class=HelpWithDefaults,
        help="draw reports: accuracy against local steps, bytes and wall time, one line per "
        "report with the per-peer spread shaded, and consensus distance",
    )
    plot.add_argument("reports", type=Path, nargs="+", metavar="REPORT.json")
    plot.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="PNG to write")
    plot.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="TEXT",
        help="name of a report's line, once per report in their order (default: from the run: "
        "algorithm, compressor, topology, peer; what differs when two read the same)",
    )
    plot.add_argument(
        "--width", type=integer("width (pixels)", MIN_PIXELS, MAX_PIXELS), default=1200
    )
    plot.add_argument(
        "--height", type=integer("height (pixels)", MIN_PIXELS, MAX_PIXELS), default=900
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """Draw the reports; ValueError for too many of them or an output that cannot be written."""
    if len(args.reports) > MAX_REPORTS:
        raise ValueError(f"{len(args.reports)} reports: expected at most {MAX_REPORTS}")
    check_plot_path(args.out, "--out")
    plot_reports(args.reports, args.out, args.width, args.height, args.label)
    console.print(f"plot written to {args.out}")
    return 0
