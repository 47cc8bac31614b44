"""Choco with a public copy per edge (gossip/choco_edge.py): what it keeps, what it equals, and
a level per link set by schedules, by a coordinator and by the peers themselves."""

from __future__ import annotations

import pytest
import torch
from conftest import build_network, consensus_distance, gossip_round, run_in_threads
from helpers import (
    assert_clean,
    assert_sum_kept,
    close_all,
    levels_schedule,
    memory_ring,
    mlp_models,
    network_sum,
    throttled_ring,
)

from gossipcomp.compress import parse_spec
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.gossip import Choco, EdgeChoco, PowerGossip
from gossipcomp.gossip.base import LinkLeveled, PeerLeveled
from gossipcomp.gossip.registry import make_algorithm
from gossipcomp.gossip.specs import BuildContext
from gossipcomp.peer import Peer
from gossipcomp.peer.links import LinkState
from gossipcomp.peer.round_graphs import check_round_graphs
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import Schedule, ScheduleRefused
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import Fault, InMemoryHub, InMemoryTransport
from gossipcomp.transport.throttled import LinkRates, RateChange
from gossipcomp.workload.models import model_signature

RING4 = build_topology("ring", n=4)
EDGES = ((0, 1), (1, 2), (2, 3), (0, 3))


def _local_step(peers: list[Peer], generator: torch.Generator) -> None:
    """Move every peer's model its own way, as a local optimizer step would."""
    with torch.no_grad():
        for peer in peers:
            for p in peer.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.01)


def _assert_edges_agree(peers: list[Peer]) -> None:
    """For every edge (i, j): i's own copy for j equals j's copy of i, bit for bit, and the
    other way round."""
    for a, b in EDGES:
        for i, j in ((a, b), (b, a)):
            mine = peers[i].algorithm.own[j]
            tracked = peers[j].algorithm.theirs[i]
            for x, y in zip(mine, tracked, strict=True):
                assert torch.equal(x, y), (i, j)


def test_it_is_registered_link_leveled_and_refuses_what_it_cannot_use() -> None:
    algorithm = make_algorithm(
        "choco-edge:compressor=topk:ratio=0.05", BuildContext(seed=3, spectral_step=0.5)
    )
    assert isinstance(algorithm, EdgeChoco) and algorithm.seed == 3
    # a level per link, never per peer: the peer's level code must take it for PowerGossip's kind
    assert isinstance(algorithm, LinkLeveled) and not isinstance(algorithm, PeerLeveled)
    with pytest.raises(ValueError, match=r"'ef\+topk:ratio=0.05' keeps an error-feedback memory"):
        EdgeChoco(parse_spec("ef+topk:ratio=0.05"))
    with pytest.raises(ValueError, match=r"consensus_step must lie in \(0, 1\] for choco-edge"):
        EdgeChoco(parse_spec("sign"), consensus_step=1.5)
    with pytest.raises(RuntimeError, match="used before setup"):
        EdgeChoco(parse_spec("sign")).level_costs([])


def test_with_one_level_on_every_link_it_trains_as_choco() -> None:
    """Top-k is deterministic, so with every link at one level each peer's copies for its
    neighbours all equal Choco's one public copy, and the models follow Choco's (the sums are
    only ordered differently: equal within float rounding)."""
    networks = [
        build_network(RING4, mlp_models(4), lambda kind=kind: kind(parse_spec("topk:ratio=0.1")))
        for kind in (Choco, EdgeChoco)
    ]
    try:
        for peers in networks:
            generator = torch.Generator().manual_seed(0)
            for _ in range(10):
                _local_step(peers, generator)
                gossip_round(peers)
        choco, edge = networks
        for a, b in zip(choco, edge, strict=True):
            for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
            for j in RING4.neighbors(a.rank):
                for x, y in zip(a.algorithm.public, b.algorithm.own[j], strict=True):
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
            assert a.stats.bytes_sent == b.stats.bytes_sent  # the same payload on every link
        assert any(float(x.abs().sum()) > 0 for x in edge[0].algorithm.own[1])
    finally:
        for peers in networks:
            close_all(peers)


