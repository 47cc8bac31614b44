"""`gossipcomp peer`: one peer in this process, at its address in the topology (as torchrun or
a shell script starts one per machine); its rank from --rank or the RANK variable. With
--rendezvous, the addresses come from torch's store instead (gossipcomp/rendezvous.py)."""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gossipcomp.cli.common import add_tls_flags, tls_files
from gossipcomp.cli.coordinator import add_no_follow_loss, add_report_every, add_round_budget
from gossipcomp.cli.training_flags import add_training_flags
from gossipcomp.inputs.arguments import HelpWithDefaults, integer, number
from gossipcomp.inputs.text import quoted
from gossipcomp.topology import Topology
from gossipcomp.transport.base import DEFAULT_BULK_LANE_BYTES

if TYPE_CHECKING:  # the training stack and torch.distributed: loaded by a run, not by --help
    from gossipcomp.experiment.simulation import PeerLevels
    from gossipcomp.rendezvous import Launch

MAX_STARTUP_TIMEOUT = 86400.0  # seconds: waiting a day for neighbours is a typing mistake
MAX_BULK_LANE_MIB = 1024  # an envelope's whole limit (GrpcOptions.max_envelope_bytes)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp peer` and its flags."""
    peer = sub.add_parser(
        "peer",
        help="one peer in this process, at its address in the topology",
        formatter_class=HelpWithDefaults,
    )
    peer.add_argument("--topology", required=True, help="topology YAML file (or shipped name)")
    peer.add_argument(
        "--rank",
        type=integer("rank", 0),
        default=None,
        help="this peer's rank (default: the RANK environment variable, as set by torchrun; "
        "SLURM_PROCID with --rendezvous slurm)",
    )
    peer.add_argument(
        "--bind",
        metavar="HOST:PORT",
        help="address to listen on (default: the topology's address; with --rendezvous, "
        "127.0.0.1:0, or 0.0.0.0:0 with TLS or --insecure; port 0: any free port)",
    )
    peer.add_argument(
        "--rendezvous",
        metavar="URL",
        help="take every peer's address from torch's rendezvous store instead of the topology "
        "file: env:// (torchrun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), tcp://HOST:PORT "
        "(rank 0 hosts the store; RANK, WORLD_SIZE), slurm[://HOST:PORT] (SLURM_PROCID, "
        "SLURM_NTASKS; store at MASTER_ADDR:MASTER_PORT when not given) or "
        "coordinator://HOST:PORT (the store a coordinator started with --registry hosts, which "
        "outlives every peer; RANK, WORLD_SIZE); --rank and the URL's endpoint win over the "
        "environment. A live topology's launch may start fewer ranks than its capacity; a rank "
        "joins later with the URL its members print, its --rank and --join",
    )
    peer.add_argument(
        "--advertise",
        metavar="HOST",
        help="with --rendezvous: the host other peers reach this one at (default: the --bind "
        "host, or this machine's name when binding every interface)",
    )
    peer.add_argument(
        "--startup-timeout",
        type=number("startup timeout (seconds)", 0.0, MAX_STARTUP_TIMEOUT),
        default=120.0,
        help="seconds to wait for neighbours to come up before giving up",
    )
    add_tls_flags(peer, "peer")
    peer.add_argument(
        "--bulk-lane-mib",
        type=integer("bulk lane size (MiB)", 0, MAX_BULK_LANE_MIB),
        default=DEFAULT_BULK_LANE_BYTES >> 20,
        help="plaintext peers send envelopes of at least this many MiB of data on the "
        "receiver's bulk lane, a second port it listens on (any free port of its --bind host), "
        "where the kernel's copies are the only ones; 0: never, for networks where only the "
        "gRPC port can be reached. With TLS every envelope goes by gRPC",
    )
    peer.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="report measurements to the coordinator there and take its schedules (over the "
        "peer's TLS when given); without one the peer runs its static --schedule",
    )
    add_report_every(peer, "rounds between reports to the coordinator")
    peer.add_argument(
        "--join",
        action="store_true",
        help="a live topology (`members:`): this peer (re)joins a running network; it is a "
        "member once the coordinator's next schedule names it (a rank not among the initial "
        "members joins without it; a rank that may have been removed needs it)",
    )
    peer.add_argument(
        "--adaptive",
        action="store_true",
        help="bandwidth-adaptive compression without a coordinator: for each edge to a "
        "higher-ranked neighbour this peer sets the rank or level from its own sends "
        "(powergossip, choco-edge), or "
        "the level it sends at from its sends over its slowest link (choco, def), and announces "
        "it in its envelopes; start every peer with it (with a coordinator, start the "
        "coordinator with --adaptive instead)",
    )
    add_round_budget(peer, "this peer's median compute time per round")
    add_no_follow_loss(peer, "this peer's own loss (the deciding end's, for an edge)")
    peer.add_argument(
        "--key",
        type=Path,
        metavar="FILE",
        help="this peer's signing key: sign every message, accept only messages signed by the "
        "keys the topology lists (needs TLS; required when the topology lists public keys)",
    )
    add_training_flags(peer, rank_is_low_rank=False)


