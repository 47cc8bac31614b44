"""Signed messages between peers: every envelope and handshake proves which peer sent it.

A sender attaches a `SenderProof` (see the .proto): its key id, a timestamp, a fresh nonce, the
receiver's rank, for envelopes the SHA-256 of the data bytes, and an Ed25519 signature of a
signing string. The signing string is built here from the message's fields, never from protobuf
bytes, so it is the same for any implementation:

    domain tag (b"gossipcomp/<kind>/v1\\n"), then each field in order, integers as 8 bytes
    little-endian (unsigned for protocol_version and nbytes, which are unsigned on the wire;
    two's complement for the others), strings and bytes as a 4-byte little-endian length and
    the bytes.

    envelope:  protocol_version, sender, receiver, round, phase, schedule_epoch, tensor count,
               per tensor (name, dtype, ndim, each dim, codec, nbytes), whether a level notice
               is present (0 or 1), its level and effective_round (0 and 0 when absent), then
               the proof's content_sha256, key_id, timestamp_ms, nonce
    hello:     protocol_version, sender, receiver, topology_hash, model_signature, round,
               proposed_resume_round, alone, schedule_epoch, key_id, timestamp_ms, nonce
    reply:     protocol_version, replier, requester, topology_hash, model_signature, round,
               resume_round, alone, schedule_epoch, the request's nonce, key_id,
               timestamp_ms, nonce

A receiver checks, in this order, and refuses with the code given: the proof's fields have their
fixed sizes and an envelope header is within the size limits (before any string is built, so a
stranger's oversized header costs nothing), a proof is present, names a key in the topology, is addressed to it, and its signature verifies (UNAUTHENTICATED); the key is
the claimed sender's (PERMISSION_DENIED: a peer speaking for another); the timestamp is within the
tolerance of its own clock and the nonce has not been seen in that window (UNAUTHENTICATED: a
stale or replayed message). Nonces are remembered only while their timestamps are inside the
window, so memory stays bounded by the message rate. TLS still carries everything: signatures
prove who sent a message but hide nothing.
"""

from __future__ import annotations

import heapq
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature

from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.security.signing_keys import KEY_ID_BYTES, PeerKeys, key_id
from gossipcomp.transport.base import EnvelopeRejected, RejectCode

DEFAULT_CLOCK_TOLERANCE = 30.0  # seconds a message's timestamp may differ from the receiver's clock
NONCE_BYTES = 16
SIGNATURE_BYTES = 64  # Ed25519
DIGEST_BYTES = 32  # SHA-256
MAX_TENSORS = 1 << 16  # per envelope header: far above any model's parameter count
MAX_NDIM = 64  # per tensor, as in torch
_ENVELOPE, _HELLO, _REPLY = (
    b"gossipcomp/%s/v1\n" % kind for kind in (b"envelope", b"hello", b"reply")
)

Clock = Callable[[], float]


class _SigningString:
    """Builds the canonical byte string a signature covers (layout in the module docstring)."""

    def __init__(self, domain: bytes) -> None:
        self._string = bytearray(domain)

    def number(self, *values: int) -> _SigningString:
        self._string += struct.pack(f"<{len(values)}q", *values)
        return self

    def unsigned(self, *values: int) -> _SigningString:
        self._string += struct.pack(f"<{len(values)}Q", *values)
        return self

    def blob(self, *values: bytes | str) -> _SigningString:
        for value in values:
            data = value.encode("utf-8") if isinstance(value, str) else value
            self._string += struct.pack("<I", len(data))
            self._string += data
        return self

    def proof(self, proof: pb.SenderProof) -> bytes:
        self.blob(proof.key_id).number(proof.timestamp_ms).blob(proof.nonce)
        return bytes(self._string)


def _envelope_string(header: pb.EnvelopeHeader) -> bytes:
    proof = header.proof
    string = _SigningString(_ENVELOPE).unsigned(header.protocol_version)
    string.number(header.sender, proof.receiver, header.round).blob(header.phase)
    string.number(header.schedule_epoch, len(header.tensors))
    for tensor in header.tensors:
        string.blob(tensor.name, tensor.dtype).number(len(tensor.shape), *tensor.shape)
        string.blob(tensor.codec).unsigned(tensor.nbytes)
    notice = header.level_notice
    string.number(header.HasField("level_notice"), notice.level, notice.effective_round)
    return string.blob(proof.content_sha256).proof(proof)


