"""Every RPC of every service in protos/ (and the health service) meets boundary and hostile
values of each of its fields with a clean refusal or a bounded effect (issue 23).

The calls are built from the descriptors of the generated stubs, so an RPC or a field added to
a .proto is walked the day it is added. For each method's request, each field in turn (nested
messages one level down) takes 0, -1, 2^31-1, 2^63-1 (what its type can hold), NaN and inf for
floats, a 1 MiB string or bytes, 100,000 repeated elements. Every call must end within its
deadline with success or a status other than INTERNAL or UNKNOWN (those mean the server did
not check what it got) or DEADLINE_EXCEEDED (the client's own deadline, short enough that a
handler that hangs shows here: an honest answer comes well within it on a loaded machine), and
both servers must still answer their health checks afterwards. The effect is bounded too: the
peer's round, links and schedules and the coordinator's lead round, epochs and published
schedules are unchanged or within their bounds after the walk. Real servers on loopback: a
peer's GrpcTransport server before start() and, with its neighbours, after (where handshakes
meet a running peer: parked edges, resume offers, schedule fetches), and a coordinator's; the
started peers then gossip with every neighbour heard within a few rounds.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from conftest import run_in_threads
from google.protobuf import descriptor as d
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from torch import nn

import gossipcomp.proto.v1 as stubs
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.gossip import DPSGD
from gossipcomp.peer import Peer
from gossipcomp.peer.links import MAX_RESUME_MARGIN, RESUME_MARGIN, LinkState
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.schedule.schedule import MAX_STAGED
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION
from gossipcomp.transport.edge_stream import LinkRefusal, delivered_bytes

RING3 = build_topology("ring", n=3)
# INTERNAL/UNKNOWN: the server did not check what it got; DEADLINE_EXCEEDED: it hung
BAD_STATUS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
HUGE = 1 << 20  # bytes of an oversized string or bytes field
MANY = 100_000  # elements of a huge repeated field
CALL_TIMEOUT = 5.0  # seconds: a hang fails fast, an honest answer on 2 busy cores makes it

_INTS = {
    d.FieldDescriptor.TYPE_INT32: (0, -1, 2**31 - 1, -(2**31)),
    d.FieldDescriptor.TYPE_SINT32: (0, -1, 2**31 - 1, -(2**31)),
    d.FieldDescriptor.TYPE_SFIXED32: (0, -1, 2**31 - 1),
    d.FieldDescriptor.TYPE_INT64: (0, -1, 2**31 - 1, 2**63 - 1, -(2**63)),
    d.FieldDescriptor.TYPE_SINT64: (0, -1, 2**63 - 1, -(2**63)),
    d.FieldDescriptor.TYPE_SFIXED64: (0, -1, 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT32: (0, 2**31 - 1, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, 2**63 - 1, 2**64 - 1),
    d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 3.4e38)


def _values(field: d.FieldDescriptor) -> list[Any]:
    """Boundary and hostile values of one scalar field."""
    kind = field.type
    if kind in _INTS:
        return list(_INTS[kind])
    if kind in (d.FieldDescriptor.TYPE_DOUBLE, d.FieldDescriptor.TYPE_FLOAT):
        return list(_FLOATS)
    if kind == d.FieldDescriptor.TYPE_BOOL:
        return [True]
    if kind == d.FieldDescriptor.TYPE_STRING:
        return ["", "x" * HUGE, "\u00e9\u0000" * 8]
    if kind == d.FieldDescriptor.TYPE_BYTES:
        return [b"", b"\xff" * HUGE]
    if kind == d.FieldDescriptor.TYPE_ENUM:
        return [v.number for v in field.enum_type.values] + [2**31 - 1]
    raise AssertionError(f"field {field.full_name}: type {kind} not walked; add it here")


def _set(message: Message, field: d.FieldDescriptor, value: Any) -> None:
    if field.is_repeated:
        getattr(message, field.name).append(value)
    else:
        setattr(message, field.name, value)


def _variants(
    descriptor: d.Descriptor, bases: dict[str, Message], depth: int = 0
) -> Iterator[tuple[str, Message]]:
    """(what, message) for every hostile value of every field, nested messages one level;
    each starts from the valid base of its type where there is one (so the value reaches the
    checks past identity), and from an empty message."""
    cls = GetMessageClass(descriptor)
    base = bases.get(descriptor.full_name)

    def start() -> Message:
        message = cls()
        if base is not None:
            message.CopyFrom(base)
        return message

    yield "empty", cls()
    if base is not None:
        yield "valid", start()
    for field in descriptor.fields:
        repeated = field.is_repeated
        if field.type == d.FieldDescriptor.TYPE_MESSAGE:
            if depth >= 1:
                continue
            for what, child in _variants(field.message_type, bases, depth + 1):
                message = start()
                message.ClearField(field.name)
                if repeated:
                    getattr(message, field.name).append(child)
                else:
                    getattr(message, field.name).CopyFrom(child)
                yield f"{field.name}.{what}", message
            if repeated:
                message = start()
                message.ClearField(field.name)
                getattr(message, field.name).extend(
                    GetMessageClass(field.message_type)() for _ in range(MANY)
                )
                yield f"{field.name} x {MANY}", message
            continue
        for value in _values(field):
            message = start()
            message.ClearField(field.name)
            _set(message, field, value)
            yield f"{field.name}={str(value)[:20]}", message
        if repeated:
            message = start()
            message.ClearField(field.name)
            first = _values(field)[-1]
            if isinstance(first, str | bytes):
                first = first[:8]
            getattr(message, field.name).extend([first] * MANY)
            yield f"{field.name} x {MANY}", message


def _services() -> list[d.ServiceDescriptor]:
    found = []
    for module in pkgutil.iter_modules(stubs.__path__):
        if module.name.endswith("_pb2"):
            loaded = importlib.import_module(f"{stubs.__name__}.{module.name}")
            found.extend(loaded.DESCRIPTOR.services_by_name.values())
    found.extend(health_pb2.DESCRIPTOR.services_by_name.values())
    return found


def _call(channel: grpc.Channel, method: d.MethodDescriptor, request: Message) -> None:
    """One call; raises grpc.RpcError on a refusal. A server stream is read for one message;
    a refusal answered on a stream that stays open (Link's LinkReply.status) counts as one."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    reply = GetMessageClass(method.output_type).FromString
    send = type(request).SerializeToString
    if method.client_streaming and method.server_streaming:
        stream = channel.stream_stream(path, send, reply)(iter([request]), timeout=CALL_TIMEOUT)
        answer = next(stream, None)
        stream.cancel()
        if method.output_type.full_name == "gossipcomp.v1.LinkReply":
            if answer is None:  # every envelope on a link is answered, refused or not
                raise LinkRefusal(grpc.StatusCode.UNKNOWN, "link ended without an answer")
            delivered_bytes(answer, 0)
    elif method.client_streaming:
        channel.stream_unary(path, send, reply)(iter([request]), timeout=CALL_TIMEOUT)
    elif method.server_streaming:
        stream = channel.unary_stream(path, send, reply)(request, timeout=CALL_TIMEOUT)
        next(stream, None)
        stream.cancel()
    else:
        channel.unary_unary(path, send, reply)(request, timeout=CALL_TIMEOUT)


def _bases(peer: Peer) -> dict[str, Message]:
    """Valid requests of each type (by message full name), as neighbour 0 would send them."""
    hello = pb.HelloRequest(
        protocol_version=PROTOCOL_VERSION,
        sender=0,
        topology_hash=RING3.hash,
        model_signature=peer.signature,
    )
    header = pb.EnvelopeHeader(
        protocol_version=PROTOCOL_VERSION, sender=0, round=0, phase="model", schedule_epoch=0
    )
    report = cpb.PeerReport(
        protocol_version=PROTOCOL_VERSION,
        sender=0,
        topology_hash=RING3.hash,
        model_signature=peer.signature,
        tensors=[cpb.TensorSize(name=name, numel=t.numel()) for name, t in peer.gossiped],
    )
    return {
        hello.DESCRIPTOR.full_name: hello,
        header.DESCRIPTOR.full_name: header,
        pb.EnvelopeChunk.DESCRIPTOR.full_name: pb.EnvelopeChunk(header=header),
        report.DESCRIPTOR.full_name: report,
    }


@dataclass
class Served:
    """The servers walked: service full name -> address, valid requests by type, and the
    objects whose state the walk must leave bounded."""

    addresses: dict[str, str]
    bases: dict[str, Message]
    peer: Peer
    coordinator: Coordinator


def _peer(rank: int) -> Peer:
    torch.manual_seed(rank)
    return Peer.over_grpc(
        nn.Sequential(nn.Linear(4, 2)), RING3, rank, DPSGD(), bind="127.0.0.1:0", round_timeout=2.0
    )


@pytest.fixture(scope="module")
def servers() -> Iterator[Served]:
    """A peer that was never started, and a coordinator."""
    peer = _peer(1)
    coordinator = Coordinator(RING3, report_every=2)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    try:
        addresses = {
            "gossipcomp.v1.Gossip": peer.address,
            "gossipcomp.v1.Coordinator": server.address,
            "grpc.health.v1.Health": peer.address,
            "grpc.health.v1.Health@coordinator": server.address,
        }
        yield Served(addresses, _bases(peer), peer, coordinator)
    finally:
        server.stop()
        peer.close()


def _walk(address: str, service: d.ServiceDescriptor, bases: dict[str, Message]) -> list[str]:
    """Every method of `service` at `address` with every hostile request: the calls that ended
    in a bad status; then the server must still answer its health check."""
    bad = []
    with grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        for method in service.methods:
            for what, request in _variants(method.input_type, bases):
                try:
                    _call(channel, method, request)
                except grpc.RpcError as error:
                    if error.code() in BAD_STATUS:
                        bad.append(f"{method.name} {what}: {error.code().name}")
        health = GetMessageClass(health_pb2.HealthCheckResponse.DESCRIPTOR)
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            health_pb2.HealthCheckRequest.SerializeToString,
            health.FromString,
        )
        assert check(health_pb2.HealthCheckRequest(), timeout=5).status == 1  # SERVING
    return bad