@pytest.mark.parametrize(
    ("spec", "transport"),
    [
        ("topk:ratio=0.05", "grpc"),
        ("qsgd:levels=16", "memory"),  # unbiased: both ends scale by the level's 1 / (1 + beta)
        ("randomk:ratio=0.05", "memory"),  # randomness both ends draw for the edge alone
    ],
)
def test_links_at_different_levels_keep_both_ends_copies_equal_and_the_network_sum(
    spec: str, transport: str
) -> None:
    """Two schedules give the ring's four links four levels, then move them: every exchange
    is accepted, every edge's two copies are held alike at both ends, the network sum is kept
    each round, and a peer sends fewer bytes over its low link than over its high one (a level
    per link, where Choco's one broadcast level would send the same over both)."""
    peers = build_network(
        RING4, mlp_models(4), lambda: EdgeChoco(parse_spec(spec), seed=5), transport=transport
    )
    generator = torch.Generator().manual_seed(0)
    try:
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        low, top = costs.levels[0], costs.levels[-1]
        first = levels_schedule(1, 2, {(0, 1): low, (1, 2): top, (2, 3): low + 1, (0, 3): top})
        second = levels_schedule(2, 6, {(0, 1): top, (0, 3): low})
        for peer in peers:
            peer.apply(first)
            peer.apply(second)
        sent = []
        for _ in range(9):
            _local_step(peers, generator)
            before = network_sum(peers)
            start = [dict(p.stats.bytes_sent) for p in peers]
            links = [RING4.neighbors(p.rank) for p in peers]
            gossip_round(peers)
            assert_sum_kept(before, peers, 1e-4)
            sent.append(
                [
                    {j: p.stats.bytes_sent[j] - s.get(j, 0) for j in around}
                    for p, s, around in zip(peers, start, links, strict=True)
                ]
            )
        assert_clean(peers)
        _assert_edges_agree(peers)
        # round 3 (first schedule): peer 0's link to 1 at the lowest level, to 3 at the top
        assert sent[3][0][1] * 5 < sent[3][0][3]
        # round 7 (second): the same two links the other way round
        assert sent[7][0][3] * 5 < sent[7][0][1]
        changes = [(c["round"], tuple(c["link"])) for c in peers[0].stats.link_levels]
        assert (2, (0, 1)) in changes and (6, (0, 3)) in changes
    finally:
        close_all(peers)


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({(0, 1): 10_000}, r"link level for peer 1 \(the ladder .*\): expected an integer in"),
        ({(0, 1): 1}, r"link level for peer 1: 1 is below the floor \d+ \(topk:ratio="),
        ({(0, 2): 2}, "not an edge"),
    ],
)
def test_a_hostile_link_level_is_refused_naming_the_link_and_nothing_changes(
    links: dict[tuple[int, int], int], message: str
) -> None:
    peers = build_network(RING4, mlp_models(4), lambda: EdgeChoco(parse_spec("topk:ratio=0.05")))
    try:
        with pytest.raises(ScheduleRefused, match=message):
            peers[0].apply(levels_schedule(1, 5, links))
        assert peers[0].schedules.newest.epoch == 0
        gossip_round(peers)
        assert_clean(peers)
        with pytest.raises(ValueError, match="link level for peer 2, which is not a neighbour"):
            peers[0].algorithm.link_specs(peers[0].gossiped, None, {2: 3})
    finally:
        close_all(peers)


