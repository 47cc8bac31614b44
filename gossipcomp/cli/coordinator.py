"""`gossipcomp coordinator`: serve a coordinator that plans schedules from the peers'
measurements; its flags, which `simulate` shares for the coordinator it runs in-process."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import TYPE_CHECKING

from rich.console import Console

from gossipcomp.cli.common import add_tls_flags, planner_spec, resolve_topology, tls_files
from gossipcomp.coordinator.membership import DEFAULT_MEMBER_TIMEOUT, MAX_MEMBER_TIMEOUT
from gossipcomp.inputs.arguments import HelpWithDefaults, integer, number
from gossipcomp.schedule.catalog import PLANNER_NAMES
from gossipcomp.topology import Topology
from gossipcomp.transport.base import MAX_WIRE_ROUND

if TYPE_CHECKING:  # `peer` takes this module's flags: the coordinator itself loads when run
    from gossipcomp.coordinator import Coordinator
    from gossipcomp.rendezvous import Registry


def add_coordinator_flags(group: argparse._ActionsContainer) -> None:
    """The coordinator's flags, which `simulate` takes too (its coordinator runs in-process)."""
    group.add_argument(
        "--planner",
        type=planner_spec,
        default="mergecomp",
        help=f"the coordinator's planner: {', '.join(sorted(PLANNER_NAMES))}",
    )
    add_report_every(group, "rounds between each peer's reports to the coordinator")
    group.add_argument(
        "--replan-every",
        type=integer("replanning interval (rounds)", 1, 10**6),
        default=200,
        help="rounds between the coordinator's plans (it publishes only a plan that differs)",
    )
    group.add_argument(
        "--adaptive",
        action="store_true",
        help="bandwidth-adaptive compression (powergossip: a rank per link; choco-edge: a "
        "level of the compressor's ladder per link; choco, def: one per peer, its slowest "
        "link's): measure every link "
        "from the transfers training makes and set its level to the highest whose transfers "
        "fit the round budget; peers should report every round or two (--report-every)",
    )
    add_round_budget(
        group,
        "the slowest peer's measured compute time per round, so communication hides behind it",
    )
    group.add_argument(
        "--member-timeout",
        type=number("member timeout (seconds)", 0.001, MAX_MEMBER_TIMEOUT),
        default=DEFAULT_MEMBER_TIMEOUT,
        help="a live topology (`members:`): a member silent this many seconds is removed; make "
        "it several times --report-every rounds of the slowest round (a round timeout too)",
    )
    group.add_argument(
        "--hold-lowest-until",
        type=integer("round to hold the lowest level until", 0, MAX_WIRE_ROUND - 1),
        default=0,
        metavar="ROUND",
        help="with --adaptive: the coordinator's decisions before this round publish every link "
        "at the ladder's lowest level (until its first decision, a few rounds in, the peers "
        "send at their own level); from this round on each link rises from the lowest by the "
        "controller's own steps, each in force a margin of rounds after its decision. A "
        "warm-up at the cheapest level, for training whose early rounds gain nothing from a "
        "higher one while every change of the network costs the reaction time at it "
        "(docs/benchmarks.md); no --boost while held; 0 (default): no hold",
    )
    add_no_follow_loss(group, "the peers' median loss (levels set by the peers: its own)")
    group.add_argument(
        "--boost",
        action="store_true",
        help="with --adaptive: a peer in a critical learning phase (a layer's gradient norm "
        "changed by half or more between windows of 10 rounds: Accordion) gets its links one "
        "level higher while it lasts",
    )


def add_report_every(group: argparse._ActionsContainer, help: str) -> None:
    """--report-every, which `peer` takes too (the peer's side of the same interval)."""
    group.add_argument(
        "--report-every",
        type=integer("report interval (rounds)", 1, 10**6),
        default=10,
        help=help,
    )


def add_round_budget(group: argparse._ActionsContainer, default_help: str) -> None:
    """--round-budget, which `peer` takes too; `default_help` says what stands in without it."""
    group.add_argument(
        "--round-budget",
        type=number("round budget (seconds)", 0.0, 86_400.0),
        metavar="SECONDS",
        help="with --adaptive: seconds a round's transfers over one link may take (default: "
        f"{default_help})",
    )


