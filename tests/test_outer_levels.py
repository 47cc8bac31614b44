"""Per-link levels of the adaptive rate under an outer optimizer (issue 26: "the per-link
levels of the adaptive rate ... applying unchanged").

Four PowerGossip peers on a ring over real gRPC, a different rank on each link (changed
mid-run), phases of two local steps ended on their own by `after_local_step()`. With the
NoLoCo-style outer step and drift tracking, every link carries exactly the bytes it carries
without them, round by round, both ends of each link hold the same power vectors, and the
models differ (the outer layer acted)."""

from __future__ import annotations

import torch
from conftest import grpc_network, run_in_threads
from helpers import assert_clean, close_all, levels_schedule, mlp_models

from gossipcomp.gossip import PowerGossip
from gossipcomp.outer import parse_drift, parse_outer
from gossipcomp.topology import build_topology

RING4 = build_topology("ring", n=4)
H = 2
PHASES = 8


def _local_step(model: torch.nn.Module, rank: int) -> None:
    """A deterministic step toward a peer-specific point (dissimilar "data")."""
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * (p - (rank - 1.5)))


def _run(outer: str | None, drift: str | None) -> tuple[list[list[dict[int, int]]], list, list]:
    """Per phase, the bytes each peer sent each neighbour; the final parameters; the
    PowerGossip states of the peers."""
    peers = grpc_network(
        RING4,
        mlp_models(4),
        lambda: PowerGossip(rank=2),
        outer=None if outer is None else parse_outer(outer),
        drift=None if drift is None else parse_drift(drift),
        local_steps=H,
    )
    try:
        first = levels_schedule(1, 2, {(0, 1): 1, (1, 2): 4, (2, 3): 16})
        second = levels_schedule(2, 5, {(0, 1): 8, (1, 2): 2, (0, 3): 3})
        for peer in peers:
            peer.apply(first)
            peer.apply(second)
        sent: list[list[dict[int, int]]] = []
        for _ in range(PHASES):
            start = [dict(p.stats.bytes_sent) for p in peers]

            def phase(peer):
                gossiped = [False] * H
                for s in range(H):
                    _local_step(peer.model, peer.rank)
                    gossiped[s] = peer.after_local_step()
                assert gossiped == [False] * (H - 1) + [True]  # the phase ends on its own

            run_in_threads([lambda p=p: phase(p) for p in peers])
            sent.append(
                [
                    {j: n - start[p.rank].get(j, 0) for j, n in p.stats.bytes_sent.items()}
                    for p in peers
                ]
            )
        assert_clean(peers)
        assert all(p.round == PHASES for p in peers)
        params = [[t.detach().clone() for t in p.model.parameters()] for p in peers]
        states = [dict(p.algorithm._state) for p in peers]
        return sent, params, states
    finally:
        close_all(peers)


def test_per_link_levels_apply_unchanged_under_an_outer_optimizer_and_drift_tracking():
    plain_sent, plain_params, _ = _run(None, None)
    outer_sent, outer_params, states = _run("noloco", "tracking")
    # the links' levels shaped the traffic: round 3 (first schedule) 16 > 4 > 1 in bytes,
    # round 6 (second schedule) link 0-1 at rank 8 above link 1-2 at rank 2
    assert outer_sent[3][2][3] > outer_sent[3][1][2] > outer_sent[3][0][1]
    assert outer_sent[6][0][1] > outer_sent[6][1][2]
    # the same bytes on every link in every round with or without the outer layer
    assert outer_sent == plain_sent
    # both ends of every edge agree on their power vectors
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
        for (j, i, side), vector in states[a].items():
            if j == b:
                torch.testing.assert_close(vector, states[b][(a, i, side)], rtol=0, atol=0)
    # and the outer step and the correction did act on the models
    assert any(
        not torch.equal(x, y)
        for mine, theirs in zip(outer_params, plain_params, strict=True)
        for x, y in zip(mine, theirs, strict=True)
    )
