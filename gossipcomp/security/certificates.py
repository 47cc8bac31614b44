"""Making a network's certificates: one CA, then one certificate per peer signed by it.

Enough for a private gossip network without an external PKI: `new_ca` writes a self-signed CA,
`new_peer_certificate` a peer certificate usable both as TLS server and client (peers are both),
whose subjectAltName lists the hosts neighbours dial (IP addresses as IP SANs, so "127.0.0.1:port"
verifies without overriding the target name). Keys are EC P-256, written readable by the owner
only. `throwaway_certificates` makes a temporary set for a single-process simulation.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gossipcomp.inputs.files import MAX_KEY_BYTES, read_regular_file
from gossipcomp.security.tls import MAX_CERTIFICATE_BYTES, TlsFiles

CA_CERT_NAME = "ca.pem"
CA_KEY_NAME = "ca-key.pem"
CA_DAYS = 3650
PEER_DAYS = 825
ALWAYS_COVERED = ("localhost", "127.0.0.1")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def new_ca(directory: Path) -> tuple[Path, Path]:
    """Write a new CA (ca.pem, ca-key.pem) into `directory`; return their paths.

    Raises FileExistsError rather than replace an existing CA: every certificate it signed
    would stop being trusted by peers given the new one.
    """
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT_NAME, directory / CA_KEY_NAME
    for path in (cert_path, key_path):
        if path.exists():
            raise FileExistsError(
                f"{path} already exists: refusing to overwrite a CA (expected a directory "
                f"without {CA_CERT_NAME} and {CA_KEY_NAME}, or leave out --ca to use that CA)"
            )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gossipcomp CA")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    _write_key(key_path, key)
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert_path, key_path


def new_peer_certificate(
    directory: Path,
    name: str,
    addresses: Iterable[str],
    ca_cert: Path,
    ca_key: Path,
) -> TlsFiles:
    """Write `{name}.pem` and `{name}-key.pem` into `directory`, signed by the given CA.

    `addresses` are the hosts neighbours dial this peer at (a "host:port" has its port
    dropped); localhost and 127.0.0.1 are always covered. Returns the peer's TlsFiles, whose
    `ca` is `ca_cert`.
    """
    if not _NAME.fullmatch(name) or name in ("ca", "ca-key"):
        raise ValueError(
            f"certificate name {name!r}: expected letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit), and not 'ca'"
        )
    directory = Path(directory)
    authority, authority_key = _load_ca(Path(ca_cert), Path(ca_key))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ca_ski = authority.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(authority.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=PEER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(_subject_alt_names(addresses), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(authority_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    _write_key(key_path, key)
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return TlsFiles(cert=cert_path, key=key_path, ca=Path(ca_cert))


@contextmanager
def throwaway_certificates(names: Sequence[str]) -> Iterator[dict[str, TlsFiles]]:
    """A fresh CA and one loopback certificate per name, in a temporary directory removed on
    exit (the CA's key with it, so nothing else can ever join the network)."""
    with tempfile.TemporaryDirectory(prefix="gossipcomp-tls-") as temporary:
        directory = Path(temporary)
        ca_cert, ca_key = new_ca(directory)
        yield {
            name: new_peer_certificate(directory, name, ALWAYS_COVERED, ca_cert, ca_key)
            for name in names
        }


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _host(address: str) -> str | IpAddress:
    """An IP address, or a DNS name, from a host or host:port (IPv6 with a port in brackets)."""
    text = address.strip()
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if not text or not all(
        re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9-]*[A-Za-z0-9])?", x) for x in labels
    ):
        raise ValueError(
            f"address {address!r}: expected an IP address or a host name (optionally with :port)"
        )
    return text.rstrip(".").lower()


def _subject_alt_names(addresses: Iterable[str]) -> x509.SubjectAlternativeName:
    hosts: list[str | IpAddress] = []
    for address in (*ALWAYS_COVERED, *addresses):
        host = _host(address)
        if host not in hosts:
            hosts.append(host)
    return x509.SubjectAlternativeName(
        [x509.DNSName(h) if isinstance(h, str) else x509.IPAddress(h) for h in hosts]
    )


def _load_ca(
    cert_path: Path, key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    for path, what in ((cert_path, "CA certificate"), (key_path, "CA key")):
        if not path.exists():  # anything else there is refused by the reader, named
            raise FileNotFoundError(
                f"{what} {path}: no such file (expected a CA made by `gossipcomp keys new --ca`)"
            )
    expected = "a PEM certificate"
    pem = read_regular_file(cert_path, "CA certificate", expected, MAX_CERTIFICATE_BYTES)
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError as error:
        raise ValueError(
            f"CA certificate {cert_path}: expected a PEM certificate ({error})"
        ) from None
    pem = read_regular_file(key_path, "CA key", "a PEM key", MAX_KEY_BYTES, private=True)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as error:
        raise ValueError(f"CA key {key_path}: expected an unencrypted PEM key ({error})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"CA key {key_path}: expected an EC key, got {type(key).__name__}")
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
        certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    except x509.ExtensionNotFound as missing:
        raise ValueError(
            f"CA certificate {cert_path}: {missing} (expected a CA certificate)"
        ) from None
    if not constraints.ca:
        raise ValueError(f"CA certificate {cert_path}: not a CA (basic constraints CA=false)")
    if key.public_key() != certificate.public_key():
        raise ValueError(f"CA key {key_path} does not match CA certificate {cert_path}")
    return certificate, key


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(path, pem, mode=0o600)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write through a temporary file created with `mode` (a key is never readable by others,
    not even for a moment) and renamed into place."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(descriptor, mode)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