def _hello_string(request: pb.HelloRequest) -> bytes:
    string = _SigningString(_HELLO).unsigned(request.protocol_version)
    string.number(request.sender, request.proof.receiver)
    string.blob(request.topology_hash, request.model_signature)
    string.number(request.round, request.proposed_resume_round, request.alone)
    string.number(request.schedule_epoch)
    return string.proof(request.proof)


def _reply_string(reply: pb.HelloReply, request_nonce: bytes) -> bytes:
    string = _SigningString(_REPLY).unsigned(reply.protocol_version)
    string.number(reply.receiver, reply.proof.receiver)
    string.blob(reply.topology_hash, reply.model_signature)
    string.number(reply.round, reply.resume_round, reply.alone, reply.schedule_epoch)
    return string.blob(request_nonce).proof(reply.proof)


class _SeenNonces:
    """Nonces seen from one signer whose timestamps are still inside the tolerance window."""

    def __init__(self) -> None:
        self._expiry: list[tuple[int, bytes]] = []
        self._seen: set[bytes] = set()

    def add(self, nonce: bytes, expires: int, now: int) -> bool:
        """Remember `nonce` until `expires` (ms); False if it was seen already (a replay)."""
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if nonce in self._seen:
            return False
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (expires, nonce))
        return True


class Authenticator:
    """One peer's signer and checker of envelopes and handshakes (thread-safe)."""

    def __init__(
        self,
        rank: int,
        keys: PeerKeys,
        tolerance: float = DEFAULT_CLOCK_TOLERANCE,
        clock: Clock = time.time,
    ) -> None:
        if tolerance <= 0:
            raise ValueError(f"clock tolerance must be > 0 seconds, got {tolerance}")
        self.rank = rank
        self._private = keys.private
        self._public = dict(keys.public)
        self._ranks = {key_id(key): r for r, key in self._public.items()}
        self._key_id = key_id(keys.private.public_key())
        self._tolerance = tolerance
        self._clock = clock
        self._nonces = {r: _SeenNonces() for r in self._public}
        self._lock = threading.Lock()

    # -- sending -------------------------------------------------------------------------------

    def _new_proof(self, proof: pb.SenderProof, receiver: int, content: bytes = b"") -> None:
        proof.key_id = self._key_id
        proof.timestamp_ms = round(self._clock() * 1000)
        proof.nonce = os.urandom(NONCE_BYTES)
        proof.receiver = receiver
        proof.content_sha256 = content

    def prove_envelope(self, header: pb.EnvelopeHeader, receiver: int, content: bytes) -> None:
        """Sign `header` for `receiver`; `content` is the SHA-256 of the envelope's data."""
        self._new_proof(header.proof, receiver, content)
        header.proof.signature = self._private.sign(_envelope_string(header))

    def prove_hello(self, request: pb.HelloRequest, receiver: int) -> None:
        self._new_proof(request.proof, receiver)
        request.proof.signature = self._private.sign(_hello_string(request))

    def prove_reply(self, reply: pb.HelloReply, request: pb.HelloRequest) -> None:
        """Sign a handshake reply, bound to the request it answers (through its nonce)."""
        self._new_proof(reply.proof, request.sender)
        reply.proof.signature = self._private.sign(_reply_string(reply, request.proof.nonce))

    # -- receiving -----------------------------------------------------------------------------

    def check_envelope(self, header: pb.EnvelopeHeader) -> None:
        """Check an envelope header's proof (before any data is read); EnvelopeRejected if not
        valid. The data's digest is checked by `check_content` once the data has arrived."""
        present = header.HasField("proof")
        if present:
            self._check_sizes(header.proof, DIGEST_BYTES)
            self._check_header_size(header)
        self._verify(header.proof, present, header.sender, lambda: _envelope_string(header))

    def check_content(self, header: pb.EnvelopeHeader, digest: bytes) -> None:
        """Refuse an envelope whose data does not hash to the digest its sender signed."""
        if not hmac.compare_digest(digest, header.proof.content_sha256):
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"content: SHA-256 of the data received from peer {header.sender} differs from "
                f"the one it signed (altered in transit?)",
            )

    def check_hello(self, request: pb.HelloRequest) -> None:
        present = request.HasField("proof")
        if present:
            self._check_sizes(request.proof, 0)
        self._verify(request.proof, present, request.sender, lambda: _hello_string(request))

    def check_reply(self, reply: pb.HelloReply, request: pb.HelloRequest, neighbour: int) -> None:
        """Check a handshake reply came from `neighbour` and answers `request`."""
        if reply.receiver != neighbour:
            raise self._refused(
                RejectCode.PERMISSION_DENIED,
                f"reply: names peer {reply.receiver}, expected peer {neighbour}",
            )
        present = reply.HasField("proof")
        if present:
            self._check_sizes(reply.proof, 0)
        nonce = request.proof.nonce
        self._verify(reply.proof, present, neighbour, lambda: _reply_string(reply, nonce))

    def _check_sizes(self, proof: pb.SenderProof, digest_bytes: int) -> None:
        """Refuse a proof whose fields are not their fixed sizes, before anything is built."""
        for field, size in (
            ("key_id", KEY_ID_BYTES),
            ("nonce", NONCE_BYTES),
            ("content_sha256", digest_bytes),
            ("signature", SIGNATURE_BYTES),
        ):
            got = len(getattr(proof, field))
            if got != size and (field != "signature" or got):  # no signature: refused below
                raise self._refused(
                    RejectCode.UNAUTHENTICATED, f"proof {field}: {got} bytes, expected {size}"
                )

    def _check_header_size(self, header: pb.EnvelopeHeader) -> None:
        """Bound the signing string by the header's size: no more tensors or dimensions than any
        model has (the receiver's own spec checks the exact layout after the signature)."""
        if len(header.tensors) > MAX_TENSORS:
            raise self._refused(
                RejectCode.INVALID_ARGUMENT,
                f"header: {len(header.tensors)} tensors, at most {MAX_TENSORS} accepted",
            )
        for tensor in header.tensors:
            if len(tensor.shape) > MAX_NDIM:
                raise self._refused(
                    RejectCode.INVALID_ARGUMENT,
                    f"header: a tensor with {len(tensor.shape)} dimensions, at most {MAX_NDIM}",
                )

    def _verify(
        self, proof: pb.SenderProof, present: bool, sender: int, signed: Callable[[], bytes]
    ) -> None:
        """The checks in the order the module docstring gives; `signed` builds the signing
        string of the message claiming to come from `sender`."""
        if not present or not proof.signature:
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"proof: expected a signature by peer {sender}'s key (this network "
                f"authenticates peers), got none",
            )
        signer = self._ranks.get(bytes(proof.key_id))
        if signer is None:
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"proof key_id {bytes(proof.key_id).hex()}: not the key of any peer in the "
                f"topology (expected one of its public keys)",
            )
        if proof.receiver != self.rank:
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"proof receiver: signed for peer {proof.receiver}, expected {self.rank}",
            )
        try:
            self._public[signer].verify(bytes(proof.signature), signed())
        except InvalidSignature:
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"signature: does not verify with peer {signer}'s key (altered or forged)",
            ) from None
        if signer != sender:
            raise self._refused(
                RejectCode.PERMISSION_DENIED,
                f"sender: the message names peer {sender}, but peer {signer}'s key signed it",
            )
        self._check_fresh(signer, proof)

    def _check_fresh(self, signer: int, proof: pb.SenderProof) -> None:
        now = round(self._clock() * 1000)
        skew = (proof.timestamp_ms - now) / 1000.0
        if abs(skew) > self._tolerance:
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"timestamp: {abs(skew):.1f} s in the {'past' if skew < 0 else 'future'} by "
                f"this peer's clock, expected within ±{self._tolerance:g} s (a stale message, "
                f"or clocks out of sync)",
            )
        expires = proof.timestamp_ms + round(self._tolerance * 1000)
        with self._lock:
            fresh = self._nonces[signer].add(bytes(proof.nonce), expires, now)
        if not fresh:
            raise self._refused(
                RejectCode.UNAUTHENTICATED,
                f"nonce: already used by peer {signer} within the last {self._tolerance:g} s "
                f"(a replayed message)",
            )

    def _refused(self, code: RejectCode, message: str) -> EnvelopeRejected:
        return EnvelopeRejected(code, f"peer {self.rank} refused: {message}")