def test_an_edge_that_fails_one_way_resumes_with_both_copies_at_zero_and_keeps_the_sum() -> None:
    """Peer 0's acknowledgement from peer 1 is lost once: peer 1 took peer 0's envelope, peer 0
    did not take peer 1's, so the edge's copies disagree. The edge goes down and resumes with
    both ends' copies back at zero (nothing sent to agree on them); from then on both ends
    hold them alike again and the network sum stays where it was."""
    peers, hub = memory_ring(
        RING4, mlp_models(4), lambda: EdgeChoco(parse_spec("topk:ratio=0.1"), seed=1)
    )
    try:
        for peer in peers:
            peer.start(5, {})
        for _ in range(2):
            gossip_round(peers)
        hub.inject(0, 1, Fault.ACK_LOST)
        gossip_round(peers)
        hub.heal()
        assert peers[0].links.state(1) is LinkState.DOWN
        for _ in range(60):
            gossip_round(peers)
            if all(
                p.links.state(j) is LinkState.UP for p in peers for j in RING4.neighbors(p.rank)
            ):
                break
        else:
            raise AssertionError("the edge did not come back")
        _assert_edges_agree(peers)
        before = network_sum(peers)
        for _ in range(5):
            gossip_round(peers)
        assert_sum_kept(before, peers, 1e-4)
        _assert_edges_agree(peers)
    finally:
        close_all(peers)


def _run_with_coordinator(peers: list[Peer], budget: float, rounds: int) -> None:
    """`rounds` rounds of gossip, every peer reporting every round to an adaptive coordinator
    that sets the links' levels within `budget` seconds a round."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=budget)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    clients = [CoordinatorClient(server.address, p, None, report_every=1) for p in peers]

    def train(peer: Peer, client: CoordinatorClient) -> None:
        for _ in range(rounds):
            peer.gossip()
            client.after_round()

    try:
        run_in_threads(
            [lambda p=p, c=c: train(p, c) for p, c in zip(peers, clients, strict=True)], 120
        )
    finally:
        for client in clients:
            client.close()
        server.stop()


def _level_of(peer: Peer, link: tuple[int, int]) -> int:
    """The level `peer` sends over `link` now."""
    j = link[1] if link[0] == peer.rank else link[0]
    return peer.algorithm._link_levels[j]


@pytest.mark.parametrize("coordinator", [True, False])
def test_a_slow_link_is_lowered_alone_while_its_ends_other_links_stay_high(
    one_thread: None, coordinator: bool
) -> None:
    """ring4 over the throttled transport, link 0-1 at 0.5 Mbit/s from round 4, the others at
    50: with a coordinator, or with each edge's lower end deciding, the slow link's level
    falls below the configured one while the fast links beside it, at its own two ends, end
    above it. Choco's one level per peer would put peers 0 and 1's every link at the slow
    link's level. Both ends of every edge still hold the same copies."""
    rates = LinkRates(50, [RateChange(0, 1, 0.5, 4)])
    budget, rounds = 0.1, 40
    peers = throttled_ring(
        RING4,
        mlp_models(4, hidden=256),
        rates,
        lambda: EdgeChoco(parse_spec("topk:ratio=0.05")),
        budget=None if coordinator else budget,
    )
    try:
        if coordinator:
            _run_with_coordinator(peers, budget, rounds)
        else:
            for _ in range(rounds):
                gossip_round(peers)
        default = peers[0].algorithm._require_ladder().ladder.default
        for rank in (0, 1):
            slow = _level_of(peers[rank], (0, 1))
            fast = _level_of(peers[rank], (0, 3) if rank == 0 else (1, 2))
            assert slow < default, (rank, slow, default)
            assert fast > slow, (rank, fast, slow)
        assert all(p.stats.mismatched_epoch_exchanges == 0 for p in peers)
        _assert_edges_agree(peers)
    finally:
        close_all(peers)


