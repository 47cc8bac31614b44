"""Envelopes <-> streams of serialised EnvelopeChunk messages (~1 MiB each), with byte accounting.

Large messages move through gRPC far faster as a client stream of ~1 MiB chunks than as one
unary message, so every envelope is streamed: the header in the first chunk, then the tensors'
bytes back to back. Chunks are valid, canonical protobuf `EnvelopeChunk` messages (any gRPC
client may send them), but data chunks are written and read here directly, field tag, length and
bytes, because building and parsing them through protobuf objects copies every byte three more
times, which cost a 64 MiB envelope about half its loopback throughput.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator

import numpy
from google.protobuf.message import DecodeError

from gossipcomp.levels.notices import notice_message, notice_of
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import (
    Envelope,
    EnvelopeRejected,
    PayloadSpec,
    RejectCode,
    WireTensor,
)
from gossipcomp.transport.codec import FiniteScanner

DEFAULT_CHUNK_BYTES = 1 << 20
SCAN_STEP_BYTES = 1 << 20  # lane data gathered between two scans for NaN/Inf (EnvelopeReader)
_HEADER_TAG = b"\x0a"  # EnvelopeChunk field 1 (header), length-delimited
_DATA_TAG = b"\x12"  # EnvelopeChunk field 2 (data), length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decode a varint at `pos`; return (value, position after it). ValueError if truncated."""
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


