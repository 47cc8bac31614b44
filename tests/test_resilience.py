"""Faults in one process: partitions that heal, asymmetric failures, the live mixing matrix,
and checkpoints that restore a network exactly.

Faults are injected deterministically by the in-memory hub (messages lost both ways, or an
acknowledgement lost); processes that really die are in tests/test_peer_processes.py.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import consensus_distance, in_memory_trainers, run_in_threads, stacked
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.experiment import PeerTrainer, TrainConfig
from gossipcomp.gossip import DEFATC, DPSGD, Choco, EdgeChoco, LinkStats, PowerGossip
from gossipcomp.peer import Peer
from gossipcomp.peer.links import Backoff, LinkState
from gossipcomp.topology import Topology, load_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import Fault, InMemoryHub, InMemoryTransport
from gossipcomp.workload.checkpoint import CheckpointStore
from gossipcomp.workload.models import model_signature

FAST_BACKOFF = Backoff(first=0.005, longest=0.02)


def _models(n: int) -> list[nn.Module]:
    out = []
    for r in range(n):
        torch.manual_seed(100 + r)
        out.append(nn.Sequential(nn.Linear(9, 6), nn.Linear(6, 3)))
    return out


def _network(
    topology: Topology,
    models,
    algorithm,
    hub: InMemoryHub,
    round_timeout: float = 0.3,
    states: list[dict] | None = None,
) -> list[Peer]:
    peers = []
    for r, m in enumerate(models):
        identity = Identity(r, topology.hash, model_signature(m))
        transport = InMemoryTransport(identity, topology.neighbors(r), hub)
        peers.append(
            Peer(
                m,
                topology,
                r,
                algorithm(),
                transport,
                round_timeout=round_timeout,
                backoff=FAST_BACKOFF,
                max_failed_rounds=0,  # peers cut off on purpose must not stop
            )
        )
    for p, state in zip(peers, states or [None] * len(peers), strict=True):
        if state is not None:
            p.load_state_dict(state)
    for p in peers:
        p.start(5, {})
    return peers


def _rounds(peers: list[Peer], n: int, pause: float = 0.0) -> None:
    for _ in range(n):
        run_in_threads([p.gossip for p in peers])
        if pause:
            time.sleep(pause)


def _all_up(peers: list[Peer]) -> bool:
    return all(
        p.links.state(j) is LinkState.UP for p in peers for j in p.topology.neighbors(p.rank)
    )


def _rounds_until_all_up(peers: list[Peer], limit: int, pause: float) -> bool:
    """Gossip round by round (at most `limit`) until every edge is up; whether they all are."""
    for _ in range(limit):
        _rounds(peers, 1, pause=pause)
        if _all_up(peers):
            return True
    return False


class _FreeRunning:
    """Every peer gossiping in its own thread, pausing `pause(peer)` seconds before each round (a
    stand-in for the local step: a peer alone does not spin), until `stop` names a round at which
    all of them stop together."""

    def __init__(self, peers: list[Peer], pause) -> None:
        self._peers = peers
        self._pause = pause
        self._stop_at: list[int] = []
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in peers]
        for t in self._threads:
            t.start()

    def _run(self, peer: Peer) -> None:
        while not self._stop_at or peer.round < self._stop_at[0]:
            time.sleep(self._pause(peer))
            peer.gossip()

    def stop(self, after: int) -> int:
        """Stop every peer at `after` rounds past the furthest one; return that round."""
        self._stop_at.append(max(p.round for p in self._peers) + after)
        for t in self._threads:
            t.join(30)
        return self._stop_at[0]


def _group_sum(peers: list[Peer], group: range) -> list[torch.Tensor]:
    return [x[list(group)].sum(0) for x in stacked(peers)]


def _live_matrix(peers: list[Peer]) -> torch.Tensor:
    """The mixing matrix the peers use this round, rebuilt from each one's live neighbourhood."""
    n = len(peers)
    w = torch.zeros(n, n, dtype=torch.float64)
    for p in peers:
        hood = p._neighbourhood(LinkStats(), p.links.live())
        w[p.rank, p.rank] = hood.self_weight
        for j, weight in hood.weights.items():
            w[p.rank, j] = weight
    return w


