"""Rich renderings of library objects for the command line.

Kept apart from the objects themselves so that the graph and transport layers load no terminal
library: only the CLI layer imports rich.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table

from gossipcomp.topology import Topology

SHOWN_NEIGHBOURS = 16  # neighbours listed per peer by format_topology


def format_topology(topology: Topology) -> RenderableType:
    """A summary (name, kind, n, hash, spectral quantities) and one row per peer (its first
    SHOWN_NEIGHBOURS neighbours: a row stays short on dense graphs)."""
    t = topology
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")
    summary.add_row("name", t.name)
    summary.add_row("kind", t.kind)
    summary.add_row("n / edges", f"{t.n} / {t.graph.number_of_edges()}")
    summary.add_row("hash", t.hash)
    summary.add_row("spectral gap", f"{t.spectral_gap:.4g}")
    summary.add_row("SLEM", f"{t.second_largest_eigenvalue_modulus:.4f}")
    summary.add_row("optimal consensus step", f"{t.optimal_consensus_step:.4f}")
    peers = Table(title="peers")
    for col in ("rank", "address", "degree", "self weight", "neighbour:weight"):
        peers.add_column(col, justify="left" if col.startswith(("addr", "neigh")) else "right")
    for r in range(t.n):
        weights = list(t.neighbor_weights(r).items())
        nbrs = ", ".join(f"{j}:{w:.4f}" for j, w in weights[:SHOWN_NEIGHBOURS])
        if len(weights) > SHOWN_NEIGHBOURS:
            nbrs += f", ... ({len(weights) - SHOWN_NEIGHBOURS} more)"
        degree, self_w = str(t.graph.degree(r)), f"{t.self_weight(r):.4f}"
        peers.add_row(str(r), t.addresses[r], degree, self_w, nbrs)
    return Group(summary, peers)
