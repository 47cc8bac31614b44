"""Peers in one process share one event loop thread, and a push starts no thread (issue 28).

Before, every GrpcTransport ran its server on an event loop thread of its own and pushed over
synchronous channels, which start a channel-spin thread whenever a channel with no call in
flight gets one: a process of 32 peers had about a hundred threads handing one interpreter lock
around, and the cost of a peer-round grew with the number of peers (docs/benchmarks.md,
"Engine, one process"). Real gRPC on loopback, several peers in this process.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import run_in_threads

from gossipcomp.transport.base import Identity
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcTransport
from gossipcomp.transport.serving import PROCESS_LOOP, SharedLoop

PEERS = 8
PHASE = "x"


def _values(rank: int, round_: int) -> torch.Tensor:
    return torch.full((16,), float(100 * rank + round_))


def _ring() -> list[GrpcTransport]:
    spec = (tensor_spec("v", _values(0, 0)),)
    transports: list[GrpcTransport] = []
    try:
        for rank in range(PEERS):
            neighbours = [(rank - 1) % PEERS, (rank + 1) % PEERS]
            transports.append(GrpcTransport(Identity(rank, "ring", "model"), neighbours))
            transports[-1].inbox.expect(PHASE, spec)
        addresses = {t.rank: t.address for t in transports}
        for transport in transports:
            transport.connect(addresses, timeout=30)
    except BaseException:
        for transport in transports:
            transport.close()
        raise
    return transports


def _round(transport: GrpcTransport, round_: int) -> dict[int, float]:
    payload = (encode_raw("v", _values(transport.rank, round_)),)
    neighbours = [(transport.rank - 1) % PEERS, (transport.rank + 1) % PEERS]
    result = transport.exchange(round_, PHASE, dict.fromkeys(neighbours, payload), timeout=20)
    assert not result.failed, result.failed
    return {j: float(decode_raw(e.tensors[0])[0]) for j, e in result.received.items()}


def test_eight_peers_add_at_most_two_threads_and_their_pushes_start_none(monkeypatch):
    before = {t.ident for t in threading.enumerate()}
    transports = _ring()
    try:
        added = [t.name for t in threading.enumerate() if t.ident not in before]
        # the shared loop and grpc.aio's poller at most; was a loop thread per peer
        assert len(added) <= 2, added
        started: list[str] = []
        start = threading.Thread.start

        def counted(thread: threading.Thread) -> None:
            started.append(thread.name)
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", counted)
        for round_ in range(3):
            heard = run_in_threads([lambda t=t, r=round_: _round(t, r) for t in transports])
            for rank, values in enumerate(heard):
                assert set(values) == {(rank - 1) % PEERS, (rank + 1) % PEERS}
                for j, value in values.items():
                    assert value == 100 * j + round_  # each neighbour's own envelope
        assert len(started) == 3 * PEERS, started  # the test's own threads, nothing else
    finally:
        for transport in transports:
            transport.close()


def test_the_shared_loop_stops_with_its_last_lease_and_refuses_to_wait_on_itself():
    shared = SharedLoop("test-loop")
    first, second = shared.lease(), shared.lease()

    async def thread_name() -> str:
        return threading.current_thread().name

    assert first.run(thread_name()) == "test-loop"
    first.close()
    first.close()  # closing a lease twice releases it once
    assert second.run(thread_name()) == "test-loop"  # still running for the second lease

    async def wait_on_itself() -> None:
        second.run(thread_name())

    with pytest.raises(RuntimeError, match="its own loop"):
        second.run(wait_on_itself())
    second.close()
    assert not any(t.name == "test-loop" for t in threading.enumerate())
    assert PROCESS_LOOP is not shared