ALGORITHMS = {
    "dpsgd": lambda: DPSGD(consensus_step=1.0),
    "choco-sign": lambda: Choco(parse_spec("sign")),
    "choco-edge-sign": lambda: EdgeChoco(parse_spec("sign")),
    "powergossip": lambda: PowerGossip(rank=2, consensus_step=1.0),
    "def-sign": lambda: DEFATC(parse_spec("sign")),
}
PRESERVES_SUM = {"dpsgd", "choco-sign", "choco-edge-sign", "powergossip"}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_partition_then_heal_each_side_keeps_its_sum_and_consensus_returns(name):
    """ring8 cut into {0..3} and {4..7}: neither side's sum moves while cut (no half-applied
    exchange), the live mixing matrix stays symmetric and doubly stochastic, and after healing
    the edges resume and the whole network comes to consensus, with the global sum kept."""
    topology = load_topology("topologies/ring8.yaml")
    hub = InMemoryHub()
    models = _models(8) if name != "def-sign" else [copy.deepcopy(_models(1)[0]) for _ in range(8)]
    peers = _network(topology, models, ALGORITHMS[name], hub)
    if name == "def-sign":  # DEF-ATC's references start at the common model: perturb after setup
        with torch.no_grad():
            for p in peers:
                for q in p.model.parameters():
                    q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(p.rank)))
    total = [x.sum(0) for x in stacked(peers)]
    _rounds(peers, 2)
    left, right = range(0, 4), range(4, 8)
    hub.partition(left, right)
    _rounds(peers, 1)  # the cut is seen at once: lost pushes fail, no deadline waited
    sides = (_group_sum(peers, left), _group_sum(peers, right))
    start = time.monotonic()
    _rounds(peers, 30)
    assert time.monotonic() - start < 30 * 0.3 / 2, "rounds waited for the cut neighbours"
    for p in peers:
        cut = {0: 7, 3: 4, 4: 3, 7: 0}.get(p.rank)
        if cut is not None:
            assert p.links.state(cut) is LinkState.DOWN
    w = _live_matrix(peers)
    assert w[3, 4] == w[4, 3] == w[0, 7] == w[7, 0] == 0
    assert torch.allclose(w, w.T) and torch.allclose(w.sum(1), torch.ones(8, dtype=w.dtype))
    assert bool((w >= 0).all())
    if name in PRESERVES_SUM:
        for before, after in zip(
            sides, (_group_sum(peers, left), _group_sum(peers, right)), strict=True
        ):
            for b, a in zip(before, after, strict=True):
                assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    # each side agrees within itself, not with the other side
    means = [[x[list(g)].mean(0) for x in stacked(peers)] for g in (left, right)]
    gap = sum(float((a - b).pow(2).sum()) for a, b in zip(*means, strict=True))
    d_cut = consensus_distance(peers)
    assert gap > 0.1 * d_cut

    hub.heal()
    assert _rounds_until_all_up(peers, 100, pause=0.005), "edges did not resume after healing"
    _rounds(peers, 120 if name != "def-sign" else 200)
    assert consensus_distance(peers) < 1e-3 * d_cut
    if name in PRESERVES_SUM:
        for b, x in zip(total, stacked(peers), strict=True):
            assert torch.allclose(x.sum(0), b, atol=1e-4), (x.sum(0) - b).abs().max()


