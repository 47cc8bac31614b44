"""Shared fixtures: small gRPC networks on loopback (ports from 0), closed after each test."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from gossipcomp.transport.base import Identity
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport


def run_in_threads(functions: Sequence[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run callables concurrently (one per peer); return results in order, re-raise failures."""
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            results[i] = functions[i]()
        except BaseException as error:  # re-raised in the test thread
            errors.append(error)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(functions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a peer thread did not finish in time"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def grpc_pair() -> Iterator[Callable[..., tuple[GrpcTransport, GrpcTransport]]]:
    """Factory for two connected gRPC transports (ranks 0 and 1) sharing an identity."""
    made: list[GrpcTransport] = []

    def make(
        topology_hash: str = "topo", signature: str = "model", options: GrpcOptions | None = None
    ) -> tuple[GrpcTransport, GrpcTransport]:
        a = GrpcTransport(Identity(0, topology_hash, signature), [1], options=options)
        b = GrpcTransport(Identity(1, topology_hash, signature), [0], options=options)
        made.extend([a, b])
        a.connect({1: b.address}, timeout=10)
        b.connect({0: a.address}, timeout=10)
        return a, b

    yield make
    for transport in made:
        transport.close()
