"""The gRPC transport over real loopback connections: integrity, handshake, validation, health."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import run_in_threads
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.proto.v1 import gossip_pb2_grpc as pb_grpc
from gossipcomp.transport.base import (
    PROTOCOL_VERSION,
    Envelope,
    HandshakeError,
    HelloAnswer,
    Identity,
    PeerUnreachableError,
    TensorSpec,
    WireTensor,
)
from gossipcomp.transport.codec import DTYPES, decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcOptions, GrpcTransport
from gossipcomp.transport.wire import envelope_chunks, header_chunk


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _exchange_both(a, b, round, phase, payload_a, payload_b, timeout=20.0):
    return run_in_threads(
        [
            lambda: a.exchange(round, phase, {1: payload_a}, timeout),
            lambda: b.exchange(round, phase, {0: payload_b}, timeout),
        ]
    )


def test_every_dtype_round_trips_bit_exact(grpc_pair):
    a, b = grpc_pair()
    shapes = [(), (0,), (7,), (3, 5), (2, 3, 4)]
    tensors = {
        f"{name}/{i}": _sample(dtype, shape, seed=i)
        for name, dtype in DTYPES.items()
        for i, shape in enumerate(shapes)
    }
    spec = tuple(tensor_spec(n, t) for n, t in tensors.items())
    a.inbox.expect("p", spec)
    b.inbox.expect("p", spec)
    payload = tuple(encode_raw(n, t) for n, t in tensors.items())
    ra, rb = _exchange_both(a, b, 0, "p", payload, payload)
    for result in (ra, rb):
        assert not result.failed
        envelope = next(iter(result.received.values()))
        for n, t in tensors.items():
            got = decode_raw(envelope.tensor(n))
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n


@pytest.mark.parametrize("on_lane", [True, False], ids=["bulk lane", "stream"])
def test_64_mib_envelope_arrives_intact_and_bytes_are_counted(grpc_pair, on_lane):
    a, b = grpc_pair(options=GrpcOptions() if on_lane else GrpcOptions(bulk_lane_bytes=0))
    big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(3))
    spec = (tensor_spec("big", big),)
    a.inbox.expect("big", spec)
    b.inbox.expect("big", spec)
    envelope_a = (encode_raw("big", big),)
    envelope_b = (encode_raw("big", -big),)
    ra, rb = _exchange_both(a, b, 0, "big", envelope_a, envelope_b, timeout=60)
    assert torch.equal(decode_raw(rb.received[0].tensor("big")), big)
    assert torch.equal(decode_raw(ra.received[1].tensor("big")), -big)
    envelope = Envelope(0, 0, "big", envelope_a)
    if on_lane:  # the header chunk by gRPC, then the data unframed
        expected = len(header_chunk(envelope)) + (64 << 20)
    else:
        expected = sum(len(c) for c in envelope_chunks(envelope))
        assert expected > 64 << 20  # data plus per-chunk framing, never a formula
    assert ra.bytes_sent[1] == expected == rb.bytes_received[0]


@pytest.mark.parametrize(
    "field, ours, theirs",
    [
        ("topology_hash", Identity(1, "topo-A", "model"), Identity(0, "topo-B", "model")),
        ("model_signature", Identity(1, "topo", "model-A"), Identity(0, "topo", "model-B")),
        ("protocol_version", Identity(1, "topo", "model"), Identity(0, "topo", "model", 99)),
    ],
)
def test_handshake_mismatch_is_refused_naming_the_field_but_not_the_servers_value(
    field, ours, theirs
):
    """Over plaintext the caller is not authenticated: the refusal names the field and the
    caller's own value, never the server's (a stranger learns nothing of the peer)."""
    server = GrpcTransport(ours, [0])
    client = GrpcTransport(theirs, [1])
    try:
        with pytest.raises(HandshakeError) as caught:
            client.connect({1: server.address}, timeout=10)
        message = str(caught.value)
        assert field in message and "refused" in message
        assert str(getattr(theirs, field)) in message
        details = message.split("refused: ", 1)[1].replace(f"peer {ours.rank}", "")
        assert repr(getattr(ours, field)) not in details
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("old_end", ["caller", "server"])
def test_a_peer_of_the_version_before_the_link_stream_is_refused_at_the_handshake(old_end):
    """Version 1 peers do not serve Gossip.Link, which carries every envelope of one chunk. Let
    through the handshake, such a peer would fail every small push to it with UNIMPLEMENTED,
    round after round; the version names the change, so the mix is refused before any round,
    whichever end is the old one."""
    assert PROTOCOL_VERSION >= 2
    old = Identity(0 if old_end == "caller" else 1, "topo", "model", PROTOCOL_VERSION - 1)
    new = Identity(1 if old_end == "caller" else 0, "topo", "model")
    caller, server = (old, new) if old_end == "caller" else (new, old)
    serving = GrpcTransport(server, [caller.rank])
    calling = GrpcTransport(caller, [server.rank])
    try:
        with pytest.raises(HandshakeError, match="protocol_version"):
            calling.connect({server.rank: serving.address}, timeout=10)
    finally:
        serving.close()
        calling.close()


@pytest.mark.parametrize("value", [-7, 2**53, 2**63 - 1, -(2**63)])
@pytest.mark.parametrize("field", ["round", "proposed_resume_round", "schedule_epoch"])
def test_handshake_rounds_out_of_range_are_invalid_argument_naming_the_field(field, value):
    """A round of 2^63-1 once failed the handler with UNKNOWN ('Value out of range') after the
    peer had already adopted it: now it is refused before anything is used."""
    server = GrpcTransport(Identity(1, "t", "m"), [0])
    calls = []
    server.set_hello_handler(lambda *args: calls.append(args) or HelloAnswer(0, 0))
    try:
        with grpc.insecure_channel(server.address) as channel:
            request = pb.HelloRequest(
                protocol_version=PROTOCOL_VERSION, sender=0, topology_hash="t", model_signature="m"
            )
            setattr(request, field, value)
            if field == "proposed_resume_round":
                request.round = 3
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.GossipStub(channel).Hello(request, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(f"{field}: expected")
        assert calls == []  # the peer never saw it
    finally:
        server.close()


def test_handshake_status_is_failed_precondition():
    server = GrpcTransport(Identity(1, "topo-A", "m"), [0])
    try:
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.GossipStub(channel).Hello(
                    pb.HelloRequest(
                        protocol_version=PROTOCOL_VERSION,
                        sender=0,
                        topology_hash="topo-B",
                        model_signature="m",
                    ),
                    timeout=5,
                )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'topo-B'" in caught.value.details()
        assert "'topo-A'" not in caught.value.details()  # plaintext: ours is not told
    finally:
        server.close()


def test_unreachable_neighbour_times_out_with_clear_error():
    lonely = GrpcTransport(Identity(0, "t", "m"), [1])
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError, match=r"peer 1 at 127\.0\.0\.1:1 "):
            lonely.connect({1: "127.0.0.1:1"}, timeout=1.5)
        assert time.monotonic() - start < 6
    finally:
        lonely.close()


def _refused(sender: GrpcTransport, envelope: Envelope) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        sender.send(1, envelope, time.monotonic() + 10)
    return caught.value


def test_invalid_envelopes_are_refused_with_field_expected_and_actual(grpc_pair):
    a, b = grpc_pair(options=GrpcOptions(max_envelope_bytes=1 << 20))
    good = torch.zeros(4, 3)
    b.inbox.expect("p", (tensor_spec("w", good),))
    cases = [
        (encode_raw("w", torch.zeros(3, 4)), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (
            encode_raw("w", torch.zeros(4, 3, dtype=torch.float64)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dtype",
        ),
        (encode_raw("v", good), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (
            WireTensor("w", "float32", (4, 3), "zstd", bytes(48)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "codec",
        ),
        (
            WireTensor("w", "float32", (4, 3), "raw", bytes(40)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "nbytes",
        ),
        (
            encode_raw("w", torch.full((4, 3), float("nan"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "NaN",
        ),
        (
            WireTensor("w", "float32", (4, 3), "raw", bytes(2 << 20)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "envelope size",
        ),
    ]
    for tensor, code, word in cases:  # all for round 0: each is refused, none is stored
        error = _refused(a, Envelope(0, 0, "p", (tensor,)))
        assert error.code() == code, (word, error.details())
        assert word in error.details()
    # phase nobody expects, wrong protocol version
    assert _refused(a, Envelope(0, 0, "q", (encode_raw("w", good),))).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    error = _refused(a, Envelope(0, 0, "p", (encode_raw("w", good),), protocol_version=7))
    assert (
        error.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "protocol_version" in error.details()
    )
    assert b.inbox.mailbox.pending() == 0  # nothing was stored
    # the channel still works for a valid envelope
    assert a.send(1, Envelope(0, 0, "p", (encode_raw("w", good),)), time.monotonic() + 10) > 0
    assert b.inbox.mailbox.pending() == 1


def test_sender_that_is_not_a_neighbour_is_denied():
    b = GrpcTransport(Identity(1, "t", "m"), [0])
    stranger = GrpcTransport(Identity(5, "t", "m"), [1])
    try:
        b.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
        with pytest.raises(HandshakeError, match="peer 5 is not a neighbour"):
            stranger.connect({1: b.address}, timeout=5)
        chunks = (
            pb.EnvelopeChunk.FromString(c)  # sent through the generated stub, as any client would
            for c in envelope_chunks(Envelope(5, 0, "p", (encode_raw("w", torch.zeros(2)),)))
        )
        with grpc.insecure_channel(b.address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.GossipStub(channel).Push(chunks, timeout=5)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "peer 5 is not a neighbour" in caught.value.details()
        assert b.inbox.mailbox.pending() == 0
    finally:
        b.close()
        stranger.close()


def test_duplicate_and_late_envelopes_are_refused(grpc_pair):
    a, b = grpc_pair()
    spec = (tensor_spec("w", torch.zeros(2)),)
    a.inbox.expect("p", spec)
    b.inbox.expect("p", spec)
    envelope = Envelope(0, 0, "p", (encode_raw("w", torch.ones(2)),))
    a.send(1, envelope, time.monotonic() + 5)
    # plaintext callers are not told which rounds arrived: any refusal by the mailbox reads
    # FAILED_PRECONDITION "not accepted now" (under TLS the code is ALREADY_EXISTS)
    refused = _refused(a, envelope)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not accepted now" in refused.details()
    _exchange_both(a, b, 0, "p", envelope.tensors, envelope.tensors)
    _exchange_both(a, b, 1, "p", envelope.tensors, envelope.tensors)
    late = _refused(a, Envelope(0, 0, "p", envelope.tensors))
    assert late.code() == grpc.StatusCode.FAILED_PRECONDITION and "round" in late.details()
    too_early = _refused(a, Envelope(0, 100, "p", envelope.tensors))  # the sender may retry
    assert too_early.code() == grpc.StatusCode.ABORTED
    assert too_early.details() == "round 100: not accepted yet"


def test_missing_neighbour_fails_the_exchange_within_its_deadline(grpc_pair):
    a, b = grpc_pair()
    for t in (a, b):
        t.inbox.expect("p", (tensor_spec("w", torch.zeros(2)),))
    start = time.monotonic()  # b accepts a's envelope but never sends its own
    result = a.exchange(0, "p", {1: (encode_raw("w", torch.zeros(2)),)}, timeout=0.5)
    assert time.monotonic() - start < 1.5
    assert set(result.failed) == {1} and not result.received
    assert result.failed[1] == "no envelope for round 0 phase 'p' in 0.5 s"
    assert result.bytes_sent[1] > 0


def test_health_service_reports_serving(grpc_pair):
    a, _ = grpc_pair()
    with grpc.insecure_channel(a.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_per_sender_specs_accept_a_matching_envelope(grpc_pair):
    a, b = grpc_pair()
    b.inbox.expect("p", {0: (TensorSpec("w", "float32", (2,), "raw", 8),)})
    assert a.send(1, Envelope(0, 0, "p", (encode_raw("w", torch.zeros(2)),)), time.monotonic() + 5)


def test_single_chunk_push_one_is_validated_like_a_stream(grpc_pair):
    a, b = grpc_pair()
    b.inbox.expect("p", (tensor_spec("w", torch.zeros(4, 3)),))
    bad = Envelope(0, 0, "p", (encode_raw("w", torch.zeros(3, 4)),))
    (chunk,) = envelope_chunks(bad)
    with grpc.insecure_channel(b.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.GossipStub(channel).PushOne(pb.EnvelopeChunk.FromString(chunk), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape: expected (4, 3), got (3, 4)" in caught.value.details()
    assert b.inbox.mailbox.pending() == 0
    # a valid single-chunk exchange (sent on the edge's link) counts the chunk's bytes
    a.inbox.expect("p", (tensor_spec("w", torch.zeros(4, 3)),))
    good = (encode_raw("w", torch.ones(4, 3)),)
    ra, _ = _exchange_both(a, b, 0, "p", good, good)
    assert not ra.failed
    assert ra.bytes_sent[1] == sum(len(c) for c in envelope_chunks(Envelope(0, 0, "p", good)))


def test_wrong_shape_is_refused_and_the_receivers_model_is_bitwise_unchanged():
    """A neighbour sends a wrong-shape model: refused, the peer's round leaves it out, the model is
    bit for bit what it was; the same channel then delivers a valid envelope that is applied."""
    from gossipcomp.gossip import DPSGD
    from gossipcomp.peer import Peer
    from gossipcomp.topology import build_topology
    from gossipcomp.transport.base import HelloAnswer
    from gossipcomp.workload.models import build_mlp, model_signature

    topology = build_topology("ring", n=2)
    model = build_mlp(0, hidden=(8,))
    peer = Peer.over_grpc(model, topology, 1, DPSGD(), bind="127.0.0.1:0", round_timeout=0.5)
    sender = GrpcTransport(Identity(0, topology.hash, model_signature(model)), [1])
    try:
        sender.inbox.expect("model", tuple(tensor_spec(n, p) for n, p in model.named_parameters()))
        sender.inbox.expect("resume", ())
        sender.connect({1: peer.address}, timeout=10)
        peer.start(timeout=10, addresses={0: sender.address})
        before = [p.detach().clone() for p in model.parameters()]
        bad = tuple(
            encode_raw(n, torch.zeros(p.shape[::-1]) if p.ndim == 2 else p.detach())
            for n, p in model.named_parameters()
        )
        error = _refused(sender, Envelope(0, 0, "model", bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in error.details()
        peer.gossip()  # round 0: the neighbour's envelope never arrived, so it is left out
        assert peer.stats.failed_exchanges == {0: 1}
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.detach(), b)
        # the failed edge is left out until it resumes (as a probe would agree, at round 2); then
        # the same channel delivers the next valid envelope
        assert peer.links.resume(0, HelloAnswer(round=1, resume_round=2), peer.round, alone=False)
        peer.gossip()  # round 1: the edge is still resuming, nothing exchanged
        good = tuple(encode_raw(n, torch.ones_like(p)) for n, p in model.named_parameters())
        sender.send(1, Envelope(0, 2, "resume", ()), time.monotonic() + 5)  # both ends are back
        sender.send(1, Envelope(0, 2, "model", good), time.monotonic() + 5)
        peer.gossip()  # round 2: the edge is back; applied, x <- x + 1/2 (1 - x)
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.allclose(p.detach(), b + 0.5 * (1 - b), atol=1e-6)
    finally:
        sender.close()
        peer.close()


def test_an_exchange_whose_pushes_never_started_leaves_no_coroutine_behind(grpc_pair):
    """With the event loop busy past the exchange's deadline, its batch of pushes is cancelled
    before the loop starts it. The pushes were coroutines made up front, and each one warned
    "coroutine ... was never awaited" when collected (seen in CI when a transport closed
    mid-exchange); now none is made until the batch runs, and the push is reported late."""
    import asyncio
    import gc
    import warnings

    a, _ = grpc_pair()
    payload = (encode_raw("x", torch.ones(4)),)
    a.inbox.expect("p", (tensor_spec("x", torch.ones(4)),))

    async def hold_the_loop() -> None:
        time.sleep(1.0)  # blocks the loop thread: nothing queued behind it starts meanwhile

    held = a._loop.submit(hold_the_loop())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = a.exchange(0, "p", {1: payload}, timeout=0.2)
        held.result(timeout=10)
        a._loop.run(asyncio.sleep(0.05))  # the cancelled batch is gone from the loop
        gc.collect()
    assert result.failed[1] == "push not finished within 0.2 s"
    assert not [w for w in caught if "never awaited" in str(w.message)], caught
