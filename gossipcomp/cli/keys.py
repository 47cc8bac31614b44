"""`gossipcomp keys new`: a CA, a peer certificate signed by it, and the peer's signing key."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from gossipcomp.inputs.arguments import HelpWithDefaults, integer
from gossipcomp.security import CA_CERT_NAME, CA_KEY_NAME, new_ca, new_peer_certificate
from gossipcomp.security.signing_keys import (
    public_key_text,
    record_in_allowlist,
    write_signing_key,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`gossipcomp keys new` and its flags."""
    keys = sub.add_parser("keys", help="certificates for mutual TLS and keys for signing")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    new = keys_sub.add_parser(
        "new",
        formatter_class=HelpWithDefaults,
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


def run(args: argparse.Namespace, console: Console) -> int:
    """Write the files (the paths printed on stdout, the command's output)."""
    _write_keys(args, Console(highlight=False))
    return 0


def _write_keys(args: argparse.Namespace, console: Console) -> None:
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
