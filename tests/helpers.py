"""Helpers several test files share, so each check and each way of building peers is written
once: small models and level schedules; in-process rings (fast-probing, throttled, losing one
round); closing peers; the checks a ring must pass after gossip (no failed exchange, the
network sum kept, the broadcast copies and levels both ends track); hostile envelopes refused
at the door and signed level notices; a stranger's Hello; the command line of a `gossipcomp
peer` process; a store key set so that every connection sees it; the benchmark scripts as
modules, and whether network namespaces can be built here (benchmarks/shaped_links.py).
conftest.py keeps the fixtures and the network builders."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import torch
import torch.distributed as dist
from conftest import gossip_round, stacked

from gossipcomp.coordinator import CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.gossip import Choco, GossipAlgorithm
from gossipcomp.peer import Peer
from gossipcomp.peer.links import Backoff
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.schedule.schedule import LinkLevel, Schedule
from gossipcomp.topology import Topology
from gossipcomp.transport.authentication import Authenticator
from gossipcomp.transport.base import PROTOCOL_VERSION, Envelope, EnvelopeRejected, Identity
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcTransport
from gossipcomp.transport.memory import Fault, InMemoryHub, InMemoryTransport
from gossipcomp.transport.throttled import LinkRates, ThrottledTransport
from gossipcomp.workload.models import build_mlp, model_signature

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def ladder_report(
    topology: Topology, sender: int, round: int = 4, slower: float = 1.0, **fields: Any
) -> cpb.PeerReport:
    """A peer's report to an adaptive coordinator: a 5-level ladder (levels 1-16, 1 KB a round
    per level) and sends at `slower` x 1 us a byte to every neighbour (level 8 takes 8 ms: the
    most that fits a 10 ms budget), with any other PeerReport `fields`."""
    return cpb.PeerReport(
        protocol_version=PROTOCOL_VERSION,
        sender=sender,
        topology_hash=topology.hash,
        model_signature="m",
        round=round,
        level_costs=[cpb.LevelCost(level=x, bytes_per_round=1000 * x) for x in (1, 2, 4, 8, 16)],
        exchanges_per_round=1,
        sends=[
            cpb.LinkSamples(neighbour=j, bytes=[1000, 8000], seconds=[1e-3 * slower, 8e-3 * slower])
            for j in topology.neighbors(sender)
        ],
        **fields,
    )


def mlp_models(n: int, hidden: int = 32, same: bool = False) -> list[torch.nn.Module]:
    """`n` small MLPs (16 inputs, 4 classes): seeds 0..n-1, or all seed 0 with `same`."""
    return [
        build_mlp(0 if same else seed, input_dim=16, hidden=(hidden, hidden), num_classes=4)
        for seed in range(n)
    ]


def levels_schedule(epoch: int, at: int, levels: dict[tuple[int, int], int]) -> Schedule:
    """An adaptive schedule of epoch `epoch` from round `at` setting these links' levels."""
    links = tuple(LinkLevel(a, b, level) for (a, b), level in sorted(levels.items()))
    return Schedule(epoch, at, planner="adaptive", links=links, budget_s=0.1)


def close_all(peers: Iterable[Peer]) -> None:
    for peer in peers:
        peer.close()


def stop_all(
    clients: Iterable[CoordinatorClient], server: CoordinatorServer, peers: Iterable[Peer]
) -> None:
    """Close the coordinator clients, stop their server, then close the peers."""
    for client in clients:
        client.close()
    server.stop()
    close_all(peers)


def assert_clean(peers: Sequence[Peer]) -> None:
    """No peer had a failed exchange or one at a mismatched epoch."""
    for peer in peers:
        assert peer.stats.failed_exchanges == {}, peer.rank
        assert peer.stats.mismatched_epoch_exchanges == 0, peer.rank