def test_a_checkpoint_restores_every_edges_copies_and_refuses_other_neighbours() -> None:
    peers = build_network(RING4, mlp_models(4), lambda: EdgeChoco(parse_spec("topk:ratio=0.1")))
    try:
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            _local_step(peers, generator)
            gossip_round(peers)
        algorithm = peers[0].algorithm
        state = algorithm.state_dict()
        assert set(state["own_copies"]) == set(state["neighbour_copies"]) == {1, 3}
        saved = {j: [t.clone() for t in algorithm.own[j]] for j in algorithm.own}
        gossip_round(peers)
        assert any(not torch.equal(a, b) for a, b in zip(algorithm.own[1], saved[1], strict=True))
        algorithm.load_state_dict(state)
        for j, flats in saved.items():
            for a, b in zip(algorithm.own[j], flats, strict=True):
                assert torch.equal(a, b)
        bad = {**state, "own_copies": {1: state["own_copies"][1], 2: state["own_copies"][3]}}
        with pytest.raises(ValueError, match="choco-edge own copies"):
            algorithm.load_state_dict(bad)
        poisoned = [t.clone() for t in state["neighbour_copies"][3]]
        poisoned[0][0] = float("nan")
        bad = {**state, "neighbour_copies": {1: state["neighbour_copies"][1], 3: poisoned}}
        with pytest.raises(ValueError, match=r"copies of 3\[0\]: holds NaN/Inf"):
            algorithm.load_state_dict(bad)
        for j, flats in saved.items():  # nothing assigned
            for a, b in zip(algorithm.own[j], flats, strict=True):
                assert torch.equal(a, b)
    finally:
        close_all(peers)


def test_on_a_time_varying_graph_only_each_rounds_edges_move_and_the_sum_is_kept() -> None:
    """One-peer exponential graphs on 8 peers: a round mixes over one edge per peer. Choco with
    one public copy per peer is refused there (a neighbour outside the round would miss its
    update); with a copy pair per edge, an edge outside the round keeps its copies at both
    ends, so both ends still agree, the network sum is kept and consensus comes."""
    topology = build_topology("one-peer-exponential", n=8)
    with pytest.raises(ValueError, match="cannot run on the time-varying topology"):
        check_round_graphs(topology, Choco(parse_spec("topk:ratio=0.2")))
    peers = build_network(topology, mlp_models(8), lambda: EdgeChoco(parse_spec("topk:ratio=0.2")))
    try:
        before, distance = network_sum(peers), consensus_distance(peers)
        for r in range(12):
            copies = {
                (p.rank, j): [t.clone() for t in p.algorithm.own[j]]
                for p in peers
                for j in topology.neighbors(p.rank)
            }
            gossip_round(peers)
            for (i, j), saved in copies.items():
                active = j in topology.round_weights(i, r)[0]
                moved = any(
                    not torch.equal(a, b)
                    for a, b in zip(peers[i].algorithm.own[j], saved, strict=True)
                )
                assert moved == active, (r, i, j)
                for x, y in zip(
                    peers[i].algorithm.own[j], peers[j].algorithm.theirs[i], strict=True
                ):
                    assert torch.equal(x, y), (r, i, j)
        assert_sum_kept(before, peers, 1e-4)
        assert consensus_distance(peers) < 0.5 * distance
        assert_clean(peers)
    finally:
        close_all(peers)


