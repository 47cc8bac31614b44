"""Command line: `gossipcomp simulate`, `gossipcomp peer`, `gossipcomp coordinator`,
`gossipcomp allreduce`, `gossipcomp plot`, `gossipcomp topology show`, `gossipcomp keys new`.

Argument parsing, checks that fail fast, progress display and reports only; the work happens in
simulation.py.

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
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gossipcomp.allreduce import command as allreduce_command
from gossipcomp.arguments import integer, number
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.data import DATASETS
from gossipcomp.experiment import (
    MAX_LOCAL_STEPS,
    MAX_LR,
    MAX_SEED,
    TrainConfig,
    TrainingAborted,
    TrainingDiverged,
    build_config_model,
    load_data,
)
from gossipcomp.gossip import ALGORITHMS, ATTACKS, parse_clip
from gossipcomp.gossip.powergossip import largest_useful_rank
from gossipcomp.gossip.specs import MAX_GOSSIP_STEPS, parse_options
from gossipcomp.models import MODELS
from gossipcomp.peer import LEVELS_LOGGER, MAX_ROUND_TIMEOUT, GossipStalled
from gossipcomp.plot import MAX_PIXELS, MAX_REPORTS, MIN_PIXELS, curve_of, plot_curves, plot_reports
from gossipcomp.presentation import format_topology
from gossipcomp.report import Report
from gossipcomp.schedule import PLANNERS, make_planner
from gossipcomp.security import CA_CERT_NAME, CA_KEY_NAME, TlsFiles, new_ca, new_peer_certificate
from gossipcomp.security.signing_keys import (
    public_key_text,
    record_in_allowlist,
    write_signing_key,
)
from gossipcomp.simulation import (
    MAX_WORKERS,
    CheckpointPolicy,
    PeerLevels,
    WorkerFailed,
    run_peer,
    run_simulation,
    usable_cores,
)
from gossipcomp.text import quoted
from gossipcomp.topology import Topology, load_topology
from gossipcomp.transport.base import HandshakeError, PeerUnreachableError
from gossipcomp.transport.grpc_transport import is_loopback
from gossipcomp.transport.throttled import MAX_MBIT, LinkRates, RateChange

DEFAULT_TOPOLOGY = "ring8"
MAX_STARTUP_TIMEOUT = 86400.0  # seconds: waiting a day for neighbours is a typing mistake
# bytes of the smallest round a link carries (an envelope of one rank-1 message of the digits
# MLP is ~4 KB): a slower link cannot finish even that within the round's deadline
MIN_ROUND_BYTES = 1024


def resolve_topology(spec: str) -> Topology:
    """Load a topology from a file path, or by the name of a shipped one (e.g. 'ring8')."""
    return load_topology(spec)


_consensus_number = number("consensus step", 0.0, 2.0, high_closed=False)


def _consensus_step(text: str) -> float | str:
    """'auto', or a step in (0, 2); each algorithm then checks its own limit (choco: 1)."""
    return text if text == "auto" else _consensus_number(text)


def _clip_spec(text: str) -> str:
    try:
        parse_clip(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _algorithm_spec(text: str) -> str:
    """A registered name (its options then come from the flags), or a whole spec."""
    name = text.partition(":")[0].strip()
    if name not in ALGORITHMS:
        known = ", ".join(sorted(ALGORITHMS))
        raise argparse.ArgumentTypeError(f"unknown algorithm {quoted(name)}; known: {known}")
    if ":" in text:
        try:
            parse_options(text, ALGORITHMS)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _planner_spec(text: str) -> str:
    try:
        make_planner(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _add_tls_flags(parser: argparse.ArgumentParser, who: str) -> None:
    tls = parser.add_argument_group(
        "mutual TLS", "all three, or none for plaintext; make them with `gossipcomp keys new`"
    )
    tls.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help=f"this {who}'s certificate (PEM)"
    )
    tls.add_argument("--tls-key", type=Path, metavar="FILE", help=f"this {who}'s private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, metavar="FILE", help="the network's CA certificate")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext on an address other than loopback. Without TLS anyone who reaches "
        "the port is trusted: any process that can connect can pose as a peer. Only for a "
        "network no one else can reach; otherwise use --tls-*",
    )


def _workers(text: str) -> str | int:
    return text if text == "auto" else integer("worker processes", 1, MAX_WORKERS)(text)


def _worker_count(workers: str | int, peers: int, authenticate: bool) -> int:
    """`--workers`, with auto resolved: a process per usable core while each gets at least
    four peers (fewer peers gain less than a process costs to start), and one when messages
    are signed (the throwaway keys live in one process)."""
    if workers != "auto":
        return int(workers)
    if authenticate:
        return 1
    return max(1, min(usable_cores(), peers // 4, MAX_WORKERS))


def _link_change(text: str) -> RateChange:
    try:
        return RateChange.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_coordinator_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--planner",
        type=_planner_spec,
        default="mergecomp",
        help=f"the coordinator's planner: {', '.join(sorted(PLANNERS))}",
    )
    group.add_argument(
        "--report-every",
        type=integer("report interval (rounds)", 1, 10**6),
        default=10,
        help="rounds between each peer's reports to the coordinator",
    )
    group.add_argument(
        "--replan-every",
        type=integer("replanning interval (rounds)", 1, 10**6),
        default=200,
        help="rounds between the coordinator's plans (it publishes only a plan that differs)",
    )
    group.add_argument(
        "--adaptive",
        action="store_true",
        help="bandwidth-adaptive compression (powergossip: a rank per link; choco, def: a "
        "level of the compressor's ladder per peer, its slowest link's): measure every link "
        "from the transfers training makes and set its level to the highest whose transfers "
        "fit the round budget; peers should report every round or two (--report-every)",
    )
    group.add_argument(
        "--round-budget",
        type=number("round budget (seconds)", 0.0, 86_400.0),
        metavar="SECONDS",
        help="with --adaptive: seconds a round's transfers over one link may take (default: "
        "the slowest peer's measured compute time per round, so communication hides behind it)",
    )
    group.add_argument(
        "--boost",
        action="store_true",
        help="with --adaptive: a peer in a critical learning phase (a layer's gradient norm "
        "changed by half or more between windows of 10 rounds: Accordion) gets its links one "
        "level higher while it lasts",
    )


def _add_training_flags(parser: argparse.ArgumentParser, rank_is_low_rank: bool) -> None:
    """Training flags shared by simulate and peer. `--low-rank` is PowerGossip's rank; simulate
    also takes it as `--rank`, which for `peer` is the peer's own rank."""
    d = TrainConfig()
    g = parser.add_argument_group("training")
    g.add_argument(
        "--algorithm",
        default=d.algorithm,
        type=_algorithm_spec,
        help=f"gossip algorithm: {', '.join(sorted(ALGORITHMS))}, or a whole spec such as "
        "choco:compressor=sign,steps=4,gamma=0.7 (whose options then come from it, not from "
        "the flags below)",
    )
    g.add_argument(
        "--dataset",
        default=d.dataset,
        choices=sorted(DATASETS),
        help="bundled scikit-learn data: digits (8x8 images, 10 classes), wine (13 features, 3 "
        "classes), breast-cancer (30, 2), iris (4, 3); tabular features standardised",
    )
    g.add_argument(
        "--model",
        default=d.model,
        choices=sorted(MODELS),
        help="mlp (two hidden layers of 256), wide-mlp (two of 1024: 1.1M parameters), resmlp (24 residual blocks with LayerNorm, 102 "
        "tensors), cnn (digits only: two convolutions with BatchNorm); sized for the dataset",
    )
    g.add_argument(
        "--schedule",
        type=_planner_spec,
        default=d.schedule,
        help="choco, def, powergossip: how parameters are merged into groups: per-tensor, "
        f"single, or a planner ({', '.join(sorted(PLANNERS))}) run on a reference cost model, "
        "the same plan on every peer",
    )
    g.add_argument(
        "--rounds",
        type=integer("rounds", 1),
        default=d.rounds,
        help="local steps; a gossip round follows every --local-steps of them",
    )
    g.add_argument(
        "--lr", type=number("learning rate", 0.0, MAX_LR), default=d.lr, help="SGD learning rate"
    )
    g.add_argument(
        "--momentum",
        type=number("momentum", 0.0, 1.0, low_closed=True, high_closed=False),
        default=d.momentum,
        help="SGD momentum (per peer), in [0, 1)",
    )
    g.add_argument(
        "--batch-size",
        type=integer("batch size", 1),
        default=d.batch_size,
        help="examples per local step",
    )
    g.add_argument(
        "--partition",
        default=d.partition,
        help="how the training data is split: iid | by-label | dirichlet:ALPHA",
    )
    g.add_argument(
        "--seed",
        type=integer("seed", 0, MAX_SEED),
        default=d.seed,
        help="seed of data split, model and batches",
    )
    g.add_argument(
        "--consensus-step",
        type=_consensus_step,
        default=d.consensus_step,
        help="dpsgd, powergossip, choco: gossip step gamma in x += gamma (W x - x), in (0, 2) "
        "(choco: (0, 1]); 'auto' (the default for dpsgd and powergossip) = 2/(2 - lambda_2 - "
        "lambda_min) of W; choco's default depends on the compressor",
    )
    g.add_argument(
        "--low-rank",
        *(["--rank"] if rank_is_low_rank else []),
        dest="low_rank",
        type=integer("powergossip rank", 1),
        default=d.rank,
        help="powergossip: rank of the power iteration (each matrix uses at most its short side)"
        + (" (--rank is the same flag here)" if rank_is_low_rank else ""),
    )
    g.add_argument(
        "--compressor",
        default=d.compressor,
        help="choco, def: compressor spec, e.g. sign, topk:ratio=0.01, qsgd:levels=16, ef+sign",
    )
    g.add_argument(
        "--zeta",
        type=number("zeta", 0.0, 1.0),
        default=d.zeta,
        help="def: damping of the differential update (default: per compressor)",
    )
    g.add_argument(
        "--gamma",
        type=number("gamma", 0.0, 1.0),
        default=d.gamma,
        help="def: mixing weight of the combine step (default: per compressor)",
    )
    g.add_argument(
        "--gossip-steps",
        "--power-steps",
        dest="gossip_steps",
        type=integer("gossip steps", 1, MAX_GOSSIP_STEPS),
        default=d.gossip_steps,
        help="powergossip, choco: exchanges per round (PowerGossip's power steps)",
    )
    g.add_argument(
        "--eval-every",
        type=integer("eval every", 0),
        default=d.eval_every,
        help="rounds between accuracy checkpoints (0: only at the end)",
    )
    g.add_argument(
        "--round-timeout",
        type=number("round timeout (seconds)", 0.0, MAX_ROUND_TIMEOUT),
        default=d.round_timeout,
        help="seconds a round waits for neighbours before leaving them out",
    )
    g.add_argument(
        "--local-steps",
        type=integer("local steps", 1, MAX_LOCAL_STEPS),
        default=d.local_steps,
        help="local optimizer steps between gossip rounds (local SGD): H sends 1/H of the "
        "bytes of 1 over the same --rounds",
    )
    g.add_argument(
        "--max-failed-rounds",
        type=integer("max failed rounds", 0),
        default=d.max_failed_rounds,
        help="stop with an error (exit status 1) when a peer has heard no neighbour for this "
        "many rounds in a row, training alone (0: never stop; a warning comes after 3)",
    )
    g.add_argument(
        "--no-gossip-buffers",
        dest="gossip_buffers",
        action="store_false",
        help="keep each peer's own floating-point buffers (BatchNorm running statistics) "
        "instead of gossiping them with the parameters",
    )
    r = parser.add_argument_group("robustness")
    r.add_argument(
        "--clip",
        type=_clip_spec,
        default=d.clip,
        metavar="SPEC",
        help="clipped gossip: each neighbour's difference clipped to a radius before mixing; "
        "'adaptive' (robust to 1 lying neighbour), 'adaptive:B' (to B), or a fixed radius",
    )
    r.add_argument(
        "--byzantine",
        type=integer("byzantine rank", 0),
        nargs="+",
        default=list(d.byzantine),
        metavar="RANK",
        help="ranks that lie: they gossip an attacked model and train honestly on their own",
    )
    r.add_argument(
        "--attack", default=d.attack, choices=sorted(ATTACKS), help="what Byzantine ranks send"
    )
    r.add_argument(
        "--attack-scale",
        type=number("attack scale", 0.0),
        default=d.attack_scale,
        help="sign_flip sends -X times the model, scale sends X times it",
    )
    c = parser.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="write checkpoints here (one set per peer) and resume from the newest valid one; "
        "in `peer`, {rank} in the path is replaced by the peer's rank",
    )
    c.add_argument(
        "--checkpoint-every",
        type=integer("checkpoint every", 1),
        default=None,
        help="rounds between checkpoints (default 50 when --checkpoint-dir is given)",
    )
    c.add_argument(
        "--checkpoint-keep",
        type=integer("checkpoint keep", 1),
        default=3,
        help="newest checkpoints kept per peer",
    )
    parser.add_argument(
        "--report",
        type=Path,
        help="write the JSON report here (its folder is made and tried before training); in "
        "`peer`, {rank} in the path is replaced by the peer's rank (torchrun launches)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table")


