"""The transport seam: a transport moves bytes, and what a peer expects, accepts and announces is
one Inbox that every transport exposes (`transport.inbox`); a throttle slows sending only."""

from __future__ import annotations

import inspect

import torch
from conftest import run_in_threads

from gossipcomp.transport import Greeting, Transport
from gossipcomp.transport.base import HelloAnswer, Identity, LevelNotice, NoticeRules
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.throttled import LinkRates, ThrottledTransport

SPEC = (tensor_spec("w", torch.zeros(3)),)


def test_the_transport_protocol_is_how_bytes_move_and_names_its_inbox():
    methods = {
        name
        for name, member in inspect.getmembers(Transport, inspect.isfunction)
        if not name.startswith("_")
    }
    assert methods == {"connect", "set_hello_handler", "probe", "exchange", "close"}
    assert set(Transport.__annotations__) == {"rank", "schedule_epoch", "inbox"}


def test_a_throttle_shares_the_inner_inbox_and_its_notices_reach_the_neighbour():
    """Expectations, rounds and notices set on the throttle's inbox are the inner transport's:
    the neighbour receives the announced notice, and a withdrawn one no longer travels."""
    hub = InMemoryHub()
    inner = InMemoryTransport(Identity(0, "t", "m"), [1], hub)
    throttled = ThrottledTransport(inner, LinkRates(1000.0))
    other = InMemoryTransport(Identity(1, "t", "m"), [0], hub)
    assert throttled.inbox is inner.inbox
    for t in (throttled, other):
        t.inbox.expect("p", SPEC)
    other.inbox.accept_notices(NoticeRules(frozenset({1, 2}), lead=4))
    told: list[tuple[int, int, int, bool]] = []

    def answer(sender: int, round: int, proposed: int, alone: bool, epoch: int) -> HelloAnswer:
        told.append((sender, round, proposed, alone))
        return HelloAnswer(round, 0)

    other.set_hello_handler(answer)
    throttled.set_hello_handler(answer)  # handshakes pass through to the inner transport
    answers = run_in_threads(
        [
            lambda: throttled.connect({}, 1, Greeting(round=3, proposals={1: 9}, alone=True)),
            lambda: other.connect({}, 1, Greeting(round=3)),
        ]
    )
    assert answers == [{1: HelloAnswer(3, 0)}, {0: HelloAnswer(3, 0)}]
    assert sorted(told) == [(0, 3, 9, True), (1, 3, 0, False)]
    payload = (encode_raw("w", torch.ones(3)),)
    throttled.inbox.announce(1, LevelNotice(2, 5))
    sent, received = run_in_threads(
        [
            lambda: throttled.exchange(3, "p", {1: payload}, 5),
            lambda: other.exchange(3, "p", {0: payload}, 5),
        ]
    )
    assert not sent.failed and not received.failed
    assert received.received[0].notice == LevelNotice(2, 5)
    assert sent.received[1].notice is None  # the neighbour announced nothing
    throttled.inbox.announce(1, None)
    _, received = run_in_threads(
        [
            lambda: throttled.exchange(4, "p", {1: payload}, 5),
            lambda: other.exchange(4, "p", {0: payload}, 5),
        ]
    )
    assert received.received[0].notice is None


def test_a_greeting_round_opens_the_inbox_there():
    """Connecting with a restored round opens the inbox at it: an envelope for an earlier
    round is refused as late, whichever transport it came through."""
    hub = InMemoryHub()
    a = InMemoryTransport(Identity(0, "t", "m"), [1], hub)
    b = ThrottledTransport(InMemoryTransport(Identity(1, "t", "m"), [0], hub), LinkRates(1000.0))
    for t in (a, b):
        t.inbox.expect("p", SPEC)
    run_in_threads([lambda: a.connect({}, 1), lambda: b.connect({}, 1, Greeting(round=7))])
    result = a.exchange(6, "p", {1: (encode_raw("w", torch.ones(3)),)}, 0.2)
    assert "earlier rounds are finished" in result.failed[1]


def test_the_grpc_names_keep_their_old_import_path():
    from gossipcomp.transport import grpc_options, grpc_service, grpc_transport

    assert grpc_transport.GrpcOptions is grpc_options.GrpcOptions
    assert grpc_transport.is_loopback is grpc_options.is_loopback
    assert grpc_transport.SERVICE_NAME == grpc_service.SERVICE_NAME == "gossipcomp.v1.Gossip"
    reason = grpc_options.WHY_AUTHENTICATION_NEEDS_TLS
    assert grpc_transport.WHY_AUTHENTICATION_NEEDS_TLS is reason