def network_sum(peers: Sequence[Peer]) -> list[torch.Tensor]:
    """Per parameter: the sum of the peers' values."""
    return [x.sum(0) for x in stacked(peers)]


def assert_sum_kept(before: Sequence[torch.Tensor], peers: Sequence[Peer], atol: float) -> None:
    """The network sum of every parameter is still `before`'s, within `atol`."""
    for a, b in zip(before, network_sum(peers), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def tracked(peer: Peer) -> tuple[list[torch.Tensor], dict[int, list[torch.Tensor]]]:
    """A peer's own broadcast state and its copies of its neighbours' (Choco: public copies,
    DEF-ATC: references), per parameter."""
    algorithm = peer.algorithm
    codec = algorithm._require_codec()
    if isinstance(algorithm, Choco):
        own, copies = algorithm.public, algorithm.neighbour_public
    else:
        own, copies = algorithm.reference, algorithm.neighbour_references
    return codec.per_parameter(own), {j: codec.per_parameter(t) for j, t in copies.items()}


def level_by_round(peer: Peer, rounds: int) -> dict[int, int]:
    """The level `peer` broadcast at in each round, from its reported changes."""
    ladder = peer.algorithm._levels.ladder
    changes = {c["round"]: ladder.specs.index(c["level"]) + 1 for c in peer.stats.peer_levels}
    level, by_round = ladder.default, {}
    for r in range(rounds + 1):
        level = changes.get(r, level)
        by_round[r] = level
    return by_round


def link_level_by_round(peer: Peer, link: tuple[int, int], rounds: int) -> dict[int, int]:
    """The PowerGossip rank of `link` in each round, from `peer`'s reported changes (rank 1,
    the lowest, before the first)."""
    changes = {
        c["round"]: int(c["level"].split("=")[1])
        for c in peer.stats.link_levels
        if c["link"] == list(link)
    }
    level, by_round = 1, {}
    for r in range(rounds + 1):
        level = changes.get(r, level)
        by_round[r] = level
    return by_round


def memory_ring(
    topology: Topology, models: Sequence[torch.nn.Module], algorithm: Callable[[], GossipAlgorithm]
) -> tuple[list[Peer], InMemoryHub]:
    """A Peer per model over the in-process transport, not started, that probes a lost
    neighbour at once (rounds take milliseconds here: 0.5 s round timeout, 1-10 ms backoff);
    and their hub."""
    hub = InMemoryHub()
    peers = []
    for r, model in enumerate(models):
        identity = Identity(r, topology.hash, model_signature(model))
        transport = InMemoryTransport(identity, topology.neighbors(r), hub)
        backoff = Backoff(0.001, 0.01)
        peers.append(
            Peer(model, topology, r, algorithm(), transport, round_timeout=0.5, backoff=backoff)
        )
    return peers, hub


def gossip_losing_round(
    peers: Sequence[Peer], hub: InMemoryHub, lost: int, rounds: int
) -> Iterator[int]:
    """Rounds 0..rounds-1 of gossip in which every message from peer 0 to peer 1 is lost in
    round `lost`; yields each round's number once it is done (the link heals when the caller
    asks for the next)."""
    for r in range(rounds):
        if r == lost:
            hub.inject(0, 1, Fault.LOST)
        gossip_round(peers)
        yield r
        if r == lost:
            hub.heal()


def throttled_ring(
    topology: Topology,
    models: Sequence[torch.nn.Module],
    rates: LinkRates,
    algorithm: Callable[[], GossipAlgorithm],
    budget: float | None = None,
) -> list[Peer]:
    """A started Peer per model over the in-process transport throttled to `rates`; with
    `budget`, each sets its levels itself within it (adapt_levels) before it starts."""
    hub = InMemoryHub()
    peers = []
    for rank, model in enumerate(models):
        identity = Identity(rank, topology.hash, model_signature(model))
        inner = InMemoryTransport(identity, topology.neighbors(rank), hub)
        transport = ThrottledTransport(inner, rates)
        peers.append(Peer(model, topology, rank, algorithm(), transport))
        if budget is not None:
            peers[-1].adapt_levels(budget)
    for peer in peers:
        peer.start(5, {})
    return peers


def stranger_hello(
    channel: grpc.Channel, sender: int, topology: Topology, model: torch.nn.Module, **fields: Any
) -> pb.HelloReply:
    """Call Hello over `channel` as a stranger outside any Peer claiming to be `sender` (with
    that topology and model; `fields` the rest of the request), and return the reply."""
    hello = pb.HelloRequest(
        protocol_version=PROTOCOL_VERSION,
        sender=sender,
        topology_hash=topology.hash,
        model_signature=model_signature(model),
        **fields,
    )
    call = channel.unary_unary(
        f"/{SERVICE_NAME}/Hello",
        request_serializer=pb.HelloRequest.SerializeToString,
        response_deserializer=pb.HelloReply.FromString,
    )
    return call(hello, timeout=5)


def assert_refused_at_the_door(
    sending: GrpcTransport,
    receiving: GrpcTransport,
    envelope: Envelope,
    code: grpc.StatusCode,
    field: str,
) -> None:
    """`envelope` sent to `receiving` is refused with `code`, naming `field` in a short
    message, and nothing is stored."""
    with pytest.raises(grpc.RpcError) as refused:
        sending.send(receiving.rank, envelope, deadline=time.monotonic() + 5)
    assert refused.value.code() == code
    assert field in refused.value.details() and len(refused.value.details()) < 300
    assert receiving.inbox.mailbox.pending() == 0


def assert_notice_is_signed(
    header: Any, checker: Callable[[], Authenticator], level: int, effective_round: int
) -> None:
    """A signed envelope header whose level notice is changed after signing (to `level`, or
    to `effective_round`) or dropped no longer verifies by a fresh `checker()`."""
    for change in (
        lambda h: setattr(h.level_notice, "level", level),
        lambda h: setattr(h.level_notice, "effective_round", effective_round),
        lambda h: h.ClearField("level_notice"),
    ):
        altered = type(header)()
        altered.CopyFrom(header)
        change(altered)
        with pytest.raises(EnvelopeRejected, match="signature"):
            checker().check_envelope(altered)


def peer_command(topology: Path, report: Path, *extra: str) -> list[str]:
    """The command line of a quiet `gossipcomp peer` process writing its report to `report`."""
    return [
        sys.executable,
        "-m",
        "gossipcomp",
        "peer",
        "--topology",
        str(topology),
        "--report",
        str(report),
        "--quiet",
        *extra,
    ]


def store_set(store: dist.Store, key: str, value: bytes) -> None:
    """Set `key` in a TCPStore and return once its server has applied it. A set is not
    answered, so a read on another connection (a client's) may otherwise arrive first and miss
    it; a check on the same connection is answered only after the set before it."""
    store.set(key, value)
    store.check([key])


def benchmark(name: str) -> ModuleType:
    """The script benchmarks/`name`.py as a module (the scripts there import each other by
    name, so their folder goes on sys.path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def needs_namespaces() -> pytest.MarkDecorator:
    """A mark that skips a test where network namespaces cannot be built here
    (benchmarks/shaped_links.py's check), saying why."""
    shaped_links = benchmark("shaped_links")
    try:
        shaped_links.check_available()
    except shaped_links.NamespacesUnavailable as why:
        return pytest.mark.skipif(True, reason=f"network namespaces: {why}")
    return pytest.mark.skipif(False, reason="network namespaces can be built")


def loaded_modules(statement: str, *prefixes: str) -> list[str]:
    """The modules whose names start with one of `prefixes` that a fresh interpreter has loaded
    after running `statement`: what an import drags in, seen from outside this test process."""
    code = (
        f"import sys\n{statement}\n"
        f"print(repr(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip())
