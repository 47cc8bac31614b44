"""run_peer: one peer of a network whose other peers live in other processes or machines.

The peer's own TLS files and signing key (required when the topology lists public keys) are
checked before it starts; it trains like a simulated peer and reports the network's average
model as its neighbours' gossip gives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.experiment import TrainConfig, build_algorithm, build_config_model, load_data
from gossipcomp.experiment.report import Report, flat
from gossipcomp.experiment.simulation.results import _report
from gossipcomp.experiment.simulation.setup import (
    CheckpointPolicy,
    PeerLevels,
    ProgressCallback,
    _check_one_level_source,
    _failed_rounds_bound,
    _trainer,
)
from gossipcomp.peer import Peer
from gossipcomp.security import TlsFiles
from gossipcomp.security.signing_keys import PeerKeys, load_signing_key
from gossipcomp.topology import Topology
from gossipcomp.transport.base import DEFAULT_BULK_LANE_BYTES
from gossipcomp.transport.grpc_transport import WHY_AUTHENTICATION_NEEDS_TLS, GrpcOptions


def peer_keys(topology: Topology, rank: int, signing_key: Path | None) -> PeerKeys | None:
    """A peer's keys from its `--key` file and the topology's public keys; None when the network
    does not authenticate. A topology listing public keys needs the key: a peer that cannot sign
    would be refused by every neighbour, so it is refused at start instead."""
    if signing_key is None:
        listed = [r for r, key in enumerate(topology.public_keys) if key is not None]
        if listed:
            raise ValueError(
                f"{topology.source} lists public keys (peers {listed}), so peers authenticate: "
                f"expected this peer's signing key as --key FILE"
            )
        return None
    return PeerKeys.for_rank(
        rank, load_signing_key(signing_key), topology.public_keys, topology.source
    )


def run_peer(
    config: TrainConfig,
    topology: Topology,
    rank: int,
    *,
    bind: str | None = None,
    progress: ProgressCallback | None = None,
    startup_timeout: float = 60.0,
    checkpoints: CheckpointPolicy | None = None,
    tls: TlsFiles | None = None,
    signing_key: Path | None = None,
    insecure: bool = False,
    bulk_lane_bytes: int = DEFAULT_BULK_LANE_BYTES,
    coordinator: str | None = None,
    report_every: int = 10,
    peer_levels: PeerLevels | None = None,
    joining: bool = False,
    address_source: Callable[[int], str | None] | None = None,
) -> Report:
    """Train one peer of `topology` at its address; its neighbours run elsewhere. With
    `checkpoints`, it continues from its newest valid checkpoint and keeps writing them; with
    `tls`, it talks to its neighbours over mutual TLS only; with `signing_key` (required when
    the topology lists public keys, and only with `tls`), it signs every message and accepts
    only messages signed by its neighbours' keys. Without `tls` it serves only on loopback
    unless `insecure` (GrpcOptions.insecure: plaintext trusts whoever reaches the port), and
    sends envelopes of `bulk_lane_bytes` or more on its neighbours' bulk lanes (0: never). With
    `coordinator` (HOST:PORT), it reports there every `report_every` rounds (over `tls` when
    given) and takes the schedules published there; with `peer_levels` instead, it sets its
    links' levels with its neighbours (each must do the same). `joining`: it (re)joins a live
    network (Peer's `joining`). `address_source`: where neighbours' addresses not known at
    start are read (rendezvous.StoreAddresses: a live network's joiners)."""
    if signing_key is not None and tls is None:
        raise ValueError(
            "peer authentication (--key) needs mutual TLS (--tls-cert, --tls-key, --tls-ca): "
            + WHY_AUTHENTICATION_NEEDS_TLS
        )
    _check_one_level_source(coordinator is not None, peer_levels)
    keys = peer_keys(topology, rank, signing_key)
    start = time.perf_counter()
    data = load_data(config)
    with Peer.over_grpc(
        build_config_model(config, data),
        topology,
        rank,
        build_algorithm(config, topology, rank),
        bind=bind,
        options=GrpcOptions(tls=tls, keys=keys, insecure=insecure, bulk_lane_bytes=bulk_lane_bytes),
        round_timeout=config.round_timeout,
        ready=checkpoints is None,
        gossip_buffers=config.gossip_buffers,
        max_failed_rounds=_failed_rounds_bound(config, rank),
        local_steps=config.local_steps,
        outer=config.outer_optimizer(),
        drift=config.drift_correction(),
        joining=joining,
        address_source=address_source,
    ) as peer:
        if peer_levels is not None:
            peer.adapt_levels(peer_levels.round_budget, peer_levels.follow_loss)
        client = (
            None
            if coordinator is None
            else CoordinatorClient(
                coordinator, peer, config.group_compressor, report_every=report_every, tls=tls
            )
        )
        try:
            trainer = _trainer(peer, data, config, checkpoints, client)
            peer.start(startup_timeout)
            outcome = trainer.run(on_round=(lambda r: progress(rank, r)) if progress else None)
        finally:
            if client is not None:
                client.close()
        average = peer.network_average()
        own = [p.detach() for _, p in peer.gossiped]
        distance = float((flat(own) - flat(average)).pow(2).sum())
        return _report(
            "peer",
            config,
            topology,
            [outcome],
            [distance],
            average,
            data,
            time.perf_counter() - start,
        )
