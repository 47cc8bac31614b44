"""Signed envelopes and handshakes over real gRPC with mutual TLS: every refusal the issue lists
(unknown key, bad signature, altered data, stale timestamp, replayed nonce, a peer speaking for
another, no proof at all) is refused with its code, and nothing refused reaches the mailbox."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from conftest import run_in_threads
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gossipcomp.cli import main
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.proto.v1 import gossip_pb2_grpc as pb_grpc
from gossipcomp.security import (
    PeerKeys,
    TlsFiles,
    channel_credentials,
    public_key_text,
    throwaway_certificates,
)
from gossipcomp.transport.authentication import Authenticator
from gossipcomp.transport.base import (
    PROTOCOL_VERSION,
    Envelope,
    EnvelopeRejected,
    HandshakeError,
    Identity,
)
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport
from gossipcomp.transport.wire import content_sha256, envelope_chunks, header_of, with_header

RANKS = (0, 1, 2)  # peer 1 in the middle: neighbours 0 and 2, as on a ring
PRIVATE = {r: Ed25519PrivateKey.generate() for r in RANKS}
PUBLIC = {r: key.public_key() for r, key in PRIVATE.items()}
SPEC = (tensor_spec("w", torch.zeros(4)),)


def keys(rank: int) -> PeerKeys:
    return PeerKeys(PRIVATE[rank], PUBLIC)


@pytest.fixture(scope="module")
def tls() -> dict[str, TlsFiles]:
    with throwaway_certificates(["peer0", "peer1", "peer2"]) as files:
        yield files


@pytest.fixture
def receiver(tls):
    """Peer 1 authenticating its neighbours 0 and 2, over mutual TLS."""
    transport = GrpcTransport(
        Identity(1, "topo", "model"), [0, 2], options=GrpcOptions(tls=tls["peer1"], keys=keys(1))
    )
    transport.inbox.expect("p", SPEC)
    yield transport
    transport.close()


def signed_chunks(
    signer: Authenticator, envelope: Envelope, receiver: int = 1, edit=None
) -> list[bytes]:
    """The envelope's chunks with a header signed by `signer` (then changed by `edit`)."""
    header = header_of(envelope)
    signer.prove_envelope(header, receiver, content_sha256(envelope))
    if edit is not None:
        edit(header)
    chunks = list(envelope_chunks(envelope))
    return [with_header(chunks[0], header), *chunks[1:]]


def push(address: str, files: TlsFiles, chunks: list[bytes]) -> tuple[grpc.StatusCode, str]:
    """Push serialised chunks as any client would (the generated stub) over mutual TLS."""
    with grpc.secure_channel(address, channel_credentials(files)) as channel:
        messages = (pb.EnvelopeChunk.FromString(c) for c in chunks)
        try:
            pb_grpc.GossipStub(channel).Push(messages, timeout=10)
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def envelope(sender: int = 0, round: int = 0, value: float = 1.0) -> Envelope:
    return Envelope(sender, round, "p", (encode_raw("w", torch.full((4,), value)),))


EDITS = {
    "protocol_version": lambda h: setattr(h, "protocol_version", h.protocol_version + 1),
    "round": lambda h: setattr(h, "round", h.round + 1),
    "phase": lambda h: setattr(h, "phase", "q"),
    "schedule_epoch": lambda h: setattr(h, "schedule_epoch", 1),
    "tensor name": lambda h: setattr(h.tensors[0], "name", "v"),
    "tensor dtype": lambda h: setattr(h.tensors[0], "dtype", "int32"),
    "tensor shape": lambda h: h.tensors[0].shape.append(1),
    "tensor codec": lambda h: setattr(h.tensors[0], "codec", "sign"),
    "tensor nbytes": lambda h: setattr(h.tensors[0], "nbytes", 15),
    "extra tensor": lambda h: h.tensors.add(name="x", dtype="float32", codec="raw"),
    "timestamp": lambda h: setattr(h.proof, "timestamp_ms", h.proof.timestamp_ms - 1),
    "nonce": lambda h: setattr(h.proof, "nonce", bytes(16)),
    "content digest": lambda h: setattr(h.proof, "content_sha256", bytes(32)),
}