def _assert_peer_state_bounded(peer: Peer, round: int) -> None:
    """What hostile calls may change at a peer: no round, no schedule, no parameter, and an
    edge's resume round only within what a neighbour's claim can be believed to (links.py:
    its plausible round, from the time since both were in step) plus the largest margin."""
    assert peer.round == round
    assert peer.schedules.newest.epoch == 0 and not peer.schedules.staged
    assert [p for _, p in peer.gossiped if not torch.isfinite(p).all()] == []
    for j in RING3.neighbors(peer.rank):
        state = peer.links.state(j)
        assert state in (LinkState.UP, LinkState.RESUMING, LinkState.DOWN), state
        if state is LinkState.RESUMING:
            bound = max(round, peer.links.plausible_round(j)) + MAX_RESUME_MARGIN
            assert peer.links._links[j].resume_round <= bound  # noqa: SLF001


def test_every_service_in_protos_has_a_server_here(servers):
    """A service added to protos/ without a server in this walk fails here first."""
    assert {s.full_name for s in _services()} <= set(servers.addresses)
    assert {"Hello", "Push", "PushOne", "Link", "Schedules"} <= {
        m.name for s in _services() if s.full_name == "gossipcomp.v1.Gossip" for m in s.methods
    }


@pytest.mark.parametrize("service", _services(), ids=lambda s: s.full_name)
def test_hostile_values_of_every_field_are_refused_cleanly(service, servers):
    addresses = [servers.addresses[service.full_name]]
    if service.full_name == "grpc.health.v1.Health":
        addresses.append(servers.addresses["grpc.health.v1.Health@coordinator"])
    bad = []
    for address in addresses:
        bad += _walk(address, service, servers.bases)
    assert not bad, bad[:20]
    _assert_peer_state_bounded(servers.peer, 0)
    coordinator = servers.coordinator
    # one rank's reports (the walk sends as rank 0) decide nothing: no majority model, so no
    # plan and no schedule; a claimed round or epoch is believed only within its bound
    assert len(coordinator.published) == 0
    assert coordinator._lead <= coordinator.margin  # noqa: SLF001
    assert coordinator._highest_epoch <= MAX_STAGED  # noqa: SLF001


