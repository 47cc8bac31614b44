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
    Transport,
    WireTensor,
)

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
