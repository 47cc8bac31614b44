"""Peers' Ed25519 signing keys: files, the text form topologies list, and a network's key set.

A peer signs everything it sends with its private key (a PEM file given as `--key`); every peer
finds the others' public keys in the topology, each as ``ed25519:<base64 of the 32 raw bytes>``,
either inline in a `peers:` entry or in an allowlist file the topology points to. Ed25519 keeps
signatures small (64 bytes) and signing and checking fast enough for every envelope.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gossipcomp.inputs.files import MAX_KEY_BYTES, read_regular_file
from gossipcomp.inputs.text import quoted
from gossipcomp.inputs.yaml_files import load_yaml_file

PUBLIC_KEY_PREFIX = "ed25519:"
KEY_ID_BYTES = 8
ALLOWLIST_NAME = "allowlist.yaml"


def public_key_text(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """The text form of a public key (of a private key's pair): ``ed25519:<base64>``."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PUBLIC_KEY_PREFIX + base64.b64encode(raw).decode("ascii")


def parse_public_key(text: object, where: str) -> Ed25519PublicKey:
    """Parse ``ed25519:<base64>``; ValueError naming `where`, the problem and the format."""
    expected = f"'{PUBLIC_KEY_PREFIX}' followed by the base64 of 32 bytes"
    if not isinstance(text, str) or not text.startswith(PUBLIC_KEY_PREFIX):
        problem = f"public key {quoted(text)} is not an Ed25519 key"
        raise ValueError(f"{where}: {problem}; expected {expected}")
    try:
        raw = base64.b64decode(text[len(PUBLIC_KEY_PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError(
            f"{where}: public key {quoted(text)} is not valid base64; expected {expected}"
        ) from None
    if len(raw) != 32:
        raise ValueError(f"{where}: public key has {len(raw)} bytes; expected {expected}")
    return Ed25519PublicKey.from_public_bytes(raw)


def key_id(key: Ed25519PublicKey) -> bytes:
    """A short name for a public key (first 8 bytes of SHA-256 of its raw bytes), sent with
    each signature so the receiver knows which key to check it with."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).digest()[:KEY_ID_BYTES]


def write_signing_key(path: Path) -> Ed25519PrivateKey:
    """Create a new private key at `path` (PEM, PKCS#8, readable by its owner only).

    Raises FileExistsError rather than replace a key: peers that list the old public key would
    stop trusting this peer.
    """
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"{path} already exists: refusing to overwrite a signing key (expected a new file "
            f"name; the topology lists the existing key's public half)"
        ) from None
    with os.fdopen(descriptor, "wb") as file:
        file.write(pem)
    return key


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Read a private signing key (`--key`); errors name the file and what was expected.

    Refuses anything but a regular file (a FIFO is not waited on) and a file that group or
    others may access: a signing key others can read lets them speak as this peer.
    """
    expected = "a PEM Ed25519 private key made by `gossipcomp keys new`"
    data = read_regular_file(path, "signing key (--key)", expected, MAX_KEY_BYTES, private=True)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as error:
        raise ValueError(
            f"signing key (--key) {path}: expected an unencrypted PEM private key ({error})"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(
            f"signing key (--key) {path}: a {type(key).__name__}, expected an Ed25519 key "
            f"(a TLS key given as --key?)"
        )
    return key


@dataclass(frozen=True)
class PeerKeys:
    """What a peer authenticates with: its private key, and every peer's public key by rank."""

    private: Ed25519PrivateKey
    public: Mapping[int, Ed25519PublicKey]

    @classmethod
    def for_rank(
        cls, rank: int, private: Ed25519PrivateKey, public_keys: Sequence[str | None], source: str
    ) -> PeerKeys:
        """Check that the topology (`source`) names a key for every peer and that `private` is
        the one it names for `rank`; ValueError saying which peers or which key is wrong."""
        missing = [r for r, text in enumerate(public_keys) if text is None]
        if missing:
            raise ValueError(
                f"{source}: peers {missing} have no public key; expected a public_key for every "
                f"peer (in its peers: entry or the allowlist) when peers authenticate"
            )
        public = {
            r: parse_public_key(text, f"{source}: peer {r}") for r, text in enumerate(public_keys)
        }
        mine, listed = public_key_text(private), public_key_text(public[rank])
        if mine != listed:
            raise ValueError(
                f"signing key (--key) is not peer {rank}'s: its public key is {mine}, "
                f"{source} lists {listed} for peer {rank}"
            )
        return cls(private, public)


def record_in_allowlist(directory: Path, rank: int, key: Ed25519PrivateKey) -> Path:
    """Add `rank`'s public key to the allowlist in `directory` (a YAML mapping rank -> key),
    rewriting it atomically. Refuses to replace a different key already listed for the rank."""
    path = Path(directory) / ALLOWLIST_NAME
    listed = read_allowlist(path) if path.exists() else {}
    text = public_key_text(key)
    if listed.get(rank, text) != text:
        raise FileExistsError(
            f"{path}: peer {rank} already has the key {listed[rank]}; expected no entry for "
            f"rank {rank} (remove it first to replace that peer's key)"
        )
    listed[rank] = text
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(yaml.safe_dump(dict(sorted(listed.items()))), encoding="utf-8")
    os.replace(temporary, path)
    return path


def read_allowlist(path: Path) -> dict[int, str]:
    """Read an allowlist file: a YAML mapping rank -> ``ed25519:...``, each key checked, through
    the hardened reader of gossipcomp.inputs.yaml_files (no aliases, bounded size, depth and nodes)."""
    loaded = load_yaml_file(path, "allowlist", "a YAML mapping rank -> public key")
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"allowlist {path}: top level is {type(loaded).__name__}; expected a mapping "
            f"rank -> public key"
        )
    keys: dict[int, str] = {}
    for rank, text in loaded.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"allowlist {path}: rank {quoted(rank)}; expected integers >= 0")
        parse_public_key(text, f"allowlist {path}: peer {rank}")
        keys[rank] = text
    return keys