def add_no_follow_loss(group: argparse._ActionsContainer, whose_loss: str) -> None:
    """--no-follow-loss, which `peer` takes too; `whose_loss` says which loss the levels follow."""
    group.add_argument(
        "--no-follow-loss",
        dest="follow_loss",
        action="store_false",
        help="with --adaptive: the bandwidth budget alone sets levels (default: no link above "
        "what the fall of the training loss allows, AdaComm's rule in ladder rungs: rung k, "
        f"from 0 at the lowest, once {whose_loss} fell 4^k-fold from its first, so links "
        "start at the lowest level and rise as training comes to need them)",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp coordinator` and its flags."""
    coordinator = sub.add_parser(
        "coordinator",
        help="plan merged compression from the peers' measurements and publish schedules",
        formatter_class=HelpWithDefaults,
    )
    coordinator.add_argument(
        "--topology", required=True, help="topology YAML file (or shipped name)"
    )
    coordinator.add_argument(
        "--address", default="127.0.0.1:50099", help="address to listen on (HOST:PORT)"
    )
    coordinator.add_argument(
        "--registry",
        metavar="HOST:PORT",
        help="also host the peers' address registry (torch's TCPStore, listening on every "
        "interface at PORT; 0: any free one) while this coordinator runs; peers start with "
        "--rendezvous coordinator://HOST:PORT (printed) and need no addresses in the file",
    )
    add_coordinator_flags(coordinator)
    add_tls_flags(coordinator, "coordinator")


def require_adaptive(args: argparse.Namespace) -> None:
    """ValueError for a flag that changes link levels (--round-budget, --boost,
    --hold-lowest-until, --no-follow-loss) given without --adaptive: it would do nothing."""
    for flag, given in (
        ("--round-budget", args.round_budget is not None),
        ("--boost", args.boost),
        ("--hold-lowest-until", args.hold_lowest_until > 0),
        ("--no-follow-loss", not args.follow_loss),
    ):
        if given and not args.adaptive:
            raise ValueError(f"{flag}: expected --adaptive with it (it changes link levels)")


def make_coordinator(args: argparse.Namespace, topology: Topology) -> Coordinator:
    """The coordinator the flags describe; ValueError for --round-budget, --boost,
    --hold-lowest-until or --no-follow-loss without --adaptive."""
    require_adaptive(args)
    from gossipcomp.coordinator import Coordinator

    return Coordinator(
        topology,
        planner=args.planner,
        report_every=args.report_every,
        replan_every=args.replan_every,
        adaptive=args.adaptive,
        round_budget=args.round_budget,
        boost=args.boost,
        hold_lowest_until=args.hold_lowest_until,
        follow_loss=args.follow_loss,
        member_timeout=args.member_timeout,
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """Serve until interrupted (Ctrl-C: status 130) or terminated (SIGTERM: status 0)."""
    from gossipcomp.coordinator import CoordinatorServer
    from gossipcomp.transport.grpc_transport import is_loopback

    tls = tls_files(args)
    if tls is None and not args.insecure and not is_loopback(args.address):
        raise ValueError(
            f"--address {args.address}: plaintext on an address other than loopback lets anyone "
            "who reaches it pose as a peer; expected --tls-cert/--tls-key/--tls-ca, or --insecure"
        )
    topology = resolve_topology(args.topology)
    registry = _registry(args.registry) if args.registry is not None else None
    coordinator = make_coordinator(args, topology)
    if args.adaptive:
        from gossipcomp.coordinator.planning import decisions_log

        decisions_log.setLevel(logging.INFO)  # each change of link levels is news
    server = CoordinatorServer(coordinator, args.address, tls)
    # before the address is printed: a script that reads it may kill the coordinator at once
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        console.print(
            f"coordinator for {topology.name} ({topology.n} peers) at {server.address}, "
            f"planner {args.planner}; peers join with --coordinator {server.address}"
        )
        if registry is not None:
            console.print(
                f"registry: peers start with --rendezvous {registry.url}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        server.wait()
    except _Terminated:
        console.print("coordinator: terminated (SIGTERM); stopped serving")
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
        if registry is not None:
            registry.close()
    return 0


def _registry(address: str) -> Registry:
    """The address registry --registry asks for, hosted from now (torch loads only here)."""
    from gossipcomp.rendezvous import Registry

    return Registry(address)


class _Terminated(Exception):
    """SIGTERM (`kill PID`) reached a serving coordinator: a requested stop, status 0."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated
