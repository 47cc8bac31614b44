"""A peer over gRPC (`Peer.over_grpc`): its own server at its address in the topology,
streams bounded by the round's deadline, its links throttled when rates are given; the
transport is closed again when the peer cannot be made."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from gossipcomp.gossip.base import GossipAlgorithm
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.outer.drift import DriftTracker
from gossipcomp.outer.optimizers import OuterSGD
from gossipcomp.peer.deadlines import check_round_timeout
from gossipcomp.peer.failures import DEFAULT_MAX_FAILED_ROUNDS
from gossipcomp.peer.links import Backoff
from gossipcomp.topology import Topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport
from gossipcomp.transport.protocol import Transport
from gossipcomp.transport.throttled import LinkRates, ThrottledTransport
from gossipcomp.workload.models import model_signature

P = TypeVar("P")


def over_grpc(
    cls: Callable[..., P],
    model: torch.nn.Module,
    topology: Topology,
    rank: int,
    algorithm: GossipAlgorithm,
    *,
    bind: str | None = None,
    options: GrpcOptions | None = None,
    round_timeout: float = 30.0,
    backoff: Backoff | None = None,
    ready: bool = True,
    gossip_buffers: bool = True,
    local_steps: int = 1,
    link_rates: LinkRates | None = None,
    constant_buffers: bool = True,
    max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS,
    turns: ComputeTurns | None = None,
    outer: OuterSGD | None = None,
    drift: DriftTracker | None = None,
    joining: bool = False,
    address_source: Callable[[int], str | None] | None = None,
) -> P:
    """A peer with its own gRPC server at `bind` (default: its address in the topology).
    A stream that carries an envelope must finish within the round's deadline. With
    `link_rates`, its links are throttled to those rates (transport/throttled.py).
    `address_source`: where its neighbours' addresses are read as they come (GrpcTransport)."""
    check_round_timeout(round_timeout)
    signature = model_signature(model, gossip_buffers, constant_buffers)
    identity = Identity(rank, topology.hash, signature)
    options = dataclasses.replace(options or GrpcOptions(), stream_timeout=round_timeout)
    grpc_transport = GrpcTransport(
        identity,
        topology.neighbors(rank),
        bind=bind or topology.addresses[rank],
        options=options,
        address_source=address_source,
    )
    transport: Transport = (
        grpc_transport if link_rates is None else ThrottledTransport(grpc_transport, link_rates)
    )
    try:
        return cls(
            model,
            topology,
            rank,
            algorithm,
            transport,
            round_timeout=round_timeout,
            backoff=backoff,
            ready=ready,
            gossip_buffers=gossip_buffers,
            local_steps=local_steps,
            constant_buffers=constant_buffers,
            max_failed_rounds=max_failed_rounds,
            turns=turns,
            outer=outer,
            drift=drift,
            joining=joining,
        )
    except Exception:
        transport.close()
        raise
