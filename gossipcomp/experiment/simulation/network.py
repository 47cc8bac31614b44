"""run_simulation: every peer of a topology in this process (or its worker processes), over
real gRPC on loopback.

Optionally over mutual TLS with a throwaway CA and certificates that exist only while it runs,
with every message signed by throwaway keys, with a coordinator served on loopback too, and
with throttled links.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.experiment import TrainConfig, load_data
from gossipcomp.experiment.report import Report, flat
from gossipcomp.experiment.simulation.results import _report
from gossipcomp.experiment.simulation.setup import (
    CheckpointPolicy,
    PeerLevels,
    ProgressCallback,
    _check_one_level_source,
    _Setup,
    _train_all,
    garbage_collection_for_run,
)
from gossipcomp.experiment.simulation.workers import _check_workers, _train_in_workers, usable_cores
from gossipcomp.peer import Peer
from gossipcomp.security import TlsFiles, throwaway_certificates
from gossipcomp.security.signing_keys import PeerKeys
from gossipcomp.topology import Topology
from gossipcomp.transport.grpc_transport import WHY_AUTHENTICATION_NEEDS_TLS
from gossipcomp.transport.throttled import LinkRates


@garbage_collection_for_run()  # full collections skip what was alive before the run
def run_simulation(
    config: TrainConfig,
    topology: Topology,
    *,
    progress: ProgressCallback | None = None,
    startup_timeout: float = 30.0,
    checkpoints: CheckpointPolicy | None = None,
    tls: bool = False,
    authenticate: bool = False,
    coordinator: Coordinator | None = None,
    report_every: int = 10,
    link_rates: LinkRates | None = None,
    workers: int = 1,
    peer_levels: PeerLevels | None = None,
) -> Report:
    """Train every peer of `topology` in this process over gRPC on loopback (each link
        throttled to `link_rates` when given); with `tls`, over
        mutual TLS with a throwaway CA and per-peer certificates (deleted when training ends); with
        `authenticate` as well, every message signed by a throwaway per-peer key. With
        `coordinator`, it is served on loopback too (over the same TLS) and every peer reports to
        it every `report_every` rounds and takes the schedules it publishes; with `peer_levels`
        instead, the peers set their links' levels themselves. With `workers` > 1 the
    peers are spread over that many worker processes (contiguous blocks of ranks), which talk gRPC
    to each other on loopback as peers of different machines would: several interpreters, so
    several cores, instead of one interpreter lock for every peer."""
    if authenticate and not tls:
        raise ValueError(f"--authenticate needs --tls: {WHY_AUTHENTICATION_NEEDS_TLS}")
    _check_one_level_source(coordinator is not None, peer_levels)
    if workers != 1:
        _check_workers(workers, topology, authenticate)
    start = time.perf_counter()
    data = load_data(config)
    peers: list[Peer] = []
    keys = _throwaway_keys(topology.n) if authenticate else [None] * topology.n
    with _simulation_tls(topology.n, tls) as (tls_files, coordinator_tls):
        server = None
        clients: list[CoordinatorClient] = []
        try:
            if coordinator is not None:
                server = CoordinatorServer(coordinator, "127.0.0.1:0", coordinator_tls)
            setup = _Setup(
                config,
                topology,
                tls_files,
                None if server is None else server.address,
                report_every,
                link_rates,
                checkpoints,
                startup_timeout,
                peer_levels,
            )
            if workers != 1:
                outcomes, params = _train_in_workers(setup, workers, progress)
            else:
                setup.build_peers(range(topology.n), data, keys, peers, usable_cores())
                clients = setup.clients(peers)
                trainers = setup.trainers(peers, clients, data)
                addresses = {p.rank: p.address for p in peers}
                for peer in peers:
                    peer.start(startup_timeout, addresses)
                outcomes = _train_all(trainers, progress)
                params = [[p.detach() for _, p in peer.gossiped] for peer in peers]
            average = [torch.stack(group).mean(dim=0) for group in zip(*params, strict=True)]
            mean_vector = flat(average)
            distances = [float((flat(ps) - mean_vector).pow(2).sum()) for ps in params]
            return _report(
                "simulate",
                config,
                topology,
                outcomes,
                distances,
                average,
                data,
                time.perf_counter() - start,
            )
        finally:
            for client in clients:
                client.close()
            for peer in peers:
                peer.close()
            if server is not None:
                server.stop()


@contextmanager
def _simulation_tls(
    n: int, enabled: bool
) -> Iterator[tuple[list[TlsFiles | None], TlsFiles | None]]:
    """Per rank its TLS files, and the coordinator's (existing while the context lasts), or
    None for plaintext."""
    if not enabled:
        yield [None] * n, None
        return
    names = [f"peer{rank}" for rank in range(n)]
    with throwaway_certificates([*names, "coordinator"]) as files:
        yield [files[name] for name in names], files["coordinator"]


def _throwaway_keys(n: int) -> list[PeerKeys | None]:
    """A fresh signing key per rank, each peer knowing all the public halves."""
    private = [Ed25519PrivateKey.generate() for _ in range(n)]
    public = {rank: key.public_key() for rank, key in enumerate(private)}
    return [PeerKeys(key, public) for key in private]