def test_after_a_partition_where_one_side_ran_ahead_the_side_behind_catches_up(caplog):
    """The left half of a cut ring8 runs 20 rounds more than the right half. After healing, the
    right half jumps to the rounds of the left (a wave: each jump makes the next edge resume),
    every edge comes back, and free-running peers reach consensus with the sum kept."""
    topology = load_topology("topologies/ring8.yaml")
    hub = InMemoryHub()
    # a deadline generous enough that eight threads on two busy cores never miss one by accident
    peers = _network(topology, _models(8), ALGORITHMS["dpsgd"], hub, round_timeout=2.0)
    total = [x.sum(0) for x in stacked(peers)]
    _rounds(peers, 2)
    hub.partition(range(0, 4), range(4, 8))
    _rounds(peers, 3)
    _rounds(peers[:4], 20)
    assert [p.round for p in peers] == [25] * 4 + [5] * 4
    d_cut = consensus_distance(peers)
    hub.heal()
    with caplog.at_level("WARNING", logger="gossipcomp.peer"):
        running = _FreeRunning(peers, pause=lambda peer: 0.001)
        deadline = time.monotonic() + 60
        while not _all_up(peers) and time.monotonic() < deadline:
            time.sleep(0.01)
        came_back = _all_up(peers)
        all_up_at = max(p.round for p in peers)
        while min(p.round for p in peers) < all_up_at + 150 and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped_at = running.stop(after=5)
    assert came_back, "edges did not all resume"
    jumps = [r.getMessage() for r in caplog.records if "moves from round" in r.getMessage()]
    jumped = {int(m.split()[1].rstrip(":")) for m in jumps}
    assert jumped & {4, 5, 6, 7}, jumps  # the side behind caught up by jumping
    assert [p.round for p in peers] == [stopped_at] * 8
    assert consensus_distance(peers) < 1e-4 * d_cut
    for b, x in zip(total, stacked(peers), strict=True):
        assert torch.allclose(x.sum(0), b, atol=1e-4), (x.sum(0) - b).abs().max()


@pytest.mark.parametrize("name", ["choco-sign", "def-sign"])
def test_an_asymmetric_failure_is_healed_by_resynchronising_the_edge(name):
    """Peer 0's acknowledgement from peer 1 is lost once: peer 1 used peer 0's envelope, peer 0
    did not use peer 1's. Their copies of each other's state then disagree; the edge goes down,
    resumes at an agreed round, and afterwards each end's copy equals the other's own bit for
    bit, and (Choco) the network sum stops moving."""
    topology = load_topology("topologies/ring4.yaml")
    hub = InMemoryHub()
    peers = _network(
        topology, [copy.deepcopy(_models(1)[0]) for _ in range(4)], ALGORITHMS[name], hub
    )
    with torch.no_grad():
        for p in peers:
            for q in p.model.parameters():
                q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(p.rank)))

    def tracked(at: Peer, of: int) -> list[torch.Tensor]:
        algo = at.algorithm
        return algo.neighbour_public[of] if name == "choco-sign" else algo.neighbour_references[of]

    def own(p: Peer) -> list[torch.Tensor]:
        return p.algorithm.public if name == "choco-sign" else p.algorithm.reference

    _rounds(peers, 2)
    hub.inject(0, 1, Fault.ACK_LOST)
    _rounds(peers, 1)
    hub.heal()
    assert peers[0].links.state(1) is LinkState.DOWN
    assert any(
        not torch.equal(a, b) for a, b in zip(tracked(peers[0], 1), own(peers[1]), strict=True)
    )
    assert _rounds_until_all_up(peers, 60, pause=0.005)
    for p in peers:
        for j in p.topology.neighbors(p.rank):
            for a, b in zip(tracked(p, j), own(peers[j]), strict=True):
                assert torch.equal(a, b), (p.rank, j)
    if name == "choco-sign":
        before = [x.sum(0) for x in stacked(peers)]
        _rounds(peers, 10)
        for b, x in zip(before, stacked(peers), strict=True):
            assert torch.allclose(x.sum(0), b, atol=1e-4)


def _ring4_trainers(directory: Path | None, **settings: Any) -> list[PeerTrainer]:
    """ring4's trainers (TrainConfig(**settings), no evaluation) over a fresh in-memory hub,
    checkpointing into `directory` every 10 rounds (never without one)."""
    topology = load_topology("topologies/ring4.yaml")
    every = 10 if directory is not None else 0
    config = TrainConfig(eval_every=0, **settings)
    return in_memory_trainers(topology, config, InMemoryHub(), directory, every)