def test_a_running_peer_meets_every_hostile_value_with_a_bounded_effect():
    """The Gossip service of a started peer (its neighbours started too) walked as above: its
    handshakes reach `would_park`, `offer_resume` and schedule fetches. Afterwards nothing
    moved beyond its bound, and within RESUME_MARGIN + 3 rounds every peer gossips with both
    neighbours again."""
    peers = [_peer(r) for r in range(3)]
    try:
        addresses = {p.rank: p.address for p in peers}
        run_in_threads([lambda p=p: p.start(10, addresses) for p in peers])
        for _ in range(2):  # a running peer: past round 0, its edges have exchanged
            run_in_threads([p.gossip for p in peers])
        target, round = peers[1], peers[1].round
        gossip = next(s for s in _services() if s.full_name == "gossipcomp.v1.Gossip")
        health = next(s for s in _services() if s.full_name == "grpc.health.v1.Health")
        bases = _bases(target)
        bad = _walk(target.address, gossip, bases) + _walk(target.address, health, bases)
        assert not bad, bad[:20]
        for peer in peers:
            _assert_peer_state_bounded(peer, round)
        heard = []
        for _ in range(RESUME_MARGIN + 3):
            run_in_threads([p.gossip for p in peers])
            heard.append([not p.alone and len(p.links.live()) == 2 for p in peers])
        assert heard[-1] == [True] * 3, heard
    finally:
        for peer in peers:
            peer.close()