def _checkpoints(args: argparse.Namespace) -> CheckpointPolicy | None:
    if args.checkpoint_dir is None:
        if args.checkpoint_every is not None:
            raise ValueError("--checkpoint-every needs --checkpoint-dir")
        return None
    every = 50 if args.checkpoint_every is None else args.checkpoint_every
    return CheckpointPolicy(args.checkpoint_dir, every=every, keep=args.checkpoint_keep)


_TLS_FLAGS = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_ca": "--tls-ca"}


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The peer's TLS files: all three flags, or none of them (plaintext)."""
    given = {name: getattr(args, name) for name in _TLS_FLAGS}
    missing = [flag for name, flag in _TLS_FLAGS.items() if given[name] is None]
    if len(missing) == len(_TLS_FLAGS):
        return None
    if missing:
        raise ValueError(
            f"TLS needs all of --tls-cert, --tls-key and --tls-ca (or none, for plaintext): "
            f"missing {', '.join(missing)}"
        )
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _keys_new(args: argparse.Namespace, console: Console) -> None:
    """Write a CA (with --ca), a peer certificate signed by the CA in --out and the peer's
    signing key pair (with --rank, its public half recorded in --out's allowlist)."""
    out: Path = args.out
    name = args.name or (f"peer{args.rank}" if args.rank is not None else "peer")
    ca_cert, ca_key = out / CA_CERT_NAME, out / CA_KEY_NAME
    if args.ca:
        new_ca(out)
        console.print(f"wrote {ca_cert} (CA certificate: give it to every peer as --tls-ca)")
        console.print(f"wrote {ca_key} (CA private key: keep it private, only to sign peers)")
    else:
        absent = [str(p) for p in (ca_cert, ca_key) if not p.is_file()]
        if absent:
            raise ValueError(
                f"no CA in {out}: {' and '.join(absent)} not found (expected a CA made by "
                f"`gossipcomp keys new --out {out} --ca`)"
            )
    signing_path = out / f"{name}-signing-key.pem"
    if signing_path.exists():  # before writing anything, so nothing is left half made
        raise FileExistsError(
            f"{signing_path} already exists: refusing to overwrite a signing key (expected a "
            f"new --name)"
        )
    files = new_peer_certificate(out, name, args.address or (), ca_cert, ca_key)
    console.print(f"wrote {files.cert} (certificate of {name}: --tls-cert)")
    console.print(f"wrote {files.key} (private key of {name}: --tls-key, mode 0600)")
    signing = write_signing_key(signing_path)
    console.print(f"wrote {signing_path} (signing key of {name}: --key, mode 0600)")
    if args.rank is not None:
        allowlist = record_in_allowlist(out, args.rank, signing)
        console.print(f"recorded peer {args.rank}'s public key in {allowlist} (allowlist: FILE)")
    console.print(f"public key of {name}: {public_key_text(signing)}")


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        algorithm=args.algorithm,
        model=args.model,
        dataset=args.dataset,
        schedule=args.schedule,
        rounds=args.rounds,
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch_size,
        partition=args.partition,
        seed=args.seed,
        consensus_step=args.consensus_step,
        rank=args.low_rank,
        gossip_steps=args.gossip_steps,
        compressor=args.compressor,
        zeta=args.zeta,
        gamma=args.gamma,
        eval_every=args.eval_every,
        round_timeout=args.round_timeout,
        clip=args.clip,
        byzantine=tuple(args.byzantine),
        attack=args.attack,
        attack_scale=args.attack_scale,
        gossip_buffers=args.gossip_buffers,
        local_steps=args.local_steps,
        max_failed_rounds=args.max_failed_rounds,
    )


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' where there is a value to show; None and flags say it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        flag = action.nargs == 0  # takes no value (store_true/false): its help says what it does
        if flag or action.default is None or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (the flag, what is wrong, what was expected) and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gossipcomp",
        description="Communication-efficient decentralized training over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate",
        formatter_class=_HelpWithDefaults,
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
        "the schedules it plans (choco, def)",
    )
    _add_coordinator_flags(coord)
    coord.add_argument(
        "--no-coordinator",
        action="store_true",
        help="with --adaptive: no coordinator; the lower-ranked end of each edge sets the "
        "edge's rank from its own sends (powergossip), each peer the level it sends at from its "
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
    _add_training_flags(sim, rank_is_low_rank=True)

    peer = sub.add_parser(
        "peer",
        help="one peer in this process, at its address in the topology",
        formatter_class=_HelpWithDefaults,
    )
    peer.add_argument("--topology", required=True, help="topology YAML file (or shipped name)")
    peer.add_argument(
        "--rank",
        type=integer("rank", 0),
        default=None,
        help="this peer's rank (default: the RANK environment variable, as set by torchrun)",
    )
    peer.add_argument("--bind", help="address to listen on (default: the topology's address)")
    peer.add_argument(
        "--startup-timeout",
        type=number("startup timeout (seconds)", 0.0, MAX_STARTUP_TIMEOUT),
        default=120.0,
        help="seconds to wait for neighbours to come up before giving up",
    )
    _add_tls_flags(peer, "peer")
    peer.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="report measurements to the coordinator there and take its schedules (over the "
        "peer's TLS when given); without one the peer runs its static --schedule",
    )
    peer.add_argument(
        "--report-every",
        type=integer("report interval (rounds)", 1, 10**6),
        default=10,
        help="rounds between reports to the coordinator",
    )
    peer.add_argument(
        "--adaptive",
        action="store_true",
        help="bandwidth-adaptive compression without a coordinator: for each edge to a "
        "higher-ranked neighbour this peer sets the rank from its own sends (powergossip), or "
        "the level it sends at from its sends over its slowest link (choco, def), and announces "
        "it in its envelopes; start every peer with it (with a coordinator, start the "
        "coordinator with --adaptive instead)",
    )
    peer.add_argument(
        "--round-budget",
        type=number("round budget (seconds)", 0.0, 86_400.0),
        metavar="SECONDS",
        help="with --adaptive: seconds a round's transfers over one link may take (default: this "
        "peer's median compute time per round)",
    )
    peer.add_argument(
        "--key",
        type=Path,
        metavar="FILE",
        help="this peer's signing key: sign every message, accept only messages signed by the "
        "keys the topology lists (needs TLS; required when the topology lists public keys)",
    )
    _add_training_flags(peer, rank_is_low_rank=False)

    coordinator = sub.add_parser(
        "coordinator",
        help="plan merged compression from the peers' measurements and publish schedules",
        formatter_class=_HelpWithDefaults,
    )
    coordinator.add_argument(
        "--topology", required=True, help="topology YAML file (or shipped name)"
    )
    coordinator.add_argument(
        "--address", default="127.0.0.1:50099", help="address to listen on (HOST:PORT)"
    )
    _add_coordinator_flags(coordinator)
    _add_tls_flags(coordinator, "coordinator")

    allreduce = sub.add_parser(
        "allreduce",
        help="data-parallel training on torch.distributed with compressed all-reduce",
        formatter_class=_HelpWithDefaults,
    )
    allreduce_command.add_arguments(allreduce)

    plot = sub.add_parser(
        "plot",
        formatter_class=_HelpWithDefaults,
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

    topo = sub.add_parser("topology", help="inspect topology files")
    topo_sub = topo.add_subparsers(dest="topology_command", required=True)
    show = topo_sub.add_parser("show", help="peers, degrees, spectral gap and mixing weights")
    show.add_argument("file", help="topology YAML file (or shipped name)")

    keys = sub.add_parser("keys", help="certificates for mutual TLS and keys for signing")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    new = keys_sub.add_parser(
        "new",
        formatter_class=_HelpWithDefaults,
        help="a peer's certificate signed by the CA in --out (with --ca: make that CA first) "
        "and its signing key pair",
    )
    new.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory of the CA")
    new.add_argument(
        "--ca", action="store_true", help="create a new CA in DIR first (never overwrites one)"
    )
    new.add_argument(
        "--name",
        help="file name stem: writes NAME.pem, NAME-key.pem and NAME-signing-key.pem "
        "(default: peerRANK with --rank, else peer)",
    )
    new.add_argument(
        "--rank",
        type=integer("rank", 0),
        help="the peer's rank: record its public key in DIR/allowlist.yaml, which a topology "
        "names with 'allowlist:'",
    )
    new.add_argument(
        "--address",
        action="extend",
        nargs="+",
        metavar="HOST",
        help="hosts neighbours reach this peer at (localhost and 127.0.0.1 always included)",
    )
    return parser


class _ProgressDisplay:
    """A rich progress bar over rounds x peers, or nothing when quiet."""

    def __init__(self, console: Console, total: int, label: str, quiet: bool) -> None:
        self._progress = (
            None
            if quiet
            else Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
        )
        self._task = self._progress.add_task(label, total=total) if self._progress else None

    def __enter__(self) -> _ProgressDisplay:
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress:
            self._progress.stop()

    def advance(self, rank: int, round: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)


def _finish(report: Report, args: argparse.Namespace, console: Console) -> None:
    if not args.quiet:
        console.print(report.summary_table())
    if args.report:
        report.write_json(args.report)
        if not args.quiet:
            console.print(f"report written to {args.report}")
    if getattr(args, "plot", None) is not None:
        plot_curves([curve_of(report)], args.plot)
        if not args.quiet:
            console.print(f"plot written to {args.plot}")


def _check_plot_path(path: Path, flag: str) -> None:
    """A PNG path whose folder can be written (made if needed), before anything runs."""
    if path.suffix.lower() != ".png":
        raise ValueError(f"{flag} {quoted(str(path))}: expected a file name ending in .png")
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; expected a file path")
    _writable_directory(path.parent, f"{flag} {path}")


def _writable_directory(directory: Path, what: str) -> None:
    """Make `directory` (and its parents) if needed, then create and remove a file in it: the
    only sure test that files can be written there (permissions, read-only mounts, a file or
    /dev/null where a directory should be)."""
    expected = "expected a writable directory, or a path where one can be made"
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{what}: {directory} is not a directory; {expected}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"{what}: cannot make directory {directory} ({error.strerror or error}); {expected}"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".gossipcomp-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(
            f"{what}: cannot write a file in {directory} ({error.strerror or error}); {expected}"
        ) from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Before training: the report and the checkpoints can be written where asked, so a run
    never ends by losing its results to a bad path."""
    if args.report is not None:
        if args.report.is_dir():
            raise ValueError(f"--report {args.report}: is a directory; expected a file path")
        _writable_directory(args.report.parent, f"--report {args.report}")
    if args.checkpoint_dir is not None:
        _writable_directory(args.checkpoint_dir, f"--checkpoint-dir {args.checkpoint_dir}")


RANK_FIELD = "{rank}"  # in --report and --checkpoint-dir of `peer`: replaced by the peer's rank


def _fill_rank_in_paths(args: argparse.Namespace, rank: int | None) -> None:
    """Replace `{rank}` in --report and --checkpoint-dir by this peer's rank, so that peers
    launched with one command line (torchrun) write their own files. `simulate` writes one
    report for every peer and keeps checkpoints per peer already: `{rank}` there is refused."""
    _refuse_one_report_for_all_ranks(args, rank)
    for name, flag in (("report", "--report"), ("checkpoint_dir", "--checkpoint-dir")):
        path: Path | None = getattr(args, name)
        if path is None or RANK_FIELD not in str(path):
            continue
        if rank is None:
            raise ValueError(
                f"{flag} {quoted(str(path))}: {RANK_FIELD} names one peer's file, and simulate "
                "runs every peer in one process (one report, checkpoints already per peer); "
                f"expected a path without {RANK_FIELD}"
            )
        setattr(args, name, Path(str(path).replace(RANK_FIELD, str(rank))))


def _refuse_one_report_for_all_ranks(args: argparse.Namespace, rank: int | None) -> None:
    """A launcher (torchrun) gives every peer one command line, its rank in RANK and the job's
    size in WORLD_SIZE: a --report without {rank} would be written by every peer in turn, and
    only the last one kept. Refused before anything starts."""
    world = os.environ.get("WORLD_SIZE", "")
    path: Path | None = args.report
    if rank is None or args.rank is not None or path is None or RANK_FIELD in str(path):
        return
    if not (world.isdigit() and len(world) <= 9 and int(world) > 1):
        return
    example = path.with_name(f"{path.stem}{RANK_FIELD}{path.suffix}")
    raise ValueError(
        f"--report {quoted(str(path))}: the {world} peers of this launch (RANK from the "
        f"environment) would each write this one file, keeping only the last; put {RANK_FIELD} "
        f"in the file name, e.g. {quoted(example.name)}"
    )


def _check_low_rank(config: TrainConfig, flag: str) -> None:
    """Refuse a PowerGossip rank above what any matrix of the model can use. Each matrix caps
    the rank at its short side, where one power step already averages it exactly, so a larger
    rank changes nothing and is a typing mistake (--rank 100000 ran as 256)."""
    if config.algorithm_name != "powergossip":
        return
    limit = largest_useful_rank(build_config_model(config, load_data(config)).parameters())
    rank = config.algorithm_options()["rank"]
    if rank > limit:
        raise ValueError(
            f"{flag} {rank}: no weight matrix of the model can use a rank above {limit} "
            f"(its longest short side; at that rank a power step averages the matrix exactly); "
            f"expected 1 to {limit}"
        )


def _peer_rank(args: argparse.Namespace, topology: Topology) -> int:
    """This peer's rank (--rank, or RANK from the environment), one of the topology's."""
    rank = args.rank if args.rank is not None else _rank_from_env()
    if not 0 <= rank < topology.n:
        given = f"--rank {rank}" if args.rank is not None else f"RANK={rank} (environment)"
        raise ValueError(f"{given}: topology {topology.name} has ranks 0 to {topology.n - 1}")
    return rank


def _error(prog: str, message: object) -> None:
    """One line on stderr, as argparse writes its own errors."""
    text = " ".join(str(message).split())  # a message with line breaks still takes one line
    sys.stderr.write(f"{prog}: error: {text}\n")


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
        _error(prog, error)  # ValueError covers TopologyError and CheckpointError
        return 2
    except (TrainingDiverged, TrainingAborted, GossipStalled, WorkerFailed) as error:
        _error(prog, error)
        return 1
    except KeyboardInterrupt:
        _error(prog, "interrupted")
        return 130
    except Exception as error:  # a bug: say so, with the traceback needed to fix it
        traceback.print_exc()
        _error(
            prog,
            f"internal error ({type(error).__name__}: {error}); this is a bug in gossipcomp, "
            "please report it with the traceback above",
        )
        return 1


def _run(args: argparse.Namespace, console: Console) -> int:
    """The command, after parsing: every check first, then training, then the report."""
    if args.command == "topology":
        Console().print(format_topology(resolve_topology(args.file)))
        return 0
    if args.command == "keys":
        _keys_new(args, Console(highlight=False))
        return 0
    if args.command == "coordinator":
        return _serve_coordinator(args, console)
    if args.command == "allreduce":
        return allreduce_command.run(args)
    if args.command == "plot":
        if len(args.reports) > MAX_REPORTS:
            raise ValueError(f"{len(args.reports)} reports: expected at most {MAX_REPORTS}")
        _check_plot_path(args.out, "--out")
        plot_reports(args.reports, args.out, args.width, args.height, args.label)
        console.print(f"plot written to {args.out}")
        return 0
    tls = _tls_files(args) if args.command == "peer" else None
    config = _config(args)
    topology = resolve_topology(args.topology)
    rank = _peer_rank(args, topology) if args.command == "peer" else None
    _fill_rank_in_paths(args, rank)
    checkpoints = _checkpoints(args)
    _check_low_rank(config, "--rank" if args.command == "simulate" else "--low-rank")
    if getattr(args, "plot", None) is not None:
        _check_plot_path(args.plot, "--plot")
    _check_outputs(args)  # last: it makes directories, which no other mistake should leave
    torch.set_num_threads(1)  # many small peers share the cores; intra-op threads only contend
    peer_levels = _peer_levels(args)
    if rank is None:
        label = f"{config.algorithm} on {topology.name}"
        with _ProgressDisplay(console, config.gossip_rounds * topology.n, label, args.quiet) as bar:
            report = run_simulation(
                config,
                topology,
                progress=bar.advance,
                checkpoints=checkpoints,
                tls=args.tls,
                authenticate=args.authenticate,
                workers=_worker_count(args.workers, topology.n, args.authenticate),
                coordinator=(
                    _coordinator(args, topology)
                    if (args.coordinator or args.adaptive) and peer_levels is None
                    else None
                ),
                report_every=args.report_every,
                link_rates=_link_rates(args, topology),
                peer_levels=peer_levels,
            )
    else:
        label = f"peer {rank}: {config.algorithm} on {topology.name}"
        with _ProgressDisplay(console, config.gossip_rounds, label, args.quiet) as bar:
            report = run_peer(
                config,
                topology,
                rank,
                bind=args.bind,
                progress=bar.advance,
                startup_timeout=args.startup_timeout,
                checkpoints=checkpoints,
                tls=tls,
                signing_key=args.key,
                insecure=args.insecure,
                coordinator=args.coordinator,
                report_every=args.report_every,
                peer_levels=peer_levels,
            )
    _finish(report, args, console)
    return 0


def _coordinator(args: argparse.Namespace, topology: Topology) -> Coordinator:
    for flag, given in (("--round-budget", args.round_budget is not None), ("--boost", args.boost)):
        if given and not args.adaptive:
            raise ValueError(f"{flag}: expected --adaptive with it (it changes link levels)")
    return Coordinator(
        topology,
        planner=args.planner,
        report_every=args.report_every,
        replan_every=args.replan_every,
        adaptive=args.adaptive,
        round_budget=args.round_budget,
        boost=args.boost,
    )


def _peer_levels(args: argparse.Namespace) -> PeerLevels | None:
    """Link levels set by the peers themselves, without a coordinator: `peer --adaptive` (no
    --coordinator) or `simulate --adaptive --no-coordinator`; ValueError for flags that
    contradict it."""
    if args.command == "peer":
        if args.round_budget is not None and not args.adaptive:
            raise ValueError("--round-budget: expected --adaptive with it (it changes link levels)")
        if args.adaptive and args.coordinator:
            raise ValueError(
                "--adaptive with --coordinator: a coordinator started with --adaptive sets the "
                "levels; expected one of them (--adaptive alone: the peers set levels)"
            )
        return PeerLevels(args.round_budget) if args.adaptive else None
    if not args.no_coordinator:
        return None
    if not args.adaptive:
        raise ValueError(
            "--no-coordinator: expected --adaptive with it (the peers set link levels)"
        )
    for flag, given in (("--coordinator", args.coordinator), ("--boost", args.boost)):
        if given:
            raise ValueError(
                f"--no-coordinator with {flag}: {flag} works through a coordinator; expected one of them"
            )
    return PeerLevels(args.round_budget)


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


def _serve_coordinator(args: argparse.Namespace, console: Console) -> int:
    """Serve until interrupted (Ctrl-C: status 130) or terminated (SIGTERM: status 0)."""
    tls = _tls_files(args)
    if tls is None and not args.insecure and not is_loopback(args.address):
        raise ValueError(
            f"--address {args.address}: plaintext on an address other than loopback lets anyone "
            "who reaches it pose as a peer; expected --tls-cert/--tls-key/--tls-ca, or --insecure"
        )
    topology = resolve_topology(args.topology)
    server = CoordinatorServer(_coordinator(args, topology), args.address, tls)
    console.print(
        f"coordinator for {topology.name} ({topology.n} peers) at {server.address}, "
        f"planner {args.planner}; peers join with --coordinator {server.address}"
    )
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.wait()
    except _Terminated:
        console.print("coordinator: terminated (SIGTERM); stopped serving")
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    return 0


class _Terminated(Exception):
    """SIGTERM (`kill PID`) reached a serving coordinator: a requested stop, status 0."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _rank_from_env() -> int:
    value = os.environ.get("RANK")
    if value is None:
        raise ValueError("no --rank given and no RANK environment variable set")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"RANK environment variable must be an integer, got {quoted(value)}"
        ) from None


if __name__ == "__main__":
    sys.exit(main())
