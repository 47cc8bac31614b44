"""Moving named payloads between neighbours: the Transport protocol and its implementations."""

from gossipcomp.transport.base import (
    PROTOCOL_VERSION,
    RAW_CODEC,
    Envelope,
    EnvelopeRejected,
    ExchangeResult,
    Greeting,
    HandshakeError,
    Identity,
    Payload,
    PayloadSpec,
    PeerUnreachableError,
    RejectCode,
    TensorSpec,
    WireTensor,
)
from gossipcomp.transport.protocol import Transport

__all__ = [
    "PROTOCOL_VERSION",
    "RAW_CODEC",
    "Envelope",
    "EnvelopeRejected",
    "ExchangeResult",
    "Greeting",
    "HandshakeError",
    "Identity",
    "Payload",
    "PayloadSpec",
    "PeerUnreachableError",
    "RejectCode",
    "TensorSpec",
    "Transport",
    "WireTensor",
]
