"""Tests for schedule/timeline.py: round times worked out from the model's equations, the event
loop against the max-plus recurrence, synchronisation with neighbours, speed at 1024 peers, and
errors on bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gossipcomp.schedule import LAYOUTS, LinkCost, PeerCosts, simulate
from gossipcomp.schedule.timeline import (
    _compute_draws,
    _gossip_dedicated,
    _gossip_shared,
    neighbour_lists,
)

LINK = LinkCost(1e-3, 1e-9)
COSTS = PeerCosts(compute_s=0.01, message_bytes=1_000_000, compress_s=0.002, decompress_s=0.0005)


@pytest.mark.parametrize(("layout", "degree"), [("ring", 2), ("torus", 4), ("exponential", 7)])
def test_gossip_round_without_jitter_follows_the_equations(layout: str, degree: int) -> None:
    # every peer alike: step, then sends one after another (the last leaves after degree
    # transfers of 1 ms of bytes), then one decode per neighbour
    timeline = simulate(layout, 16, COSTS, LINK, rounds=6)  # type: ignore[arg-type]
    expected = 0.01 + 0.002 + 1e-3 + degree * 1e-3 + degree * 0.0005
    assert timeline.round_s == pytest.approx(expected, rel=1e-9)
    assert timeline.efficiency == pytest.approx(0.01 / expected, rel=1e-9)
    parallel = simulate(layout, 16, COSTS, LINK, rounds=6, shared_uplink=False)  # type: ignore[arg-type]
    assert parallel.round_s == pytest.approx(0.01 + 0.002 + 2e-3 + degree * 0.0005, rel=1e-9)


def test_ring_allreduce_without_jitter_follows_the_equations() -> None:
    n = 32
    timeline = simulate("ring-allreduce", n, COSTS, LINK, rounds=5)
    steps = 2 * (n - 1) * (1e-3 + 1e-9 * 1_000_000 / n)
    assert timeline.round_s == pytest.approx(0.01 + 0.002 + steps + 0.0005, rel=1e-9)


def test_ring_allreduce_closed_form_matches_the_step_by_step_recurrence() -> None:
    n, rounds = 12, 4
    jittery = PeerCosts(0.01, 240_000, 0.001, 0.002, compute_jitter=0.6)
    timeline = simulate("ring-allreduce", n, jittery, LINK, rounds=rounds, seed=7)
    compute = _compute_draws(jittery, rounds, n, 7)
    chunk = 1e-3 + 1e-9 * 240_000 / n
    end = np.zeros(n)
    for r in range(rounds):
        t = end + compute[r] + 0.001
        for _ in range(2 * (n - 1)):  # each peer waits for its predecessor's chunk
            t = np.maximum(t, np.roll(t, 1)) + chunk
        end = t + 0.002
        np.testing.assert_allclose(timeline.finish[r], end, rtol=1e-12)


@pytest.mark.parametrize("layout", ["ring", "torus", "exponential"])
def test_event_loop_with_a_processor_per_peer_equals_the_recurrence(layout: str) -> None:
    jittery = PeerCosts(0.01, 500_000, 0.001, 0.0004, compute_jitter=0.5)
    neighbours = neighbour_lists(layout, 16)  # type: ignore[arg-type]
    compute = _compute_draws(jittery, 8, 16, 3)
    for uplink in (True, False):
        recurrence = _gossip_dedicated(neighbours, compute, jittery, LINK, uplink)
        events = _gossip_shared(neighbours, compute, jittery, LINK, uplink, cores=16)
        np.testing.assert_allclose(events, recurrence, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_shared_processors_serve_every_peers_work(cores: int) -> None:
    # CPU-bound (no link time): n peers' steps and decodes share `cores` processors, so a round
    # takes n * (step + 2 decodes) / cores
    work = PeerCosts(compute_s=0.004, message_bytes=0, decompress_s=0.001)
    free_link = LinkCost(0.0, 0.0)
    timeline = simulate("ring", 8, work, free_link, rounds=12, cores=cores)
    assert timeline.round_s == pytest.approx(8 * 0.006 / cores, rel=1e-9)


@pytest.mark.parametrize("cores", [None, 3])
def test_no_peer_finishes_a_round_before_its_neighbours_finished_the_last(
    cores: int | None,
) -> None:
    jittery = PeerCosts(0.01, 100_000, compute_jitter=1.0)
    timeline = simulate("exponential", 32, jittery, LINK, rounds=10, cores=cores, seed=1)
    neighbours = neighbour_lists("exponential", 32)
    finish = timeline.finish
    for r in range(1, 10):
        for i, nbrs in enumerate(neighbours):
            assert finish[r, i] > finish[r - 1, nbrs].max()
            assert finish[r, i] > finish[r - 1, i]


def test_jitter_costs_global_synchronisation_more_than_neighbourly() -> None:
    # the same mean compute: ring all-reduce waits for the slowest of all peers every round,
    # ring gossip only for its neighbours; with a free link the difference is all waiting
    jittery = PeerCosts(0.01, 0, compute_jitter=0.5)
    free_link = LinkCost(0.0, 0.0)
    gossip = simulate("ring", 512, jittery, free_link, rounds=40)
    allreduce = simulate("ring-allreduce", 512, jittery, free_link, rounds=40)
    steady = simulate("ring", 512, PeerCosts(0.01, 0), free_link, rounds=40)
    assert steady.efficiency == pytest.approx(1.0)
    assert 1.0 > gossip.efficiency > allreduce.efficiency


def test_compute_draws_have_mean_compute() -> None:
    draws = _compute_draws(PeerCosts(0.02, 0, compute_jitter=0.4), 200, 500, 0)
    assert draws.mean() == pytest.approx(0.02, rel=0.01)
    assert np.std(np.log(draws)) == pytest.approx(0.4, rel=0.02)


def test_graphs_have_the_expected_degrees() -> None:
    degrees = {
        layout: {int(n.size) for n in neighbour_lists(layout, 1024)}  # type: ignore[arg-type]
        for layout in ("ring", "torus", "exponential")
    }
    assert degrees == {"ring": {2}, "torus": {4}, "exponential": {19}}
    with pytest.raises(ValueError, match="13 peers do not make a grid"):
        neighbour_lists("torus", 13)


def test_1024_peers_simulate_quickly() -> None:
    # CPU time of this thread: the simulator's cost, whatever else the shared machine runs
    for layout in LAYOUTS:
        start = time.thread_time()
        timeline = simulate(layout, 1024, PeerCosts(0.01, 100_000, compute_jitter=0.3), LINK, 30)
        assert time.thread_time() - start < 2.0, layout
        assert timeline.finish.shape == (30, 1024)
    start = time.thread_time()
    simulate("ring", 1024, PeerCosts(0.01, 100_000, compute_jitter=0.3), LINK, 20, cores=2)
    assert time.thread_time() - start < 10.0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"layout": "mesh"}, "unknown layout 'mesh'"),
        ({"peers": 2}, "peers: expected an integer in \\[3, 16384\\], got 2"),
        ({"peers": 100_000}, "peers: expected an integer in \\[3, 16384\\], got 100000"),
        ({"rounds": 0}, "rounds: expected an integer in \\[1, 100000\\], got 0"),
        ({"warmup": 5, "rounds": 5}, "warmup: expected an integer in \\[0, 4\\], got 5"),
        ({"cores": 0}, "cores: expected an integer in \\[1, 1048576\\], got 0"),
        ({"layout": "ring-allreduce", "cores": 2}, "one processor per peer"),
    ],
)
def test_simulate_refuses_bad_arguments(arguments: dict, message: str) -> None:
    call = {"layout": "ring", "peers": 8, "rounds": 5} | arguments
    with pytest.raises(ValueError, match=message):
        simulate(
            call["layout"],
            call["peers"],
            COSTS,
            LINK,
            call["rounds"],
            **{k: v for k, v in call.items() if k in ("cores", "warmup")},
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compute_s", -1.0),
        ("compress_s", float("nan")),
        ("message_bytes", -5),
        ("message_bytes", 2.5),
        ("compute_jitter", 9.0),
        ("decompress_s", True),
    ],
)
def test_peer_costs_are_range_checked(field: str, value: object) -> None:
    arguments = {"compute_s": 0.01, "message_bytes": 10} | {field: value}
    with pytest.raises(
        ValueError, match=f"^PeerCosts: {field}: expected an? (finite number|integer) in"
    ):
        PeerCosts(**arguments)  # type: ignore[arg-type]
