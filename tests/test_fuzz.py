"""Fuzzing a live peer with random and mutated envelopes over real gRPC.

Whatever arrives, the peer never fails unexpectedly (no UNKNOWN or INTERNAL status: every
refusal carries one of the documented codes), never stores anything that breaks its spec, and
keeps serving a valid neighbour afterwards. A mutation that happens to give a valid envelope
(a flipped bit inside a float, say) may be accepted: telling it from an honest message is what
signatures are for.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from conftest import run_in_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipcomp.compress import parse_spec
from gossipcomp.compress.base import CompressionContext
from gossipcomp.gossip.grouping import to_wire
from gossipcomp.gossip.merged import MergedCodec
from gossipcomp.transport.base import PROTOCOL_VERSION, Envelope, Identity
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcTransport
from gossipcomp.transport.wire import envelope_chunks, read_envelope

REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,  # a round beyond the window: not yet
}
WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)
TOPK = parse_spec("topk:ratio=0.25")
COMPRESSED_PARAMS = [("w", torch.zeros(40))]


def _valid_chunks() -> list[list[bytes]]:
    raw = Envelope(0, 0, "model", (encode_raw("w", WEIGHT),))
    packed = TOPK.compress(torch.randn(40), CompressionContext(0, 0, -1, 0, 0))
    compressed = Envelope(0, 0, "choco0", (to_wire("w", packed),))
    return [list(envelope_chunks(raw, 16)), list(envelope_chunks(compressed, 1 << 20))]


@pytest.fixture(scope="module")
def live_peer():
    receiver = GrpcTransport(Identity(1, "t", "m"), [0])
    sender = GrpcTransport(Identity(0, "t", "m"), [1])
    for transport in (receiver, sender):
        transport.inbox.expect("model", (tensor_spec("w", WEIGHT),))
        transport.inbox.expect("choco0", MergedCodec(COMPRESSED_PARAMS, TOPK, 0, 0).spec(int))
    sender.connect({1: receiver.address}, timeout=10)
    receiver.connect({0: sender.address}, timeout=10)
    channel = grpc.insecure_channel(receiver.address)
    push = channel.stream_unary(f"/{SERVICE_NAME}/Push")
    push_one = channel.unary_unary(f"/{SERVICE_NAME}/PushOne")
    yield receiver, sender, push, push_one
    channel.close()
    sender.close()
    receiver.close()


def _deliver(push, push_one, chunks: list[bytes]) -> None:
    try:
        if len(chunks) == 1:
            push_one(chunks[0], timeout=5)
        else:
            push(iter(chunks), timeout=5)
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (error.code(), error.details())


def _stored_envelopes_are_valid(receiver: GrpcTransport) -> None:
    """Everything in the mailbox matches its spec: re-reading it passes every check."""
    mailbox = receiver.inbox.mailbox
    for envelope, _ in list(mailbox._items.values()):
        read_envelope(envelope_chunks(envelope), receiver.inbox.check_header)
        if envelope.phase == "model":
            assert torch.isfinite(decode_raw(envelope.tensors[0])).all()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_random_bytes_are_refused_cleanly(live_peer, data):
    receiver, _, push, push_one = live_peer
    _deliver(push, push_one, data)
    _stored_envelopes_are_valid(receiver)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.integers(0, 1),
    chunk=st.integers(0, 10),
    position=st.integers(0, 10_000),
    byte=st.integers(0, 255),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    extra=st.binary(max_size=8),
)
def test_mutated_envelopes_are_refused_or_valid(
    live_peer, which, chunk, position, byte, cut, extra
):
    receiver, _, push, push_one = live_peer
    chunks = [bytearray(c) for c in _valid_chunks()[which]]
    target = chunks[chunk % len(chunks)]
    target[position % len(target)] = byte
    if cut is not None:
        del target[cut % (len(target) + 1) :]
    target += extra
    _deliver(push, push_one, [bytes(c) for c in chunks])
    _stored_envelopes_are_valid(receiver)


def _flipped_valid_message(position_and_byte: tuple[int, int]) -> bytes:
    """The single-chunk valid envelope with one byte set."""
    position, byte = position_and_byte
    (message,) = _valid_chunks()[1]
    mutated = bytearray(message)
    mutated[position % len(mutated)] = byte
    return bytes(mutated)


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    messages=st.lists(
        st.one_of(
            st.binary(max_size=300),
            st.tuples(st.integers(0, 10_000), st.integers(0, 255)).map(_flipped_valid_message),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_random_messages_on_one_link_are_each_answered_and_refused_cleanly(live_peer, messages):
    """Any messages on one open link: each gets its own answer, in order (the link never goes
    quiet or breaks), every refusal carries a documented code, and nothing stored breaks its
    spec."""
    from gossipcomp.proto.v1 import gossip_pb2 as pb
    from gossipcomp.transport.edge_stream import MAX_LINK_DETAILS

    receiver = live_peer[0]
    with grpc.insecure_channel(receiver.address) as channel:
        link = channel.stream_stream(
            f"/{SERVICE_NAME}/Link", response_deserializer=pb.LinkReply.FromString
        )
        replies = list(link(iter(messages), timeout=10))
    assert len(replies) == len(messages)
    for reply in replies:
        if reply.status:
            assert _BY_NUMBER.get(reply.status) in REFUSALS, reply
            assert len(reply.details) <= MAX_LINK_DETAILS
        else:
            assert reply.received_bytes > 0
    _stored_envelopes_are_valid(receiver)


def test_peer_still_serves_a_valid_neighbour_after_fuzzing(live_peer):
    receiver, sender, _, _ = live_peer
    for transport in (receiver, sender):  # a fresh round far from anything the fuzzing sent
        transport.inbox.mailbox.open_round(1000)
    payload = (encode_raw("w", WEIGHT * 2),)
    results = run_in_threads(
        [
            lambda: sender.exchange(1000, "model", {1: payload}, 10),
            lambda: receiver.exchange(1000, "model", {0: (encode_raw("w", WEIGHT),)}, 10),
        ]
    )
    assert not results[0].failed and not results[1].failed
    assert torch.equal(decode_raw(results[1].received[0].tensor("w")), WEIGHT * 2)


@pytest.fixture(scope="module")
def greeted_peer():
    """Peer 1 of a ring3 over real gRPC, its handshakes answered by a real LinkMonitor."""
    from gossipcomp.peer.links import LinkMonitor

    receiver = GrpcTransport(Identity(1, "t", "m"), [0, 2])
    monitor = LinkMonitor(1, [0, 2])
    receiver.set_hello_handler(lambda s, r, p, a, e: monitor.answer_hello(s, r, p, a, 10))
    channel = grpc.insecure_channel(receiver.address)
    hello = channel.unary_unary(f"/{SERVICE_NAME}/Hello")
    yield receiver, monitor, hello
    channel.close()
    receiver.close()


INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    version=st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 2**32 - 1)),
    sender=st.integers(-(2**31), 2**31 - 1),
    topology_hash=st.one_of(st.just("t"), st.text(max_size=50)),
    round=INT64,
    proposed=INT64,
    alone=st.booleans(),
    garbage=st.one_of(st.none(), st.binary(max_size=200)),
)
def test_random_hellos_are_refused_cleanly_and_never_move_rounds_out_of_bounds(
    greeted_peer, version, sender, topology_hash, round, proposed, alone, garbage
):
    """Any handshake, well-formed or not, is answered or refused with a documented code (never
    UNKNOWN: a round of 2^63-1 once failed the handler after it had been adopted), and no
    agreed resume round ever lies beyond what the peer believes plus the largest margin."""
    from gossipcomp.peer.links import MAX_RESUME_MARGIN
    from gossipcomp.proto.v1 import gossip_pb2 as pb

    receiver, monitor, hello = greeted_peer
    if garbage is not None:
        request = garbage
    else:
        request = pb.HelloRequest(
            protocol_version=version,
            sender=sender,
            topology_hash=topology_hash,
            model_signature="m",
            round=round,
            proposed_resume_round=proposed,
            alone=alone,
        ).SerializeToString()
    try:
        hello(request, timeout=5)
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (error.code(), error.details())
        assert len(error.details()) < 500
    for j in (0, 2):
        link = monitor._links[j]
        assert 0 <= link.resume_round <= monitor.plausible_round(j) + MAX_RESUME_MARGIN
