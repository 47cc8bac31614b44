"""Command line: `gossipcomp simulate`, `gossipcomp peer`, `gossipcomp topology show`,
`gossipcomp keys new`.

Argument parsing, progress display and reports only; the work happens in simulation.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gossipcomp.experiment import TrainConfig
from gossipcomp.gossip import ALGORITHMS, ATTACKS, parse_clip
from gossipcomp.report import Report
from gossipcomp.security import CA_CERT_NAME, CA_KEY_NAME, TlsFiles, new_ca, new_peer_certificate
from gossipcomp.security.signing_keys import (
    public_key_text,
    record_in_allowlist,
    write_signing_key,
)
from gossipcomp.simulation import CheckpointPolicy, run_peer, run_simulation
from gossipcomp.topology import Topology, TopologyError, format_topology, load_topology
from gossipcomp.transport.base import HandshakeError, PeerUnreachableError

DEFAULT_TOPOLOGY = "ring8"


def resolve_topology(spec: str) -> Topology:
    """Load a topology from a file path, or by the name of a shipped one (e.g. 'ring8')."""
    path = Path(spec)
    if path.exists():
        return load_topology(path)
    shipped = resources.files("gossipcomp.topologies").joinpath(f"{spec}.yaml")
    if shipped.is_file():
        with resources.as_file(shipped) as shipped_path:
            return load_topology(shipped_path)
    names = sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("gossipcomp.topologies").iterdir()
        if p.name.endswith(".yaml")
    )
    raise TopologyError(f"{spec}: no such file, and not a shipped topology (shipped: {names})")


def _consensus_step(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def _clip_spec(text: str) -> str:
    try:
        parse_clip(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _add_training_flags(parser: argparse.ArgumentParser, rank_is_low_rank: bool) -> None:
    """Training flags shared by simulate and peer. `--low-rank` is PowerGossip's rank; simulate
    also takes it as `--rank`, which for `peer` is the peer's own rank."""
    d = TrainConfig()
    g = parser.add_argument_group("training")
    g.add_argument(
        "--algorithm", default=d.algorithm, choices=sorted(ALGORITHMS), help="gossip algorithm"
    )
    g.add_argument(
        "--rounds", type=int, default=d.rounds, help="local steps, each then a gossip round"
    )
    g.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate")
    g.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum (per peer)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="examples per local step")
    g.add_argument(
        "--partition",
        default=d.partition,
        help="how the training data is split: iid | by-label | dirichlet:ALPHA",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed of data split, model and batches")
    g.add_argument(
        "--consensus-step",
        type=_consensus_step,
        default=d.consensus_step,
        help="dpsgd, powergossip, choco: gossip step gamma in x += gamma (W x - x); 'auto' (the "
        "default for dpsgd and powergossip) = 2/(2 - lambda_2 - lambda_min) of W; choco's "
        "default depends on the compressor",
    )
    g.add_argument(
        "--low-rank",
        *(["--rank"] if rank_is_low_rank else []),
        dest="low_rank",
        type=int,
        default=d.rank,
        help="powergossip: rank of the power iteration"
        + (" (--rank is the same flag here)" if rank_is_low_rank else ""),
    )
    g.add_argument(
        "--compressor",
        default=d.compressor,
        help="choco, def: compressor spec, e.g. sign, topk:ratio=0.01, qsgd:levels=16, ef+sign",
    )
    g.add_argument(
        "--zeta",
        type=float,
        default=d.zeta,
        help="def: damping of the differential update (default: per compressor)",
    )
    g.add_argument(
        "--gamma",
        type=float,
        default=d.gamma,
        help="def: mixing weight of the combine step (default: per compressor)",
    )
    g.add_argument(
        "--gossip-steps",
        "--power-steps",
        dest="gossip_steps",
        type=int,
        default=d.gossip_steps,
        help="powergossip, choco: exchanges per round (PowerGossip's power steps)",
    )
    g.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="rounds between accuracy checkpoints"
    )
    g.add_argument(
        "--round-timeout",
        type=float,
        default=d.round_timeout,
        help="seconds a round waits for neighbours before leaving them out",
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
        type=int,
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
        type=float,
        default=d.attack_scale,
        help="sign_flip sends -X times the model, scale sends X times it",
    )
    c = parser.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="write checkpoints here (one set per peer) and resume from the newest valid one",
    )
    c.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="rounds between checkpoints (default 50 when --checkpoint-dir is given)",
    )
    c.add_argument(
        "--checkpoint-keep", type=int, default=3, help="newest checkpoints kept per peer"
    )
    parser.add_argument("--report", type=Path, help="write the JSON report here")
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
    if args.rank is not None and args.rank < 0:
        raise ValueError(f"--rank must be >= 0, got {args.rank}")
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
    )


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' where there is a value to show; None and flags say it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    _add_training_flags(sim, rank_is_low_rank=True)

    peer = sub.add_parser(
        "peer",
        help="one peer in this process, at its address in the topology",
        formatter_class=_HelpWithDefaults,
    )
    peer.add_argument("--topology", required=True, help="topology YAML file (or shipped name)")
    peer.add_argument(
        "--rank",
        type=int,
        default=None,
        help="this peer's rank (default: the RANK environment variable, as set by torchrun)",
    )
    peer.add_argument("--bind", help="address to listen on (default: the topology's address)")
    peer.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for neighbours to come up before giving up",
    )
    tls = peer.add_argument_group(
        "mutual TLS", "all three, or none for plaintext; make them with `gossipcomp keys new`"
    )
    tls.add_argument("--tls-cert", type=Path, metavar="FILE", help="this peer's certificate (PEM)")
    tls.add_argument("--tls-key", type=Path, metavar="FILE", help="this peer's private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, metavar="FILE", help="the network's CA certificate")
    peer.add_argument(
        "--key",
        type=Path,
        metavar="FILE",
        help="this peer's signing key: sign every message, accept only messages signed by the "
        "keys the topology lists (needs TLS; required when the topology lists public keys)",
    )
    _add_training_flags(peer, rank_is_low_rank=False)

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
        type=int,
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    handler = RichHandler(console=console, show_path=False)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[handler])
    try:
        if args.command == "topology":
            Console().print(format_topology(resolve_topology(args.file)))
            return 0
        if args.command == "keys":
            _keys_new(args, Console(highlight=False))
            return 0
        tls = _tls_files(args) if args.command == "peer" else None
        config = _config(args)
        checkpoints = _checkpoints(args)
        topology = resolve_topology(args.topology)
        torch.set_num_threads(1)  # many small peers share the cores; intra-op threads only contend
        if args.command == "simulate":
            label = f"{config.algorithm} on {topology.name}"
            with _ProgressDisplay(console, config.rounds * topology.n, label, args.quiet) as bar:
                report = run_simulation(
                    config,
                    topology,
                    progress=bar.advance,
                    checkpoints=checkpoints,
                    tls=args.tls,
                    authenticate=args.authenticate,
                )
        else:
            rank = args.rank if args.rank is not None else _rank_from_env()
            label = f"peer {rank}: {config.algorithm} on {topology.name}"
            with _ProgressDisplay(console, config.rounds, label, args.quiet) as bar:
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
                )
        _finish(report, args, console)
        return 0
    except (
        TopologyError,
        ValueError,
        FileNotFoundError,
        FileExistsError,
        HandshakeError,
        PeerUnreachableError,
    ) as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2
    except RuntimeError as error:  # training failed (diverged, a peer crashed): no traceback
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return 1


def _rank_from_env() -> int:
    value = os.environ.get("RANK")
    if value is None:
        raise ValueError("no --rank given and no RANK environment variable set")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"RANK environment variable must be an integer, got {value!r}") from None


if __name__ == "__main__":
    sys.exit(main())
