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
from gossipcomp.transport.base import HelloAnswer
from tests.conftest import build_network

TIMEOUT_S = 2.0


def _silent_ring(algorithm: type, transport: str) -> list[Peer]:
    """ring4's peers over the in-process transport or real gRPC, started; only peer 0 will
    gossip: its neighbours 1 and 3 (and 2) never do."""
    models = []
    for rank in range(4):
        torch.manual_seed(rank)
        models.append(torch.nn.Linear(6, 4))
    return build_network(
        load_topology("ring4"), models, algorithm, transport=transport, round_timeout=TIMEOUT_S
    )


@pytest.mark.parametrize("transport", ["memory", "grpc"])
@pytest.mark.parametrize("algorithm", [DPSGD, PowerGossip], ids=["dpsgd", "powergossip"])
def test_a_round_with_a_silent_resume_and_a_silent_partner_waits_one_timeout(algorithm, transport):
    peers = _silent_ring(algorithm, transport)
    try:
        _one_round_waits_one_timeout(peers[0])
    finally:
        for p in peers:
            p.close()


def _one_round_waits_one_timeout(peer: Peer) -> None:
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
