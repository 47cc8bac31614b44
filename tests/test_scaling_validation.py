"""The scaling benchmark's validation (benchmarks/scaling.py): rounds timed inside one run, the
calibrated per-peer CPU costs, and the processor speed a run got, each checked on its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from gossipcomp.schedule import LinkCost, PeerCosts, simulate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scaling():
    spec = importlib.util.spec_from_file_location(
        "scaling_benchmark", ROOT / "benchmarks/scaling.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_round_is_stamped_once_every_peer_has_reported_it(scaling):
    clock = scaling.RoundClock(3)
    for rank in (0, 2):
        clock(rank, 0)
    assert clock.stamps == {}
    clock(1, 0)
    clock(0, 1)
    assert list(clock.stamps) == [0]
    wall, cpu = clock.stamps[0]
    assert wall > 0 and cpu > 0


def test_calibrated_costs_reproduce_their_own_ring_on_one_shared_processor(scaling):
    """On one processor the simulated ring's round is all its peers' CPU work: a ring as large
    as the calibration ring gets the calibration's own CPU seconds per round back."""
    calibration = {"peers": 6, "cpu_round_s": 0.06, "compute_share": 0.3}
    costs = scaling.per_peer_cpu_costs(calibration)
    assert costs.compute_s + 2 * costs.decompress_s == pytest.approx(0.01)
    assert costs.compute_s == pytest.approx(0.003)
    timeline = simulate("ring", 6, costs, LinkCost(0.0, 0.0), rounds=30, cores=1)
    assert timeline.round_s == pytest.approx(0.06, rel=1e-9)
    larger = simulate("ring", 12, costs, LinkCost(0.0, 0.0), rounds=30, cores=1)
    assert larger.round_s == pytest.approx(0.12, rel=1e-9)  # twice the peers, twice the work


def test_a_slower_processor_stretches_every_task(scaling):
    costs = PeerCosts(compute_s=0.002, message_bytes=100, compress_s=0.001, decompress_s=0.0005)
    half = scaling.at_speed(costs, 0.5)
    assert (half.compute_s, half.compress_s, half.decompress_s) == (0.004, 0.002, 0.001)
    assert half.message_bytes == 100
    full = simulate("ring", 5, costs, LinkCost(0.0, 0.0), rounds=20, cores=1).round_s
    slow = simulate("ring", 5, half, LinkCost(0.0, 0.0), rounds=20, cores=1).round_s
    assert slow == pytest.approx(2 * full, rel=1e-9)


def test_a_ring_calibrating_itself_is_predicted_exactly(scaling):
    """In-sample (a real timed ring of 4): predicted from its own CPU costs at its own speed,
    the ring's measured round time comes back: the validation adds nothing of its own."""
    result = scaling.validation([4], warmup=2, peer_rounds=120, calibrate=4, repeats=1)
    (row,) = result["validation"]
    assert row["measured_round_s"] > 0
    assert abs(row["relative_error"]) < 1e-9
    assert row["rounds"] == [2, 32]