@pytest.mark.parametrize("kind", ["choco-edge", "powergossip"])
def test_a_schedule_without_link_levels_puts_every_link_back_at_its_own_level(kind: str) -> None:
    """A schedule of groups alone, staged while one with link levels is in force, takes the
    links back to the algorithm's own level when it takes effect: its envelopes are expected
    at that level (they were expected at the levels in force, and every edge failed at its
    round)."""

    def make() -> EdgeChoco | PowerGossip:
        return EdgeChoco(parse_spec("topk:ratio=0.05")) if kind == "choco-edge" else PowerGossip(2)

    peers = build_network(RING4, mlp_models(4), make, round_timeout=3.0)
    try:
        low = peers[0].algorithm.level_costs(peers[0].gossiped).levels[0]
        leveled = levels_schedule(1, 2, dict.fromkeys(EDGES, low))
        names = tuple(name for name, _ in peers[0].gossiped)
        compressor = "topk:ratio=0.05" if kind == "choco-edge" else "identity"
        grouped = Schedule(2, 6, groups=(TensorGroup(names, compressor),), planner="mgwfbp")
        for peer in peers:
            peer.apply(leveled)
        for _ in range(4):
            gossip_round(peers)
        for peer in peers:
            peer.apply(grouped)
        for _ in range(3):
            gossip_round(peers)
        assert_clean(peers)
        own = 2 if kind == "powergossip" else peers[0].algorithm._require_ladder().ladder.default
        levels = peers[0].algorithm._link_levels if kind == "choco-edge" else None
        ranks = peers[0].algorithm._link_ranks if kind == "powergossip" else None
        assert (levels or ranks) == {1: own, 3: own}
        assert own != low
    finally:
        close_all(peers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_models_on_a_gpu_keep_their_copies_beside_them_and_both_ends_agree() -> None:
    peers = build_network(
        RING4,
        [m.cuda() for m in mlp_models(4)],
        lambda: EdgeChoco(parse_spec("randomk:ratio=0.1"), seed=2),
    )
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(4):
            with torch.no_grad():
                for peer in peers:
                    for p in peer.model.parameters():
                        p.add_(torch.randn(p.shape, generator=generator).cuda(), alpha=0.01)
            before = network_sum(peers)
            gossip_round(peers)
            assert_sum_kept(before, peers, 1e-4)
        assert_clean(peers)
        _assert_edges_agree(peers)
        assert all(t.is_cuda for p in peers for copies in p.algorithm.own.values() for t in copies)
    finally:
        close_all(peers)


def test_a_schedule_group_compressed_with_error_feedback_is_refused_naming_it() -> None:
    """The algorithm's own compressor is checked when it is built; a schedule's group may name
    another, and one with an error-feedback memory (neither saved per edge nor reset when an
    edge resumes) is refused before anything changes."""
    peers = build_network(RING4, mlp_models(4), lambda: EdgeChoco(parse_spec("topk:ratio=0.05")))
    try:
        names = tuple(name for name, _ in peers[0].gossiped)
        grouped = Schedule(1, 5, groups=(TensorGroup(names, "ef+topk:ratio=0.1"),), planner="x")
        with pytest.raises(ScheduleRefused, match=r"'ef\+topk:ratio=0.1', which keeps an error"):
            peers[0].apply(grouped)
        assert peers[0].schedules.newest.epoch == 0
        gossip_round(peers)
        assert_clean(peers)
    finally:
        close_all(peers)


class _Masked(torch.nn.Module):
    """A linear layer beside a persistent causal mask of -inf (a constant buffer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))


def test_a_peer_checkpoint_with_a_constant_minus_infinity_buffer_restores() -> None:
    """Restored tensors are checked finite for an algorithm's state (a NaN copy above), not
    for a model's constant buffers: a causal mask of -inf is legitimate and not gossiped."""
    peers = build_network(
        RING4, [_Masked() for _ in range(4)], lambda: EdgeChoco(parse_spec("topk:ratio=0.5"))
    )
    try:
        gossip_round(peers)
        state = peers[0].state_dict()
    finally:
        close_all(peers)
    model = _Masked()
    identity = Identity(0, RING4.hash, model_signature(model))
    transport = InMemoryTransport(identity, RING4.neighbors(0), InMemoryHub())
    algorithm = EdgeChoco(parse_spec("topk:ratio=0.5"))
    fresh = Peer(model, RING4, 0, algorithm, transport, ready=False)
    try:
        fresh.load_state_dict(state)
        assert torch.equal(fresh.model.mask, peers[0].model.mask)
        assert fresh.round == 1
    finally:
        fresh.close()
