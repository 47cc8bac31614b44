"""Transport security: mutual TLS credentials for gRPC, certificates for a private network, and
per-peer signing keys with which every message proves its sender."""

from gossipcomp.security.certificates import (
    CA_CERT_NAME,
    CA_KEY_NAME,
    new_ca,
    new_peer_certificate,
    throwaway_certificates,
)
from gossipcomp.security.signing_keys import (
    PeerKeys,
    load_signing_key,
    parse_public_key,
    public_key_text,
    write_signing_key,
)
from gossipcomp.security.tls import TlsFiles, TlsPem, channel_credentials, server_credentials

__all__ = [
    "CA_CERT_NAME",
    "CA_KEY_NAME",
    "PeerKeys",
    "TlsFiles",
    "TlsPem",
    "channel_credentials",
    "load_signing_key",
    "new_ca",
    "new_peer_certificate",
    "parse_public_key",
    "public_key_text",
    "server_credentials",
    "throwaway_certificates",
    "write_signing_key",
]
