"""`gossipcomp topology show`: a topology's peers, degrees, spectral gap and mixing weights, and
for a time-varying one its period, each round's largest degree and the period's contraction."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from gossipcomp.cli.common import resolve_topology
from gossipcomp.experiment.presentation import format_topology
from gossipcomp.topology import MAX_DENSE_PEERS, Topology

SHOWN_ROUNDS = 32  # rounds of a period whose degree is listed


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp topology show FILE`."""
    topo = sub.add_parser("topology", help="inspect topology files")
    topo_sub = topo.add_subparsers(dest="topology_command", required=True)
    show = topo_sub.add_parser("show", help="peers, degrees, spectral gap and mixing weights")
    show.add_argument("file", help="topology YAML file (or shipped name)")


def format_rounds(topology: Topology) -> Table:
    """The per-round facts of a time-varying topology: its period, the largest degree of each
    round, and ||W_{P-1} ... W_0 - 11^T/n||_2 (0: one period averages exactly). The static
    rows above describe the union graph and the mean W over a period."""
    rounds = topology.rounds
    if rounds is None:
        raise ValueError(f"topology {topology.name} is static: it has no per-round graphs")
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    period = topology.period
    table.add_row("time-varying", "yes: the rows above are the union graph and the mean W")
    table.add_row("period", str(period) if period else "none (a random matching every round)")
    degrees = rounds.degrees()
    shown = ", ".join(map(str, degrees[:SHOWN_ROUNDS]))
    more = f", ... ({len(degrees) - SHOWN_ROUNDS} more)" if len(degrees) > SHOWN_ROUNDS else ""
    label = "degree per round" if period else "degree per round (round 0)"
    table.add_row(label, shown + more)
    over = "period" if period else f"rounds 0..{(topology.n - 1).bit_length() - 1}"
    contraction = (
        f"{rounds.contraction:.3g}"
        if topology.n <= MAX_DENSE_PEERS
        else f"not computed over {MAX_DENSE_PEERS} peers"
    )
    table.add_row(f"contraction over the {over}", contraction)
    return table


def format_members(topology: Topology) -> Table:
    """The facts of a live topology (topology/members.py): its capacity, initial members and
    the SLEM of its family over them. The rows above describe the union of every graph the
    family can give (the complete graph on the capacity, uniform W), not a round's."""
    live = topology.live
    if live is None:
        raise ValueError(f"topology {topology.name} has a fixed membership")
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("live membership", "yes: the rows above are the capacity's union graph")
    table.add_row("capacity", f"{live.capacity} ranks (0..{live.capacity - 1})")
    shown = ", ".join(map(str, live.initial[:SHOWN_ROUNDS]))
    more = (
        f", ... ({len(live.initial) - SHOWN_ROUNDS} more)"
        if len(live.initial) > SHOWN_ROUNDS
        else ""
    )
    table.add_row("initial members", shown + more)
    table.add_row(f"{live.kind} over them: SLEM", f"{live.slem(()):.4f}")
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    """Print the topology (on stdout: it is the command's output)."""
    topology = resolve_topology(args.file)
    out = Console()
    out.print(format_topology(topology))
    if topology.time_varying:
        out.print(format_rounds(topology))
    if topology.live is not None:
        out.print(format_members(topology))
    return 0