def run(args: argparse.Namespace, console: Console) -> int:
    """Every check first, then (with --rendezvous) every peer's address, then this peer's
    training, then its report."""
    from gossipcomp.cli.training import prepare, train_and_finish
    from gossipcomp.experiment.simulation import run_peer
    from gossipcomp.rendezvous import rendezvous_topology

    tls = tls_files(args)
    bind = _rendezvous_bind(args, tls is not None) if args.rendezvous is not None else args.bind
    if args.advertise is not None and args.rendezvous is None:
        raise ValueError("--advertise: expected --rendezvous with it (it names this peer there)")
    checked, rank = prepare(args, _peer_rank, "--low-rank")
    assert rank is not None  # prepare asked _peer_rank for it
    _check_membership(args, checked.topology)
    label = f"peer {rank}: {checked.config.algorithm} on {checked.topology.name}"
    train = partial(
        run_peer,
        rank=rank,
        startup_timeout=args.startup_timeout,
        tls=tls,
        signing_key=args.key,
        insecure=args.insecure,
        bulk_lane_bytes=args.bulk_lane_mib << 20,
        coordinator=args.coordinator,
        peer_levels=_peer_levels(args),
        joining=args.join,
    )
    total = checked.config.gossip_rounds
    if args.rendezvous is None:
        return train_and_finish(args, console, checked, partial(train, bind=bind), total, label)
    launch = _launch(args, checked.topology)
    with rendezvous_topology(
        checked.topology, launch, bind, args.advertise, args.startup_timeout, args.join
    ) as (topology, bound, addresses):
        if addresses is not None:  # live: joiners are found in the store as they come
            console.print(
                f"peer {rank}: rendezvous store at {launch.endpoint}; a rank joins with "
                f"--rendezvous {_join_scheme(launch)}://{launch.endpoint} --rank RANK --join",
                highlight=False,
                soft_wrap=True,
            )
        checked = checked._replace(topology=topology)
        train = partial(train, bind=bound, address_source=addresses)
        return train_and_finish(args, console, checked, train, total, label)


def _check_membership(args: argparse.Namespace, topology: Topology) -> None:
    """Live membership needs a coordinator: without one nobody decides who is in, and the
    membership would stay the initial one; ValueError when asked for without one."""
    if topology.live is not None and args.coordinator is None:
        raise ValueError(
            f"--topology {topology.name}: live membership (`members:`) is decided by a "
            "coordinator; expected --coordinator HOST:PORT (without one the members would stay "
            "the initial ones: use a topology file without `members:`)"
        )
    if args.join and topology.live is None:
        raise ValueError(
            f"--join: expected a live topology (a file with `members:`); {topology.name} has a "
            "fixed membership"
        )


def _peer_levels(args: argparse.Namespace) -> PeerLevels | None:
    """Link levels set by the peers themselves, without a coordinator (`--adaptive`, no
    --coordinator); ValueError for flags that contradict it."""
    for flag, given in (
        ("--round-budget", args.round_budget is not None),
        ("--no-follow-loss", not args.follow_loss),
    ):
        if given and not args.adaptive:
            raise ValueError(f"{flag}: expected --adaptive with it (it changes link levels)")
    if args.adaptive and args.coordinator:
        raise ValueError(
            "--adaptive with --coordinator: a coordinator started with --adaptive sets the "
            "levels; expected one of them (--adaptive alone: the peers set levels)"
        )
    from gossipcomp.experiment.simulation import PeerLevels

    return PeerLevels(args.round_budget, args.follow_loss) if args.adaptive else None


def _launch(args: argparse.Namespace, topology: Topology) -> Launch:
    """The launch --rendezvous describes, its values checked against the topology."""
    from gossipcomp.rendezvous import parse_launch

    return parse_launch(
        args.rendezvous, args.rank, topology.n, os.environ, topology.live is not None
    )


def _join_scheme(launch: Launch) -> str:
    """The scheme a later rank reaches this launch's store with: the coordinator's as it is,
    any other (torchrun's, SLURM's, rank 0's) as a plain tcp:// store."""
    return "coordinator" if launch.scheme == "coordinator" else "tcp"


def _rendezvous_bind(args: argparse.Namespace, secure: bool) -> str:
    """Where to listen with --rendezvous: --bind (port 0 allowed), else any free port on
    loopback, or on every interface with TLS or --insecure."""
    if args.bind is None:
        return "0.0.0.0:0" if secure or args.insecure else "127.0.0.1:0"
    host, sep, port = args.bind.rpartition(":")
    if not sep or not host or not port.isdigit() or len(port) > 5 or int(port) > 65535:
        raise ValueError(
            f"--bind {quoted(args.bind)}: expected HOST:PORT with port 0..65535 (0: any free port)"
        )
    return args.bind


def _peer_rank(args: argparse.Namespace, topology: Topology) -> int:
    """This peer's rank (--rank, or RANK from the environment; with --rendezvous, what its
    launch says), one of the topology's."""
    if args.rendezvous is not None:
        return _launch(args, topology).rank
    rank = args.rank if args.rank is not None else rank_from_env()
    if not 0 <= rank < topology.n:
        given = f"--rank {rank}" if args.rank is not None else f"RANK={rank} (environment)"
        raise ValueError(f"{given}: topology {topology.name} has ranks 0 to {topology.n - 1}")
    return rank


def rank_from_env() -> int:
    """RANK from the environment, as torchrun sets it."""
    value = os.environ.get("RANK")
    if value is None:
        raise ValueError("no --rank given and no RANK environment variable set")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"RANK environment variable must be an integer, got {quoted(value)}"
        ) from None
