"""Chunking, byte accounting, the mailbox's round/duplicate rules, and the in-memory transport."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import run_in_threads

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import Envelope, EnvelopeRejected, Identity, RejectCode, TensorSpec
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.mailbox import Mailbox
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.wire import (
    envelope_chunks,
    envelope_wire_bytes,
    header_of,
    read_envelope,
)


def _declared(header) -> tuple[TensorSpec, ...]:
    """Accept whatever the header declares, checking values for NaN/Inf."""
    return tuple(
        TensorSpec(t.name, t.dtype, tuple(t.shape), t.codec, t.nbytes) for t in header.tensors
    )


@pytest.mark.parametrize("chunk_bytes", [1, 4, 78, 155, 156, 157, 1 << 20])
@pytest.mark.parametrize("sizes", [(), (0,), (0, 1, 5, 33), (300,)])
def test_wire_bytes_are_counted_as_the_chunks_would_be_built(chunk_bytes, sizes):
    # counted without building the chunks: data that fills chunks exactly, one byte short or
    # over, an envelope of no data at all, and a header too long for a one-byte varint (300)
    wire = tuple(
        encode_raw(f"t{i}" + "x" * (200 if n == 300 else 0), torch.arange(n, dtype=torch.float32))
        for i, n in enumerate(sizes)
    )
    envelope = Envelope(3, 9, "x", wire, 2)
    built = sum(len(c) for c in envelope_chunks(envelope, chunk_bytes))
    assert envelope_wire_bytes(envelope, chunk_bytes) == built
    assert envelope_wire_bytes(envelope, chunk_bytes, header=header_of(envelope)) == built


def test_wire_bytes_refuse_a_chunk_size_below_one():
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        envelope_wire_bytes(Envelope(0, 0, "x", ()), 0)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_chunks_reassemble_exactly_across_tensor_boundaries(chunk_bytes):
    tensors = [torch.arange(n, dtype=torch.float32) for n in (0, 1, 5, 33)]
    envelope = Envelope(3, 9, "x", tuple(encode_raw(f"t{i}", t) for i, t in enumerate(tensors)), 2)
    chunks = list(envelope_chunks(envelope, chunk_bytes))
    # every chunk is a canonical protobuf EnvelopeChunk: parsing and re-serialising gives it back
    parsed = [pb.EnvelopeChunk.FromString(c) for c in chunks]
    assert [p.SerializeToString() for p in parsed] == chunks
    assert all(len(p.data) <= chunk_bytes for p in parsed)
    assert parsed[0].HasField("header") and not any(p.HasField("header") for p in parsed[1:])
    assert parsed[0].header == header_of(envelope)
    back, _, wire_bytes = read_envelope(chunks, _declared)
    assert wire_bytes == sum(len(c) for c in chunks) == envelope_wire_bytes(envelope, chunk_bytes)
    # a sender using protobuf objects (any gRPC client) is read the same way
    assert read_envelope([p.SerializeToString() for p in parsed], _declared)[0] == back
    assert (back.sender, back.round, back.phase, back.schedule_epoch) == (3, 9, "x", 2)
    for i, t in enumerate(tensors):
        assert torch.equal(decode_raw(back.tensor(f"t{i}")), t)


def test_stream_with_missing_or_extra_bytes_is_refused():
    envelope = Envelope(0, 0, "x", (encode_raw("t", torch.ones(100)),))
    chunks = list(envelope_chunks(envelope, 64))
    with pytest.raises(EnvelopeRejected, match="declared 400, received 384"):
        read_envelope(chunks[:-1], _declared)
    with pytest.raises(EnvelopeRejected, match="received more"):
        read_envelope([*chunks, pb.EnvelopeChunk(data=b"x").SerializeToString()], _declared)
    with pytest.raises(EnvelopeRejected, match="header"):
        read_envelope(chunks[1:], _declared)
    with pytest.raises(EnvelopeRejected, match="expected an EnvelopeChunk"):
        read_envelope([b"\x12\xff\xff\xff"], _declared)
    with pytest.raises(EnvelopeRejected, match="header: expected only in the first chunk"):
        read_envelope([chunks[0], chunks[0]], _declared)


def test_mailbox_refuses_late_duplicate_and_far_future():
    box = Mailbox(window=2)
    envelope = Envelope(1, 0, "p", ())
    box.deliver(envelope, 10)
    with pytest.raises(EnvelopeRejected) as dup:
        box.deliver(envelope, 10)
    assert dup.value.code == RejectCode.ALREADY_EXISTS
    assert box.collect(0, "p", [1], time.monotonic() + 1) == {1: (envelope, 10)}
    with pytest.raises(EnvelopeRejected):  # consumed: still a duplicate, never applied twice
        box.deliver(envelope, 10)
    box.open_round(1)
    with pytest.raises(EnvelopeRejected, match="earlier rounds are finished"):
        box.deliver(Envelope(1, 0, "p", ()), 10)
    with pytest.raises(EnvelopeRejected, match="at most 2 ahead") as early:
        box.deliver(Envelope(1, 4, "p", ()), 10)
    assert early.value.code == RejectCode.ABORTED  # not yet: its sender may push it again
    box.deliver(Envelope(1, 3, "p", ()), 10)
    assert box.collect(1, "p", [1], time.monotonic() + 0.05) == {}
    assert box.pending() == 1


def test_mailbox_lets_in_an_agreed_resume_round_only_from_that_sender():
    """A resume round agreed with a neighbour far ahead is accepted beyond the window, for that
    sender and round only; other far rounds and senders are still refused; it stays held when
    this peer jumps to it, and is dropped like any other once its round is finished."""
    box = Mailbox(window=2)
    box.allow(1, 50)
    far = Envelope(1, 50, "resume", ())
    box.deliver(far, 10)
    for refused in (Envelope(1, 49, "resume", ()), Envelope(2, 50, "resume", ())):
        with pytest.raises(EnvelopeRejected, match="at most 2 ahead"):
            box.deliver(refused, 10)
    with pytest.raises(EnvelopeRejected) as dup:
        box.deliver(far, 10)
    assert dup.value.code == RejectCode.ALREADY_EXISTS
    box.open_round(45)  # the peer jumps: 50 is still ahead, the envelope still held
    assert box.collect(50, "resume", [1], time.monotonic() + 1) == {1: (far, 10)}
    box.open_round(51)
    with pytest.raises(EnvelopeRejected, match="earlier rounds are finished"):
        box.deliver(Envelope(1, 50, "model", ()), 10)
    with pytest.raises(EnvelopeRejected, match="at most 2 ahead"):  # the allowance is used up
        box.deliver(Envelope(1, 60, "model", ()), 10)


def test_in_memory_transport_validates_and_counts_like_grpc():
    hub = InMemoryHub()
    spec = (tensor_spec("w", torch.zeros(3)),)
    a = InMemoryTransport(Identity(0, "t", "m"), [1], hub)
    b = InMemoryTransport(Identity(1, "t", "m"), [0], hub)
    for t in (a, b):
        t.inbox.expect("p", spec)
        t.connect({}, timeout=1)
    payload = (encode_raw("w", torch.tensor([1.0, 2.0, 3.0])),)
    ra, rb = run_in_threads(
        [lambda: a.exchange(0, "p", {1: payload}, 5), lambda: b.exchange(0, "p", {0: payload}, 5)]
    )
    assert torch.equal(decode_raw(rb.received[0].tensor("w")), torch.tensor([1.0, 2.0, 3.0]))
    assert ra.bytes_sent[1] == envelope_wire_bytes(Envelope(0, 0, "p", payload))
    bad = (encode_raw("w", torch.zeros(4)),)
    result = a.exchange(1, "p", {1: bad}, 0.2)
    assert "shape" in result.failed[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_is_refused_while_streaming_without_reading_the_rest(dtype):
    values = torch.ones(1000, dtype=dtype)
    values[300] = float("nan")
    envelope = Envelope(0, 0, "x", (encode_raw("t", torch.ones(10)), encode_raw("u", values)))
    chunks = list(envelope_chunks(envelope, 256))
    consumed = []

    def feed():
        for chunk in chunks:
            consumed.append(chunk)
            yield chunk

    with pytest.raises(EnvelopeRejected, match="tensor 'u' values: expected finite"):
        read_envelope(feed(), _declared)
    assert len(consumed) < len(chunks) / 2
    # a huge but finite tensor whose sum overflows is still accepted (element-wise fallback)
    big = torch.full((100,), 3e38)
    back, _, _ = read_envelope(
        envelope_chunks(Envelope(0, 0, "x", (encode_raw("b", big),)), 64), _declared
    )
    assert torch.equal(decode_raw(back.tensor("b")), big)
