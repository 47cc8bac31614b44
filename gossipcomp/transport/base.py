"""What the transport layer moves and promises: named tensors, envelopes, and the Transport protocol.

The transport moves named payloads between neighbours and knows no algorithm. A gossip algorithm
hands it one payload per neighbour for a (round, phase) and gets back what each neighbour sent for
that same (round, phase), plus the neighbours that failed to deliver in time.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# 2: envelopes of one chunk travel on Gossip.Link, which a peer of version 1 does not serve (so
# the handshake refuses the mix instead of every small push failing after it)
PROTOCOL_VERSION = 2
RAW_CODEC = "raw"
MAX_WIRE_ROUND = 2**53  # rounds on the wire lie in [0, MAX_WIRE_ROUND): exact in a float too
MAX_SCHEDULE_EPOCH = 2**31 - 1  # schedule versions on the wire lie in [0, MAX_SCHEDULE_EPOCH]
# the smallest envelope data the gRPC transport sends on its bulk lane (transport/bulk_lane.py):
# its extra round trips and connection cost as much as gRPC's copies at 4 MiB; from 8 MiB it is
# faster, between processes and within one (docs/benchmarks.md, "the bulk lane"). Here, not
# with the transport's options, so that a command line can name it without loading gRPC
DEFAULT_BULK_LANE_BYTES = 8 << 20


@dataclass(frozen=True)
class WireTensor:
    """One named tensor as it travels: its decoded dtype and shape, the codec and the bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    data: bytes | bytearray | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data) if not isinstance(self.data, memoryview) else self.data.nbytes


Payload = tuple[WireTensor, ...]
Outgoing = Mapping[int, Payload]  # what one exchange sends: a payload per neighbour


@dataclass(frozen=True)
class LevelNotice:
    """A link's compression level and the round from which both ends of the edge use it: what
    the lower-ranked end announces in its envelopes when peers set levels without a
    coordinator (levels/notices.py checks one at receipt)."""

    level: int
    effective_round: int


@dataclass(frozen=True)
class NoticeRules:
    """The level notices a receiver accepts: a level in `levels` (the algorithm's ladder), an
    effective round after the envelope's and at most `lead` rounds after it. `own_levels`
    (broadcasting algorithms): a notice sets its sender's own level, so any neighbour may send
    one (otherwise only the lower-ranked end of the edge), and in an envelope of
    `in_force_phase` it states the level in force at the envelope's round (effective round
    equal to it)."""

    levels: frozenset[int]
    lead: int
    own_levels: bool = False
    in_force_phase: str | None = None


@dataclass(frozen=True)
class Envelope:
    """A payload together with who sent it, for which round and phase, under which schedule."""

    sender: int
    round: int
    phase: str
    tensors: Payload
    schedule_epoch: int = 0
    protocol_version: int = PROTOCOL_VERSION
    # per tensor, what the spec's decoder made of it at receipt (None for raw tensors): a
    # compressed payload is validated by decoding it, and the algorithm uses that result
    decoded: tuple[object, ...] = ()
    notice: LevelNotice | None = None  # the sender's announced level for this edge, if any

    def tensor(self, name: str) -> WireTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"envelope from peer {self.sender} has no tensor named {name!r}")


# (payload bytes, sender, round) -> the decoded value; raises ValueError naming what is wrong
PayloadDecoder = Callable[[memoryview, int, int], object]


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects of one incoming tensor; checked before anything is used.

    `decode`, for codecs other than raw, decodes the payload, which validates its own layout
    (indices, scales, padding, values), and raises ValueError naming the problem; the transport
    refuses the envelope then. What it returns travels with the envelope (`Envelope.decoded`),
    so nothing is decoded twice.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    nbytes: int
    require_finite: bool = True
    decode: PayloadDecoder | None = None


PayloadSpec = tuple[TensorSpec, ...]


class RejectCode(enum.Enum):
    """Why an incoming envelope was refused; maps one to one onto gRPC status codes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    ABORTED = "ABORTED"  # not yet: the receiver is behind; the sender may push it again


class EnvelopeRejected(Exception):
    """An incoming envelope failed validation; the message names field, expected and actual.

    `public` is what may be told to a caller that is not authenticated: the same, less
    anything about this peer's state (its round), which a stranger could use to forge
    envelopes for the rounds to come. Defaults to the message itself."""

    def __init__(self, code: RejectCode, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.public = message if public is None else public


class HandshakeError(RuntimeError):
    """A neighbour speaks another protocol version, topology or model."""


class PeerUnreachableError(RuntimeError):
    """Neighbours could not be reached within the start-up timeout."""


class PeerNotReady(RuntimeError):
    """A handshake reached a peer that is still restoring its checkpoint: try again later."""


@dataclass(frozen=True)
class Identity:
    """What two peers must agree on before exchanging anything (checked by the Hello handshake)."""

    rank: int
    topology_hash: str
    model_signature: str
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class HelloAnswer:
    """A neighbour's answer to a handshake: its round, the round at which the edge resumes
    (0 when nothing needs resuming: both ends start fresh), and whether it is alone."""

    round: int
    resume_round: int
    alone: bool = False  # the answering peer has no live edge: it adopts the asker's round
    schedule_epoch: int = 0  # the newest schedule epoch the answering peer has


@dataclass(frozen=True)
class Greeting:
    """What a peer tells each neighbour when it connects: its `round` (non-zero when restored
    from a checkpoint), `proposals` (neighbour -> the round at which it asks to resume their
    edge), and `alone`: it has no live edge (restored), so its round is not to be followed.
    `among`: the neighbours to greet (None: every one); a live topology greets the members
    only, and the others' edges come up later by probes (topology/members.py)."""

    round: int = 0
    proposals: Mapping[int, int] = field(default_factory=dict)
    alone: bool = False
    among: frozenset[int] | None = None


HelloHandler = Callable[[int, int, int, bool, int], HelloAnswer]
"""Answers an incoming handshake: (sender, sender's round, proposed resume round, whether the
sender is alone, the sender's newest schedule epoch) -> answer."""


def no_rejoin(sender: int, round: int, proposed: int, alone: bool, epoch: int) -> HelloAnswer:
    """The handler of a transport whose peer never resumes edges (plain handshake only)."""
    return HelloAnswer(0, 0)


@dataclass
class ExchangeResult:
    """Outcome of one exchange: what arrived, who failed, and the serialised bytes per link."""

    received: dict[int, Envelope] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    # neighbours whose envelope was sent under another schedule epoch (also in `failed`)
    epoch_mismatches: list[int] = field(default_factory=list)
    # per neighbour whose push succeeded: seconds from the exchange's start until it had what
    # this peer sent (one link's speed, whatever the others do: the rate controller's input)
    send_seconds: dict[int, float] = field(default_factory=dict)


def epoch_mismatch(round: int, theirs: int, mine: int) -> str:
    """Why an exchange with a neighbour failed when its envelope came under another epoch."""
    return (
        f"round {round}: the neighbour sent under schedule epoch {theirs}, this peer uses "
        f"epoch {mine} (schedules not applied at the same round)"
    )