def _train(trainers: list[PeerTrainer]) -> None:
    for t in trainers:
        t.peer.start(5, {})
    run_in_threads([t.run for t in trainers])


def _state_of(trainer: PeerTrainer) -> list[torch.Tensor]:
    algo = trainer.peer.algorithm.state_dict()
    tensors = [p.detach() for p in trainer.peer.model.parameters()]
    for value in algo.values():
        items = [value[j] for j in sorted(value)] if isinstance(value, dict) else [value]
        for item in items:
            tensors += [t for t in item if isinstance(t, torch.Tensor)]
    assert len(tensors) > 6  # the algorithm's state is compared too, not only the model
    return tensors


@pytest.mark.parametrize(
    "algorithm,extra",
    [
        ("choco", {"compressor": "sign"}),
        ("def", {"compressor": "ef+topk:ratio=0.1"}),  # error-feedback memories are saved
        ("powergossip", {}),
        ("def", {"compressor": "topk:ratio=0.1"}),
        ("choco-edge", {"compressor": "qsgd:levels=4"}),  # a copy pair per edge is saved
    ],
)
def test_a_network_restored_from_checkpoints_continues_bit_for_bit(tmp_path, algorithm, extra):
    """Train 40 rounds straight; separately train 20, checkpoint, rebuild every peer from its
    files (new models, optimizers, algorithms, transports) and train 20 more: the models and
    every piece of algorithm state agree bit for bit, so nothing was lost or applied twice."""
    straight = _ring4_trainers(None, algorithm=algorithm, rounds=40, **extra)
    _train(straight)
    first = _ring4_trainers(tmp_path, algorithm=algorithm, rounds=20, **extra)
    _train(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"rank{r}-round{n:09d}.ckpt" for r in range(4) for n in (10, 20)
    ]
    resumed = _ring4_trainers(tmp_path, algorithm=algorithm, rounds=40, **extra)
    for t in resumed:
        assert t.restore() == 20
    _train(resumed)
    for a, b in zip(straight, resumed, strict=True):
        assert a.peer.round == b.peer.round == 40
        for x, y in zip(_state_of(a), _state_of(b), strict=True):
            assert torch.equal(x, y)
        assert a.peer.stats.bytes_sent == b.peer.stats.bytes_sent


def test_a_checkpoint_from_another_configuration_is_refused_naming_the_difference(tmp_path):
    _train(_ring4_trainers(tmp_path, algorithm="dpsgd", rounds=10))
    other = _ring4_trainers(tmp_path, algorithm="dpsgd", rounds=10, lr=0.05)
    with pytest.raises(ValueError, match=r"lr \(saved 0.1, now 0.05\)"):
        other[0].restore()
    wrong_model = _ring4_trainers(tmp_path, algorithm="choco", compressor="sign", rounds=10)
    with pytest.raises(ValueError, match="algorithm"):
        wrong_model[0].restore()
    assert wrong_model[0].peer.round == 0


