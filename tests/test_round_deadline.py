"""One round timeout bounds a whole round's waiting (issue 27's "no stall longer than one round
timeout"): a round's exchanges (an edge's resume, then the algorithm's phases) draw on one
budget (gossip/round_wait.py), so a round in which two neighbours stay silent one after the
other waits about one timeout, not one per exchange."""

from __future__ import annotations

import time

import pytest
import torch

from gossipcomp.gossip import DPSGD, PowerGossip
from gossipcomp.gossip.round_wait import MAX_FLOOR_S, RoundWait
from gossipcomp.peer import Peer
from gossipcomp.peer.links import LinkState
from gossipcomp.topology import load_topology
from gossipcomp.transport.base import HelloAnswer, Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload.models import model_signature

TIMEOUT_S = 2.0


def _silent_ring(algorithm: type) -> Peer:
    """Peer 0 of ring4 over the in-process transport, started; its neighbours 1 and 3 (and 2)
    are started too but never gossip."""
    topology = load_topology("ring4")
    hub = InMemoryHub()
    peers = []
    for rank in range(4):
        torch.manual_seed(rank)
        model = torch.nn.Linear(6, 4)
        identity = Identity(rank, topology.hash, model_signature(model))
        transport = InMemoryTransport(identity, topology.neighbors(rank), hub)
        peers.append(Peer(model, topology, rank, algorithm(), transport, round_timeout=TIMEOUT_S))
    for peer in peers:
        peer.start(5, {})
    return peers[0]


@pytest.mark.parametrize("algorithm", [DPSGD, PowerGossip], ids=["dpsgd", "powergossip"])
def test_a_round_with_a_silent_resume_and_a_silent_partner_waits_one_timeout(algorithm):
    peer = _silent_ring(algorithm)
    # the edge to 1 resumes at round 1 (agreed by a handshake); the edge to 3 is up
    assert peer.links.resume(1, HelloAnswer(round=0, resume_round=1), peer.round, alone=False)
    peer.round = 1
    start = time.perf_counter()
    peer.gossip()
    elapsed = time.perf_counter() - start
    # the resume exchange with 1 and the model exchange with 3 both went unanswered: one
    # timeout for the two, plus the model exchange's floor (it used to be one timeout each,
    # 2 x TIMEOUT_S and more)
    assert peer.links.state(1) is LinkState.DOWN
    assert peer.links.state(3) is LinkState.DOWN
    assert 0.9 * TIMEOUT_S <= elapsed < 1.5 * TIMEOUT_S, elapsed
    assert peer.round == 2


def test_the_round_budget_is_shared_and_each_exchange_keeps_a_floor():
    wait = RoundWait(5.0)
    assert wait.timeout() == 5.0
    wait.spent(3.0)
    assert wait.timeout() == 2.0  # what is left for the next exchange
    wait.spent(2.5)
    assert wait.timeout() == pytest.approx(0.05)  # spent: a hundredth, envelopes there are taken
    assert RoundWait(60.0, waited=60.0).timeout() == MAX_FLOOR_S  # at most 50 ms
    wait.spent(-1.0)  # a clock step back counts nothing
    assert wait.waited == 5.5
