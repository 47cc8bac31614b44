"""Envelopes <-> streams of protobuf chunks (~1 MiB each), with byte accounting.

Large messages move through gRPC far faster as a client stream of ~1 MiB chunks than as one
unary message (measured on loopback: ~0.6x vs ~0.12x of a raw socket), so every envelope is
streamed: the header in the first chunk, then the tensors' bytes back to back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import (
    Envelope,
    EnvelopeRejected,
    PayloadSpec,
    RejectCode,
    WireTensor,
)

DEFAULT_CHUNK_BYTES = 1 << 20


def header_of(envelope: Envelope) -> pb.EnvelopeHeader:
    return pb.EnvelopeHeader(
        protocol_version=envelope.protocol_version,
        sender=envelope.sender,
        round=envelope.round,
        phase=envelope.phase,
        schedule_epoch=envelope.schedule_epoch,
        tensors=[
            pb.TensorHeader(
                name=t.name, dtype=t.dtype, shape=list(t.shape), codec=t.codec, nbytes=t.nbytes
            )
            for t in envelope.tensors
        ],
    )


def envelope_chunks(
    envelope: Envelope, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[pb.EnvelopeChunk]:
    """Yield the chunks of an envelope: the header first, then data pieces of <= chunk_bytes."""
    pending: list[memoryview] = []
    pending_bytes = 0
    header: pb.EnvelopeHeader | None = header_of(envelope)
    for tensor in envelope.tensors:
        view = memoryview(tensor.data).cast("B")
        offset = 0
        while offset < len(view):
            take = min(chunk_bytes - pending_bytes, len(view) - offset)
            pending.append(view[offset : offset + take])
            pending_bytes += take
            offset += take
            if pending_bytes == chunk_bytes:
                data = bytes(pending[0]) if len(pending) == 1 else b"".join(pending)
                yield pb.EnvelopeChunk(header=header, data=data)
                header, pending, pending_bytes = None, [], 0
    if pending or header is not None:
        yield pb.EnvelopeChunk(header=header, data=b"".join(pending))


def envelope_wire_bytes(envelope: Envelope, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Serialised size of an envelope's chunks: what gRPC puts on the wire (before HTTP/2 framing)."""
    return sum(chunk.ByteSize() for chunk in envelope_chunks(envelope, chunk_bytes))


HeaderCheck = Callable[[pb.EnvelopeHeader], PayloadSpec]


def read_envelope(
    chunks: Iterable[pb.EnvelopeChunk], check_header: HeaderCheck
) -> tuple[Envelope, PayloadSpec, int]:
    """Assemble an envelope from its chunks, validating the header before reading any data.

    Returns the envelope, the spec it was checked against, and the serialised bytes read.
    Raises EnvelopeRejected for a missing or repeated header and for a byte count that does not
    match what the header declared.
    """
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None or not first.HasField("header"):
        raise EnvelopeRejected(RejectCode.INVALID_ARGUMENT, "header: expected in the first chunk")
    header = first.header
    spec = check_header(header)
    total = sum(t.nbytes for t in header.tensors)
    buffer = bytearray(total)
    wire_bytes = first.ByteSize()
    filled = 0
    chunk: pb.EnvelopeChunk | None = first
    while chunk is not None:
        if chunk is not first:
            if chunk.HasField("header"):
                raise EnvelopeRejected(
                    RejectCode.INVALID_ARGUMENT, "header: expected only in the first chunk"
                )
            wire_bytes += chunk.ByteSize()
        data = chunk.data
        if filled + len(data) > total:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"data bytes: header declared {total}, received more than that",
            )
        buffer[filled : filled + len(data)] = data
        filled += len(data)
        chunk = next(iterator, None)
    if filled != total:
        raise EnvelopeRejected(
            RejectCode.INVALID_ARGUMENT,
            f"data bytes: header declared {total}, received {filled}",
        )
    view = memoryview(buffer)
    tensors: list[WireTensor] = []
    offset = 0
    for t in header.tensors:
        tensors.append(
            WireTensor(t.name, t.dtype, tuple(t.shape), t.codec, view[offset : offset + t.nbytes])
        )
        offset += t.nbytes
    envelope = Envelope(
        sender=header.sender,
        round=header.round,
        phase=header.phase,
        tensors=tuple(tensors),
        schedule_epoch=header.schedule_epoch,
        protocol_version=header.protocol_version,
    )
    return envelope, spec, wire_bytes