@pytest.mark.parametrize("field", sorted(EDITS))
def test_the_signature_covers_every_header_field(field):
    signer, checker = Authenticator(0, keys(0)), Authenticator(1, keys(1))
    header = header_of(envelope())
    signer.prove_envelope(header, 1, content_sha256(envelope()))
    untouched = pb.EnvelopeHeader()
    untouched.CopyFrom(header)
    Authenticator(1, keys(1)).check_envelope(untouched)  # the signed header passes as it is
    EDITS[field](header)
    with pytest.raises(EnvelopeRejected, match="does not verify with peer 0's key"):
        checker.check_envelope(header)


def test_the_signature_binds_sender_and_receiver():
    signer = Authenticator(0, keys(0))
    header = header_of(envelope())
    signer.prove_envelope(header, 1, content_sha256(envelope()))
    as_peer_2 = pb.EnvelopeHeader()
    as_peer_2.CopyFrom(header)
    as_peer_2.sender = 2  # peer 0's envelope passed off as peer 2's
    with pytest.raises(EnvelopeRejected, match="does not verify with peer 0's key"):
        Authenticator(1, keys(1)).check_envelope(as_peer_2)
    header.proof.receiver = 2  # forwarded to another neighbour of the sender
    with pytest.raises(EnvelopeRejected, match="does not verify with peer 0's key"):
        Authenticator(2, keys(2)).check_envelope(header)


HELLO_EDITS = {
    "sender": lambda r: setattr(r, "sender", 2),
    "topology_hash": lambda r: setattr(r, "topology_hash", "other"),
    "model_signature": lambda r: setattr(r, "model_signature", "other"),
    "round": lambda r: setattr(r, "round", 7),
    "proposed_resume_round": lambda r: setattr(r, "proposed_resume_round", 9),
    "alone": lambda r: setattr(r, "alone", True),
}


@pytest.mark.parametrize("field", sorted(HELLO_EDITS))
def test_the_hello_signature_covers_every_field(field):
    request = pb.HelloRequest(
        protocol_version=PROTOCOL_VERSION, sender=0, topology_hash="t", model_signature="m"
    )
    Authenticator(0, keys(0)).prove_hello(request, 1)
    HELLO_EDITS[field](request)
    with pytest.raises(EnvelopeRejected, match="does not verify with peer 0's key"):
        Authenticator(1, keys(1)).check_hello(request)


def test_a_hello_is_accepted_once_and_a_reply_only_for_its_own_request():
    greeter, answerer = Authenticator(0, keys(0)), Authenticator(1, keys(1))
    first, second = (
        pb.HelloRequest(protocol_version=PROTOCOL_VERSION, sender=0, topology_hash="t")
        for _ in range(2)
    )
    for request in (first, second):
        greeter.prove_hello(request, 1)
    answerer.check_hello(first)
    with pytest.raises(EnvelopeRejected, match="nonce: already used by peer 0"):
        answerer.check_hello(first)  # a replayed handshake
    reply = pb.HelloReply(protocol_version=PROTOCOL_VERSION, receiver=1, topology_hash="t", round=5)
    answerer.prove_reply(reply, first)
    greeter.check_reply(reply, first, 1)
    replayed = pb.HelloReply()
    replayed.CopyFrom(reply)
    with pytest.raises(EnvelopeRejected, match="does not verify with peer 1's key"):
        greeter.check_reply(replayed, second, 1)  # an old reply answering a new request


