"""Mutual TLS for the gRPC transport: a peer's PEM files and the gRPC credentials made from them.

Every peer holds a certificate and key signed by one certificate authority (CA) that all peers
trust. Servers require a client certificate signed by that CA, and clients check the server's
certificate against it (its subjectAltName must cover the host they dial), so only holders of a
certificate from the network's CA can join, and nobody on the path can read or alter envelopes.
The files are checked when loaded (PEM, parseable, key matching certificate) so that a wrong flag
fails at start with a message naming it, not later as an opaque handshake failure.

grpc is imported only by the two functions that build gRPC credentials: checking files (and the
topology, which reads signing keys from this package) must not load the gRPC runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

from gossipcomp.inputs.files import MAX_KEY_BYTES, read_regular_file

if TYPE_CHECKING:
    import grpc

MAX_CERTIFICATE_BYTES = 2**20  # a certificate chain or CA bundle (a system bundle is ~200 kB)


@dataclass(frozen=True)
class TlsPem:
    """The contents of a peer's TLS files, checked: certificate chain, private key, CA bundle."""

    cert: bytes
    key: bytes
    ca: bytes


@dataclass(frozen=True)
class TlsFiles:
    """A peer's TLS files (PEM): its certificate, its private key and the CA it trusts."""

    cert: Path
    key: Path
    ca: Path

    def load(self) -> TlsPem:
        """Read and check the three files.

        Raises FileNotFoundError naming a missing file, ValueError naming a file that is not
        what it should be (not a regular file, a private key group or others may access, not
        PEM, not parseable, or a key that does not match the certificate).
        """
        cert = _read(self.cert, "certificate (--tls-cert)")
        key = _read(self.key, "private key (--tls-key)", private=True)
        ca = _read(self.ca, "CA certificate (--tls-ca)")
        certificate = _certificates(cert, self.cert, "certificate (--tls-cert)")[0]
        _certificates(ca, self.ca, "CA certificate (--tls-ca)")
        try:
            private_key = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"private key (--tls-key) {self.key}: expected an unencrypted PEM private key "
                f"({error})"
            ) from None
        if _public_der(private_key.public_key()) != _public_der(certificate.public_key()):
            raise ValueError(
                f"private key (--tls-key) {self.key} does not match certificate (--tls-cert) "
                f"{self.cert}: expected the key the certificate was issued for"
            )
        return TlsPem(cert=cert, key=key, ca=ca)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server side of mutual TLS: present our certificate, require one signed by the CA."""
    import grpc

    pem = files.load()
    return grpc.ssl_server_credentials(
        [(pem.key, pem.cert)], root_certificates=pem.ca, require_client_auth=True
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client side of mutual TLS: verify the server against the CA, present our certificate."""
    import grpc

    pem = files.load()
    return grpc.ssl_channel_credentials(
        root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert
    )


def _read(path: Path, what: str, private: bool = False) -> bytes:
    """A PEM file's bytes: a regular file, bounded, and (a private key) owner-only."""
    limit = MAX_KEY_BYTES if private else MAX_CERTIFICATE_BYTES
    data = read_regular_file(path, what, "a PEM file", limit, private=private)
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path}: not PEM (expected a '-----BEGIN ...' block)")
    return data


def _certificates(data: bytes, path: Path, what: str) -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError as error:
        raise ValueError(f"{what} {path}: expected PEM certificates ({error})") from None
    return certificates


def _public_der(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
