"""What several commands check alike: topologies by name or file, planner specs, the mutual TLS
flags, and that the files a run will write can be written (tried before any work starts)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from gossipcomp.inputs.arguments import accepted
from gossipcomp.inputs.text import quoted
from gossipcomp.security import TlsFiles
from gossipcomp.topology import Topology, load_topology


def resolve_topology(spec: str) -> Topology:
    """Load a topology from a file path, or by the name of a shipped one (e.g. 'ring8')."""
    return load_topology(spec)


def planner_spec(text: str) -> str:
    """An argparse type: a spec `make_planner` accepts. The planners (and torch, which they
    measure with) are imported when a spec is checked, not by every command that imports this
    module (`topology show`, `plot`)."""
    from gossipcomp.schedule import make_planner

    return accepted(make_planner)(text)


def add_tls_flags(parser: argparse.ArgumentParser, who: str) -> None:
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


_TLS_FLAGS = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_ca": "--tls-ca"}


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
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


def check_plot_path(path: Path, flag: str) -> None:
    """A PNG path whose folder can be written (made if needed), before anything runs."""
    if path.suffix.lower() != ".png":
        raise ValueError(f"{flag} {quoted(str(path))}: expected a file name ending in .png")
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; expected a file path")
    writable_directory(path.parent, f"{flag} {path}")


def writable_directory(directory: Path, what: str) -> None:
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


def check_outputs(args: argparse.Namespace) -> None:
    """Before training: the report and the checkpoints can be written where asked, so a run
    never ends by losing its results to a bad path."""
    if args.report is not None:
        if args.report.is_dir():
            raise ValueError(f"--report {args.report}: is a directory; expected a file path")
        writable_directory(args.report.parent, f"--report {args.report}")
    if args.checkpoint_dir is not None:
        writable_directory(args.checkpoint_dir, f"--checkpoint-dir {args.checkpoint_dir}")