def test_malformed_proofs_are_refused_before_any_signing_string_is_built(receiver, tls):
    def long_key_id(header: pb.EnvelopeHeader) -> None:
        header.proof.key_id = bytes(100_000)

    def huge_header(header: pb.EnvelopeHeader) -> None:
        header.tensors.add(name="x", dtype="float32", shape=[1] * 65, codec="raw")

    def nbytes_beyond_int64(header: pb.EnvelopeHeader) -> None:
        header.tensors[0].nbytes = 2**64 - 1

    signer = Authenticator(0, keys(0))
    for edit, code, message in (
        (long_key_id, "UNAUTHENTICATED", "proof key_id: 100000 bytes, expected 8"),
        (huge_header, "INVALID_ARGUMENT", "a tensor with 65 dimensions, at most 64"),
        (nbytes_beyond_int64, "UNAUTHENTICATED", "does not verify with peer 0's key"),
    ):
        status, details = _refusal(receiver, tls, signed_chunks(signer, envelope(), edit=edit))
        assert (status.name, message in details) == (code, True), details


def test_signed_exchange_is_bit_exact_and_counts_the_proof_bytes(tls):
    a = GrpcTransport(
        Identity(0, "t", "m"), [1], options=GrpcOptions(tls=tls["peer0"], keys=keys(0))
    )
    b = GrpcTransport(
        Identity(1, "t", "m"), [0], options=GrpcOptions(tls=tls["peer1"], keys=keys(1))
    )
    try:
        run_in_threads(
            [lambda: a.connect({1: b.address}, timeout=10), lambda: b.connect({0: a.address}, 10)]
        )
        x = torch.randn(300_000, generator=torch.Generator().manual_seed(0))  # several chunks
        spec = (tensor_spec("x", x),)
        a.inbox.expect("p", spec)
        b.inbox.expect("p", spec)
        for round in range(3):
            ra, rb = run_in_threads(
                [
                    lambda r=round: a.exchange(r, "p", {1: (encode_raw("x", x),)}, 20),
                    lambda r=round: b.exchange(r, "p", {0: (encode_raw("x", -x),)}, 20),
                ]
            )
            assert not ra.failed and not rb.failed
            assert decode_raw(rb.received[0].tensor("x")).numpy().tobytes() == x.numpy().tobytes()
            assert ra.bytes_sent[1] == rb.bytes_received[0]
        # the proof adds its fields to the header only: key id, time, nonce, digest, signature
        plain = sum(len(c) for c in envelope_chunks(Envelope(0, 2, "p", (encode_raw("x", x),))))
        assert 8 + 16 + 32 + 64 < ra.bytes_sent[1] - plain < 160
    finally:
        a.close()
        b.close()


def test_envelopes_with_a_good_proof_are_stored(receiver, tls):
    status, details = push(
        receiver.address, tls["peer0"], signed_chunks(Authenticator(0, keys(0)), envelope())
    )
    assert status == grpc.StatusCode.OK, details
    assert receiver.inbox.mailbox.pending() == 1


def _refusal(receiver, tls, chunks, files="peer0") -> tuple[grpc.StatusCode, str]:
    status, details = push(receiver.address, tls[files], chunks)
    assert receiver.inbox.mailbox.pending() == 0, "a refused envelope reached the mailbox"
    return status, details


def test_an_envelope_without_a_proof_is_unauthenticated(receiver, tls):
    status, details = _refusal(receiver, tls, list(envelope_chunks(envelope())))
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert "expected a signature by peer 0's key" in details


def test_a_key_not_in_the_topology_is_unauthenticated(receiver, tls):
    stranger = Authenticator(0, PeerKeys(Ed25519PrivateKey.generate(), PUBLIC))
    status, details = _refusal(receiver, tls, signed_chunks(stranger, envelope()))
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert "not the key of any peer in the topology" in details


def test_a_header_changed_after_signing_is_unauthenticated(receiver, tls):
    def later_round(header: pb.EnvelopeHeader) -> None:
        header.round = 1

    chunks = signed_chunks(Authenticator(0, keys(0)), envelope(), edit=later_round)
    status, details = _refusal(receiver, tls, chunks)
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert "does not verify with peer 0's key" in details


