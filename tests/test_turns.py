"""Peers sharing a process take turns computing: at most `slots` compute at once, and a peer
gives its turn up while it waits for its neighbours (or the ring would deadlock)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gossipcomp.experiment import PeerTrainer, TrainConfig, build_algorithm
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.peer import Peer
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload.data import load_digits_split
from gossipcomp.workload.models import build_model, model_signature


class _Overlap:
    """Counts the peers inside a forward pass at once (each lingers a millisecond there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def enter(self, *_: object) -> None:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.001)  # the interpreter lock is free here: only turns keep others out

    def leave(self, *_: object) -> None:
        with self._lock:
            self.inside -= 1


def _train_ring(peers: int, turns: ComputeTurns | None, rounds: int = 12) -> tuple[int, list]:
    """A ring of peers over the in-memory transport, each training in its own thread; returns
    the most peers ever inside a forward pass at once, and each peer's final parameters."""
    topology = build_topology("ring", n=peers)
    config = TrainConfig(algorithm="powergossip", rank=1, rounds=rounds, eval_every=0)
    data = load_digits_split(seed=0)
    hub, overlap, trainers = InMemoryHub(), _Overlap(), []
    for rank in range(peers):
        model = build_model(config.model, config.seed)
        model.register_forward_pre_hook(overlap.enter)
        model.register_forward_hook(overlap.leave)
        transport = InMemoryTransport(
            Identity(rank, topology.hash, model_signature(model)), topology.neighbors(rank), hub
        )
        algorithm = build_algorithm(config, topology, rank)
        peer = Peer(model, topology, rank, algorithm, transport, turns=turns)
        trainers.append(PeerTrainer(peer, data, config))
    for trainer in trainers:
        trainer.peer.start(10, {})
    errors: list[BaseException] = []

    def run(trainer: PeerTrainer) -> None:
        try:
            trainer.run()
        except BaseException as error:  # re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "the ring never finished"
    finally:
        for trainer in trainers:
            trainer.peer.close()
    if errors:
        raise errors[0]
    return overlap.most, [[p.detach().clone() for p in t.peer.model.parameters()] for t in trainers]


def test_one_slot_lets_one_peer_compute_at_a_time_and_the_ring_still_finishes():
    alone, alone_params = _train_ring(4, ComputeTurns(1))
    assert alone == 1
    together, together_params = _train_ring(4, None)
    assert together > 1  # without turns the peers' forward passes overlap (the check can fail)
    # turns change who waits, never what is computed: the same models bit for bit
    for mine, theirs in zip(alone_params, together_params, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_two_slots_let_at_most_two_peers_compute_at_once():
    most, _ = _train_ring(6, ComputeTurns(2))
    assert 1 <= most <= 2


def test_a_thread_waiting_gives_its_slot_to_another():
    """The holder of the only slot waits for something only another thread's turn makes
    happen: it must give the slot up meanwhile (or both wait forever)."""
    turns, done = ComputeTurns(1), threading.Event()

    def other() -> None:
        with turns.turn():
            done.set()

    with turns.turn():
        helper = threading.Thread(target=other)
        helper.start()
        with turns.waiting():
            assert done.wait(10), "the other thread never got a turn"
        assert turns.holding()
    helper.join(10)
    assert not turns.holding()


def test_turns_nest_and_waiting_without_a_turn_takes_nothing():
    turns = ComputeTurns(1)
    with turns.waiting():  # holds nothing: gives nothing up, takes nothing back
        assert not turns.holding()
    with turns.turn(), turns.turn():  # the same thread again: no second slot, no deadlock
        assert turns.holding()
    assert not turns.holding()


@pytest.mark.parametrize("slots", [0, -1])
def test_fewer_than_one_slot_is_refused(slots):
    with pytest.raises(ValueError, match="expected at least 1 slot"):
        ComputeTurns(slots)