def header_of(envelope: Envelope) -> pb.EnvelopeHeader:
    header = pb.EnvelopeHeader(
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
    if envelope.notice is not None:
        header.level_notice.CopyFrom(notice_message(envelope.notice))
    return header


def _chunk(header: bytes | None, pieces: list[memoryview], size: int) -> bytes:
    parts: list[bytes | memoryview] = []
    if header is not None:
        parts += [_HEADER_TAG, _varint(len(header)), header]
    if size:  # proto3 leaves an empty bytes field out
        parts += [_DATA_TAG, _varint(size), *pieces]
    return b"".join(parts)


def envelope_chunks(
    envelope: Envelope,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    header: pb.EnvelopeHeader | None = None,
) -> Iterator[bytes]:
    """Yield the serialised chunks of an envelope: header first, data pieces of <= chunk_bytes.

    `header` replaces the one built from the envelope (a signed copy of it)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    serialised: bytes | None = (
        header if header is not None else header_of(envelope)
    ).SerializeToString()
    pieces: list[memoryview] = []
    size = 0
    for tensor in envelope.tensors:
        view = memoryview(tensor.data).cast("B")
        offset = 0
        while offset < len(view):
            take = min(chunk_bytes - size, len(view) - offset)
            pieces.append(view[offset : offset + take])
            size += take
            offset += take
            if size == chunk_bytes:
                yield _chunk(serialised, pieces, size)
                serialised, pieces, size = None, [], 0
    if pieces or serialised is not None:
        yield _chunk(serialised, pieces, size)


def header_chunk(envelope: Envelope) -> bytes:
    """An envelope's first chunk without data: its header alone, what the bulk lane sends by
    gRPC ahead of the data."""
    return _chunk(header_of(envelope).SerializeToString(), [], 0)


def with_header(first_chunk: bytes, header: pb.EnvelopeHeader) -> bytes:
    """The first chunk of an envelope with its header replaced (the data bytes it carries are
    kept): how one payload chunked once is signed for each receiver."""
    if first_chunk[:1] != _HEADER_TAG:
        raise ValueError("first chunk: expected it to start with the envelope header")
    length, start = _read_varint(first_chunk, 1)
    rest = memoryview(first_chunk)[start + length :]
    serialised = header.SerializeToString()
    return b"".join((_HEADER_TAG, _varint(len(serialised)), serialised, rest))


def content_sha256(envelope: Envelope) -> bytes:
    """SHA-256 of an envelope's data bytes in wire order (what a sender's proof signs)."""
    digest = hashlib.sha256()
    for tensor in envelope.tensors:
        digest.update(tensor.data)
    return digest.digest()


def envelope_wire_bytes(
    envelope: Envelope,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    header: pb.EnvelopeHeader | None = None,
) -> int:
    """Serialised size of an envelope's chunks: what gRPC carries (before HTTP/2 framing).

    Counted, not built: the chunks `envelope_chunks` yields are the header field, then data
    fields of `chunk_bytes` but the last, the first chunk holding the header and, when there is
    data, the first data field (`header`: the envelope's, when the caller has it already)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    header_size = (header if header is not None else header_of(envelope)).ByteSize()
    total = len(_HEADER_TAG) + len(_varint(header_size)) + header_size
    data = sum(tensor.nbytes for tensor in envelope.tensors)
    full, last = divmod(data, chunk_bytes)
    if full:
        total += full * (len(_DATA_TAG) + len(_varint(chunk_bytes)) + chunk_bytes)
    if last:
        total += len(_DATA_TAG) + len(_varint(last)) + last
    return total


def parse_chunk(raw: bytes) -> tuple[pb.EnvelopeHeader | None, memoryview]:
    """Split one serialised chunk into its header (if any) and a view of its data bytes.

    A chunk that is exactly one data field is sliced without copying; anything else (the
    header chunk, or another valid encoding) goes through protobuf. Malformed bytes are refused.
    """
    if raw[:1] == _DATA_TAG:
        try:
            length, start = _read_varint(raw, 1)
        except ValueError:
            length, start = -1, 0
        if start + length == len(raw):
            return None, memoryview(raw)[start:]
    try:
        message = pb.EnvelopeChunk.FromString(raw)
    except DecodeError as error:
        raise EnvelopeRejected(
            RejectCode.INVALID_ARGUMENT, f"chunk: expected an EnvelopeChunk message ({error})"
        ) from None
    header = message.header if message.HasField("header") else None
    return header, memoryview(message.data)


def _fresh_buffer(nbytes: int) -> memoryview:
    return memoryview(numpy.empty(nbytes, dtype=numpy.uint8))


HeaderCheck = Callable[[pb.EnvelopeHeader], PayloadSpec]
ContentCheck = Callable[[pb.EnvelopeHeader, bytes], None]


class EnvelopeReader:
    """Assembles one envelope chunk by chunk, validating the header before any data.

    Built from the first chunk (which must carry the header: `check_header` validates it and
    returns the spec, which must match the header's tensors field by field, as validate_header
    checks, so nothing is allocated for an envelope that is refused), then fed the
    remaining chunks with `add`, and closed with `finish`. Raw float tensors are checked for
    NaN/Inf as their bytes arrive. With `check_content`, the data's SHA-256 is computed as it
    arrives and handed to it with the header at the end (it raises EnvelopeRejected when the
    digest is not the signed one). `allocate` gives the buffer the data is assembled in (a
    fresh one by default; the server reuses buffers, transport/buffers.py). Raises
    EnvelopeRejected for a missing or repeated header, a byte count other than the header
    declared, or NaN/Inf. Used by both the streaming server (one chunk at a time, with time
    limits between them) and `read_envelope`.
    """

    def __init__(
        self,
        first: bytes | None,
        check_header: HeaderCheck,
        check_content: ContentCheck | None = None,
        allocate: Callable[[int], memoryview] | None = None,
    ) -> None:
        header, data = parse_chunk(first) if first is not None else (None, memoryview(b""))
        if header is None:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT, "header: expected in the first chunk"
            )
        self.spec = check_header(header)
        self.header = header
        self._check_content = check_content
        # from here on the spec stands for the header's tensors: check_header matched them
        # field by field, and a spec's plain attributes read faster than protobuf's
        self._scanner = FiniteScanner(self.spec)
        self._total = sum(t.nbytes for t in self.spec)
        # no memset: every byte is written before use
        self._buffer = (allocate or _fresh_buffer)(self._total)
        self._filled = 0
        self._scanned = 0  # how far the data had arrived at the last scan for NaN/Inf
        self._digest = hashlib.sha256() if check_content is not None else None
        self.wire_bytes = len(first) if first is not None else 0
        self._take(data)

    @property
    def sender(self) -> int:
        return self.header.sender

    @property
    def declared(self) -> int:
        """Data bytes the header declared."""
        return self._total

    @property
    def missing(self) -> int:
        """Data bytes the header declared that have not arrived yet."""
        return self._total - self._filled

    def free_space(self) -> memoryview:
        """Where the envelope's next data bytes go: a caller that receives them in place (the
        bulk lane) writes at its start and reports how many with `received`."""
        return self._buffer[self._filled : self._total]

    def received(self, nbytes: int) -> None:
        """`nbytes` more data bytes were written at the start of `free_space()` (unframed: each
        counts as one wire byte)."""
        if not 0 < nbytes <= self.missing:
            raise ValueError(f"received: expected 1..{self.missing} bytes, got {nbytes}")
        self.wire_bytes += nbytes
        self._advance(nbytes, SCAN_STEP_BYTES)

    def _take(self, data: memoryview) -> None:
        if self._filled + len(data) > self._total:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"data bytes: header declared {self._total}, received more than that",
            )
        self._buffer[self._filled : self._filled + len(data)] = data
        self._advance(len(data), 0)

    def _advance(self, nbytes: int, scan_step: int) -> None:
        """Count `nbytes` just written at `_filled`: hash them, and scan what arrived since the
        last scan once `scan_step` bytes have gathered or the data is complete. A gRPC chunk
        (about 1 MiB) is scanned as it comes (step 0); lane data every SCAN_STEP_BYTES, since a
        scan per socket read of a few kilobytes would cost more than the reads."""
        if self._digest is not None:
            self._digest.update(self._buffer[self._filled : self._filled + nbytes])
        self._filled += nbytes
        if self._filled == self._total or self._filled - self._scanned >= scan_step:
            self._scanner.scan(self._buffer, self._filled)
            self._scanned = self._filled

    def add(self, raw: bytes) -> None:
        """One more serialised chunk (data only: a second header is refused)."""
        self.wire_bytes += len(raw)
        extra_header, data = parse_chunk(raw)
        if extra_header is not None:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT, "header: expected only in the first chunk"
            )
        self._take(data)

    def finish(self) -> tuple[Envelope, PayloadSpec, int]:
        """The envelope, the spec it was checked against, and the serialised bytes read."""
        if self._filled != self._total:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"data bytes: header declared {self._total}, received {self._filled}",
            )
        if self._check_content is not None and self._digest is not None:
            self._check_content(self.header, self._digest.digest())
        tensors: list[WireTensor] = []
        offset = 0
        for t in self.spec:
            end = offset + t.nbytes
            tensors.append(WireTensor(t.name, t.dtype, t.shape, t.codec, self._buffer[offset:end]))
            offset = end
        header = self.header
        envelope = Envelope(
            sender=header.sender,
            round=header.round,
            phase=header.phase,
            tensors=tuple(tensors),
            schedule_epoch=header.schedule_epoch,
            protocol_version=header.protocol_version,
            notice=notice_of(header),
        )
        return envelope, self.spec, self.wire_bytes


def read_envelope(
    chunks: Iterable[bytes], check_header: HeaderCheck, check_content: ContentCheck | None = None
) -> tuple[Envelope, PayloadSpec, int]:
    """Assemble an envelope from serialised chunks (see EnvelopeReader): returns the envelope,
    the spec it was checked against, and the serialised bytes read."""
    iterator = iter(chunks)
    reader = EnvelopeReader(next(iterator, None), check_header, check_content)
    for raw in iterator:
        reader.add(raw)
    return reader.finish()