def test_data_changed_after_signing_is_unauthenticated(receiver, tls):
    chunks = signed_chunks(Authenticator(0, keys(0)), envelope(value=1.0))
    # same header and proof, other data of the same size: the signed digest no longer matches
    forged = signed_chunks(Authenticator(0, keys(0)), envelope(value=5.0))
    header = pb.EnvelopeChunk.FromString(chunks[0]).header
    status, details = _refusal(receiver, tls, [with_header(forged[0], header)])
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert "SHA-256 of the data received from peer 0 differs" in details


def test_a_stale_timestamp_is_unauthenticated(receiver, tls):
    late = Authenticator(0, keys(0), clock=lambda: time.time() - 120)
    status, details = _refusal(receiver, tls, signed_chunks(late, envelope()))
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert re.search(r"timestamp: 12\d\.\d s in the past", details), details
    assert "expected within ±30 s" in details
    early = Authenticator(0, keys(0), clock=lambda: time.time() + 45)
    status, details = _refusal(receiver, tls, signed_chunks(early, envelope()))
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert re.search(r"4\d\.\d s in the future", details), details


def test_a_replayed_nonce_is_unauthenticated(receiver, tls):
    chunks = signed_chunks(Authenticator(0, keys(0)), envelope())
    assert push(receiver.address, tls["peer0"], chunks)[0] == grpc.StatusCode.OK
    receiver.inbox.mailbox.open_round(1)  # round 0 is over: only the nonce can stop a replay
    status, details = push(receiver.address, tls["peer0"], chunks)
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert "nonce: already used by peer 0" in details
    assert receiver.inbox.mailbox.pending() == 0


def test_a_peer_claiming_another_peers_id_is_denied(receiver, tls):
    # peer 2's key is in the topology and valid, but the envelope claims to be from peer 0
    impostor = Authenticator(2, keys(2))
    status, details = _refusal(receiver, tls, signed_chunks(impostor, envelope(sender=0)), "peer2")
    assert status == grpc.StatusCode.PERMISSION_DENIED
    assert "names peer 0, but peer 2's key signed it" in details


def test_an_envelope_signed_for_another_receiver_is_unauthenticated(receiver, tls):
    chunks = signed_chunks(Authenticator(0, keys(0)), envelope(), receiver=2)
    status, details = _refusal(receiver, tls, chunks)
    assert status == grpc.StatusCode.UNAUTHENTICATED
    assert "signed for peer 2, expected 1" in details


def test_handshakes_are_authenticated_both_ways(receiver, tls):
    # a sender whose key the receiver does not know cannot even handshake
    stranger_keys = PeerKeys(Ed25519PrivateKey.generate(), PUBLIC)
    stranger = GrpcTransport(
        Identity(0, "topo", "model"), [1], options=GrpcOptions(tls=tls["peer0"], keys=stranger_keys)
    )
    impostor = GrpcTransport(  # peer 2's key, claiming rank 0
        Identity(0, "topo", "model"), [1], options=GrpcOptions(tls=tls["peer2"], keys=keys(2))
    )
    plain = GrpcTransport(Identity(0, "topo", "model"), [1], options=GrpcOptions(tls=tls["peer0"]))
    honest = GrpcTransport(
        Identity(0, "topo", "model"), [1], options=GrpcOptions(tls=tls["peer0"], keys=keys(0))
    )
    try:
        with pytest.raises(HandshakeError, match="UNAUTHENTICATED|not the key of any peer"):
            stranger.connect({1: receiver.address}, timeout=5)
        with pytest.raises(HandshakeError, match="names peer 0, but peer 2's key signed it"):
            impostor.connect({1: receiver.address}, timeout=5)
        with pytest.raises(HandshakeError, match="expected a signature by peer 0's key"):
            plain.connect({1: receiver.address}, timeout=5)
        answers = honest.connect({1: receiver.address}, timeout=5)
        assert answers[1].round == 0
        # and the reply is checked: one from a peer holding another key is not accepted
        wrong_view = GrpcTransport(
            Identity(0, "topo", "model"),
            [1],
            options=GrpcOptions(
                tls=tls["peer0"], keys=PeerKeys(PRIVATE[0], {**PUBLIC, 1: PUBLIC[2]})
            ),
        )
        try:
            with pytest.raises(HandshakeError, match="handshake reply from peer 1.*not accepted"):
                wrong_view.connect({1: receiver.address}, timeout=5)
        finally:
            wrong_view.close()
    finally:
        for transport in (stranger, impostor, plain, honest):
            transport.close()