def test_a_network_restarted_with_an_edge_down_resynchronises_it():
    """An acknowledgement from peer 1 to peer 0 is lost, and every peer is checkpointed right
    then (same round; peer 0 knows the edge is broken, peer 1 does not). Restored, the edge is
    not trusted: it resumes with a resynchronisation, after which both copies agree bit for bit
    and Choco's network sum holds."""
    topology = load_topology("topologies/ring4.yaml")
    first = copy.deepcopy(_models(1)[0])
    hub = InMemoryHub()
    # a deadline no busy core misses by accident: only the injected fault may fail an edge
    peers = _network(
        topology,
        [copy.deepcopy(first) for _ in range(4)],
        ALGORITHMS["choco-sign"],
        hub,
        round_timeout=2.0,
    )
    with torch.no_grad():
        for p in peers:
            for q in p.model.parameters():
                q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(p.rank)))
    _rounds(peers, 2)
    hub.inject(1, 0, Fault.ACK_LOST)
    _rounds(peers, 1)
    states = [p.state_dict() for p in peers]
    # peer 1 saw its push fail; peer 0 used peer 1's envelope, and its own push is refused
    # only when it reached peer 1 after peer 1 stopped waiting for it (threads race there)
    assert states[1]["down"] == [0] and states[0]["down"] in ([], [1])
    for p in peers:
        p.close()
    restored = _network(
        topology,
        [copy.deepcopy(first) for _ in range(4)],
        ALGORITHMS["choco-sign"],
        InMemoryHub(),
        states=states,
    )
    assert {p.round for p in restored} == {3}
    assert restored[1].links.state(0) is LinkState.RESUMING
    assert restored[0].links.state(1) is LinkState.RESUMING
    assert _rounds_until_all_up(restored, 30, pause=0.002)
    for p in restored:
        for j, tracked in p.algorithm.neighbour_public.items():
            for a, b in zip(tracked, restored[j].algorithm.public, strict=True):
                assert torch.equal(a, b), (p.rank, j)
    before = [x.sum(0) for x in stacked(restored)]
    _rounds(restored, 10)
    for b, x in zip(before, stacked(restored), strict=True):
        assert torch.allclose(x.sum(0), b, atol=1e-4)


def test_slow_handshake_answers_still_bring_an_isolated_peer_back():
    """Probe answers take 100 ms while the isolated peer 0 runs rounds every ~1 ms: an answer
    that arrives after its resume round is asked again with a doubled margin, until one is in
    time, and every edge comes back."""
    topology = load_topology("topologies/ring4.yaml")
    hub = InMemoryHub(hello_latency=0.1)
    peers = _network(topology, _models(4), ALGORITHMS["dpsgd"], hub, round_timeout=2.0)
    hub.partition([0], [1, 2, 3])
    # peer 0, alone, runs ahead fast
    running = _FreeRunning(peers, pause=lambda peer: 0.001 if peer.rank == 0 else 0.01)
    time.sleep(0.3)
    hub.heal()
    deadline = time.monotonic() + 20
    while not _all_up(peers) and time.monotonic() < deadline:
        time.sleep(0.01)
    came_back = _all_up(peers)
    running.stop(after=10)
    assert came_back, [
        (p.rank, p.round, [p.links.state(j) for j in p.topology.neighbors(p.rank)]) for p in peers
    ]


def test_a_restore_that_does_not_fit_changes_nothing(tmp_path):
    """A checkpoint whose last part is bad (a byte counter, then the batch stream) is refused
    with a ValueError naming it; the peer's round, model, algorithm state, optimizer and stream
    are exactly what they were."""
    topology = load_topology("topologies/ring4.yaml")
    config = TrainConfig(algorithm="choco", compressor="sign", rounds=10, eval_every=0)
    _train(in_memory_trainers(topology, config, InMemoryHub(), tmp_path, 10))
    store = CheckpointStore(tmp_path, 0)
    good = store.load_latest().state
    for broken, message in (
        ({**good, "peer": {**good["peer"], "bytes_sent": {1: -5}}}, "bytes_sent"),
        ({**good, "stream": {**good["stream"], "cursor": 10_000}}, "cursor 10000"),
    ):
        store.save(10, broken)
        fresh = in_memory_trainers(topology, config, InMemoryHub(), tmp_path, 10)[0]
        before = _state_of(fresh)
        optimizer_state = copy.deepcopy(fresh.optimizer.state_dict())
        stream_state = fresh.stream.state_dict()
        with pytest.raises(ValueError, match=message):
            fresh.restore()
        assert fresh.peer.round == 0
        for x, y in zip(before, _state_of(fresh), strict=True):
            assert torch.equal(x, y)
        assert fresh.optimizer.state_dict() == optimizer_state
        assert torch.equal(fresh.stream.state_dict()["order"], stream_state["order"])
