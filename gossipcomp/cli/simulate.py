"""`gossipcomp simulate`: every peer of a topology in this process (or a few), talking real
gRPC on loopback, with an in-process coordinator and throttled links when asked."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gossipcomp.cli.coordinator import add_coordinator_flags, make_coordinator, require_adaptive
from gossipcomp.cli.training_flags import add_training_flags
from gossipcomp.inputs.arguments import HelpWithDefaults, integer, number
from gossipcomp.topology import Topology
from gossipcomp.transport.throttled import MAX_MBIT, LinkRates, RateChange

if TYPE_CHECKING:  # the training stack (torch): loaded by a run, not by --help
    from gossipcomp.experiment.simulation import PeerLevels

DEFAULT_TOPOLOGY = "ring8"
# bytes of the smallest round a link carries (an envelope of one rank-1 message of the digits
# MLP is ~4 KB): a slower link cannot finish even that within the round's deadline
MIN_ROUND_BYTES = 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp simulate` and its flags."""
    sim = sub.add_parser(
        "simulate",
        formatter_class=HelpWithDefaults,
        help="every peer of a topology in this process, real gRPC on loopback, digits data",
    )
    sim.add_argument(
        "--topology",
        default=DEFAULT_TOPOLOGY,
        help="topology YAML file, or a shipped name",
    )
    sim.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between the peers, with a throwaway CA and certificates",
    )
    sim.add_argument(
        "--authenticate",
        action="store_true",
        help="peers sign every message with throwaway keys and check each other's (needs --tls)",
    )
    sim.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw this run (accuracy against steps, bytes and time; consensus distance) here",
    )
    sim.add_argument(
        "--workers",
        type=_workers,
        default="auto",
        help="spread the peers over this many processes (blocks of ranks; they talk gRPC on "
        "loopback): one interpreter per core instead of one for all peers; auto: one per "
        "usable core, at least 4 peers each (1 with --authenticate)",
    )
    coord = sim.add_argument_group("coordinator")
    coord.add_argument(
        "--coordinator",
        action="store_true",
        help="run a coordinator in this process: peers report measurements to it and switch to "
        "the schedules it plans (choco, choco-edge, def)",
    )
    add_coordinator_flags(coord)
    coord.add_argument(
        "--no-coordinator",
        action="store_true",
        help="with --adaptive: no coordinator; the lower-ranked end of each edge sets the "
        "edge's rank or level from its own sends (powergossip, choco-edge), each peer the level "
        "it sends at from its "
        "sends over its slowest link (choco, def), and announces it in its envelopes",
    )
    links = sim.add_argument_group("throttled links (in this process; real ones: benchmarks/)")
    links.add_argument(
        "--link-rate",
        type=number("link rate (Mbit/s)", 0.0, MAX_MBIT),
        metavar="MBIT",
        help="every link carries at most this many megabits per second",
    )
    links.add_argument(
        "--link-change",
        type=_link_change,
        action="append",
        default=[],
        metavar="I-J:MBIT@ROUND",
        help="from ROUND on, link I-J carries MBIT megabits per second (repeatable; needs "
        "--link-rate), e.g. 0-1:10@30",
    )
    add_training_flags(sim, rank_is_low_rank=True)


def run(args: argparse.Namespace, console: Console) -> int:
    """Every check first, then every peer's training, then the report."""
    # the training stack and the network (the coordinator's service, worker processes): only
    # a run needs them
    from gossipcomp.cli.training import prepare, train_and_finish
    from gossipcomp.experiment.simulation import run_simulation

    checked, _ = prepare(args, None, "--rank")
    peer_levels = _peer_levels(args)
    config, topology = checked.config, checked.topology
    if topology.live is not None:
        raise ValueError(
            f"--topology {topology.name}: live membership (`members:`) runs with `gossipcomp "
            "coordinator` and one `gossipcomp peer --coordinator` per rank; simulate runs every "
            "rank of a fixed topology (expected a topology file without `members:`)"
        )
    label = f"{config.algorithm} on {topology.name}"
    train = partial(
        run_simulation,
        tls=args.tls,
        authenticate=args.authenticate,
        workers=_worker_count(args.workers, topology.n, args.authenticate),
        coordinator=(
            make_coordinator(args, topology)
            if (args.coordinator or args.adaptive) and peer_levels is None
            else None
        ),
        link_rates=_link_rates(args, topology),
        peer_levels=peer_levels,
    )
    return train_and_finish(args, console, checked, train, config.gossip_rounds * topology.n, label)


def _peer_levels(args: argparse.Namespace) -> PeerLevels | None:
    """Link levels set by the peers themselves, without a coordinator (`--adaptive
    --no-coordinator`); ValueError for flags that contradict it."""
    require_adaptive(args)
    if not args.no_coordinator:
        return None
    if not args.adaptive:
        raise ValueError(
            "--no-coordinator: expected --adaptive with it (the peers set link levels)"
        )
    for flag, given in (
        ("--coordinator", args.coordinator),
        ("--boost", args.boost),
        ("--hold-lowest-until", args.hold_lowest_until > 0),
    ):
        if given:
            raise ValueError(
                f"--no-coordinator with {flag}: {flag} works through a coordinator; expected one of them"
            )
    from gossipcomp.experiment.simulation import PeerLevels

    return PeerLevels(args.round_budget, args.follow_loss)


def _workers(text: str) -> str | int:
    from gossipcomp.experiment.simulation import MAX_WORKERS

    return text if text == "auto" else integer("worker processes", 1, MAX_WORKERS)(text)


def _worker_count(workers: str | int, peers: int, authenticate: bool) -> int:
    """`--workers`, with auto resolved: a process per usable core while each gets at least
    four peers (fewer peers gain less than a process costs to start), and one when messages
    are signed (the throwaway keys live in one process)."""
    if workers != "auto":
        return int(workers)
    if authenticate:
        return 1
    from gossipcomp.experiment.simulation import MAX_WORKERS, usable_cores

    return max(1, min(usable_cores(), peers // 4, MAX_WORKERS))


def _link_change(text: str) -> RateChange:
    try:
        return RateChange.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _link_rates(args: argparse.Namespace, topology: Topology) -> LinkRates | None:
    """The throttle `--link-rate/--link-change` ask for; ValueError naming a change of a
    link the topology does not have."""
    if args.link_rate is None:
        if args.link_change:
            raise ValueError("--link-change: expected --link-rate too (the rate before it)")
        return None
    for change in args.link_change:
        if not topology.graph.has_edge(change.a, change.b):
            raise ValueError(
                f"--link-change {change.a}-{change.b}: not an edge of {topology.name}; "
                f"expected one of its {topology.graph.number_of_edges()} edges"
            )
    floor = MIN_ROUND_BYTES * 8 / 1e6 / args.round_timeout
    rates = [("--link-rate", args.link_rate)]
    rates += [(f"--link-change {c.a}-{c.b}", c.mbit) for c in args.link_change]
    for flag, mbit in rates:
        if mbit < floor:
            raise ValueError(
                f"{flag} {mbit:g} Mbit/s: below the floor of {floor:.3g} Mbit/s, at which a "
                f"round of {MIN_ROUND_BYTES} bytes still crosses a link within --round-timeout "
                f"{args.round_timeout:g} s; expected at least {floor:.3g} Mbit/s"
            )
    return LinkRates(args.link_rate, args.link_change)