def test_signing_keys_without_tls_refuse_to_start():
    with pytest.raises(ValueError, match="need mutual TLS.*hide nothing"):
        GrpcTransport(Identity(0, "t", "m"), [1], options=GrpcOptions(keys=keys(0)))


def _topology_with_keys(tmp_path: Path, listed: dict[int, str]) -> Path:
    (tmp_path / "allow.yaml").write_text(yaml.safe_dump(listed))
    path = tmp_path / "ring4-keys.yaml"
    path.write_text("kind: ring\nn: 4\nallowlist: allow.yaml\n")
    return path


def _error(capsys) -> str:
    """What the CLI printed to stderr, unwrapped (rich wraps long lines)."""
    return " ".join(capsys.readouterr().err.split())


def test_cli_refuses_authentication_without_tls_and_a_peer_without_its_key(tmp_path, capsys):
    key_file = tmp_path / "peer0-signing-key.pem"
    assert main(["keys", "new", "--out", str(tmp_path), "--ca", "--rank", "0"]) == 0
    assert key_file.is_file()
    topology = tmp_path / "allowlist.yaml"
    listed = yaml.safe_load(topology.read_text())
    listed.update({r: public_key_text(PUBLIC[r % 3]) for r in (1, 2, 3)})
    ring = _topology_with_keys(tmp_path, listed)
    capsys.readouterr()
    assert main(["peer", "--topology", str(ring), "--rank", "0", "--key", str(key_file)]) == 2
    assert "needs mutual TLS (--tls-cert, --tls-key, --tls-ca)" in _error(capsys)
    tls = ["--tls-cert", str(tmp_path / "peer0.pem"), "--tls-key", str(tmp_path / "peer0-key.pem")]
    tls += ["--tls-ca", str(tmp_path / "ca.pem")]
    assert main(["peer", "--topology", str(ring), "--rank", "0", *tls]) == 2
    assert "lists public keys (peers [0, 1, 2, 3])" in _error(capsys)
    # peer 1's entry is not this key
    assert main(["peer", "--topology", str(ring), "--rank", "1", *tls, "--key", str(key_file)]) == 2
    assert "signing key (--key) is not peer 1's" in _error(capsys)
    assert main(["simulate", "--authenticate", "--rounds", "1"]) == 2
    assert "--authenticate needs --tls" in _error(capsys)


def test_keys_new_records_the_public_key_and_never_overwrites(tmp_path, capsys):
    assert main(["keys", "new", "--out", str(tmp_path), "--ca", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    listed = yaml.safe_load((tmp_path / "allowlist.yaml").read_text())
    assert list(listed) == [3] and f"public key of peer3: {listed[3]}" in out
    assert (tmp_path / "peer3-signing-key.pem").stat().st_mode & 0o077 == 0
    assert main(["keys", "new", "--out", str(tmp_path), "--rank", "3"]) == 2
    assert "refusing to overwrite a signing key" in _error(capsys)
    assert main(["keys", "new", "--out", str(tmp_path), "--rank", "3", "--name", "again"]) == 2
    assert "peer 3 already has the key" in _error(capsys)
    assert yaml.safe_load((tmp_path / "allowlist.yaml").read_text()) == listed


def test_simulate_with_authentication_trains(tmp_path):
    report = tmp_path / "report.json"
    argv = ["simulate", "--tls", "--authenticate", "--topology", "ring4", "--rounds", "20"]
    assert main([*argv, "--algorithm", "dpsgd", "--quiet", "--report", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["rounds"] == 20 and result["final_test_accuracy"] > 0.3
    assert all(peer["failed_exchanges"] == 0 for peer in result["per_peer"])
