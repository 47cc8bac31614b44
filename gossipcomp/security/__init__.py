"""Transport security: mutual TLS credentials for gRPC, and certificates for a private network."""

from gossipcomp.security.certificates import (
    CA_CERT_NAME,
    CA_KEY_NAME,
    new_ca,
    new_peer_certificate,
    throwaway_certificates,
)
from gossipcomp.security.tls import TlsFiles, TlsPem, channel_credentials, server_credentials

__all__ = [
    "CA_CERT_NAME",
    "CA_KEY_NAME",
    "TlsFiles",
    "TlsPem",
    "channel_credentials",
    "new_ca",
    "new_peer_certificate",
    "server_credentials",
    "throwaway_certificates",
]
