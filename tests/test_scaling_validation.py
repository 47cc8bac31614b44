"""The scaling benchmark's validation (benchmarks/scaling.py): rounds timed inside one run and
the per-peer costs calibrated on another ring, each checked on its own."""

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
    assert clock.stamps[0] > 0


@pytest.mark.parametrize("cores", [1, 2])
def test_calibrated_costs_reproduce_their_own_ring(scaling, cores):
    """The calibrated costs give the calibration ring's measured round time back, in the
    report's compute share; a larger ring on the same shared cores takes proportionally longer
    once every core is busy."""
    calibration = {"peers": 6, "round_s": 0.03, "compute_share": 0.3}
    costs = scaling.calibrated_costs(calibration, cores)
    assert costs.compute_s / (costs.compute_s + 2 * costs.decompress_s) == pytest.approx(0.3)
    own = simulate("ring", 6, costs, LinkCost(0.0, 0.0), rounds=30, cores=cores)
    assert own.round_s == pytest.approx(0.03, rel=1e-9)
    larger = simulate("ring", 12, costs, LinkCost(0.0, 0.0), rounds=30, cores=cores)
    assert larger.round_s == pytest.approx(0.06, rel=0.05)  # twice the peers, twice the work


def test_one_shared_core_serves_every_peer_task_in_turn(scaling):
    """On one core a round is all its peers' work: the calibrated per-peer cost is the round
    time over the peers."""
    costs = scaling.calibrated_costs({"peers": 6, "round_s": 0.06, "compute_share": 0.5}, 1)
    assert costs.compute_s + 2 * costs.decompress_s == pytest.approx(0.01)


def test_scaled_costs_stretch_every_task(scaling):
    costs = PeerCosts(compute_s=0.002, message_bytes=100, compress_s=0.001, decompress_s=0.0005)
    double = scaling.scaled(costs, 2.0)
    assert (double.compute_s, double.compress_s, double.decompress_s) == (0.004, 0.002, 0.001)
    assert double.message_bytes == 100
    full = simulate("ring", 5, costs, LinkCost(0.0, 0.0), rounds=20, cores=2).round_s
    slow = simulate("ring", 5, double, LinkCost(0.0, 0.0), rounds=20, cores=2).round_s
    assert slow == pytest.approx(2 * full, rel=1e-9)


def test_a_ring_calibrating_itself_is_predicted_exactly(scaling):
    """In-sample (a real timed ring of 4, a process per peer): predicted from costs calibrated
    on its own run, the ring's measured round time comes back: the validation adds nothing of
    its own."""
    result = scaling.validation([4], warmup=2, peer_rounds=120, calibrate=4, repeats=1)
    (row,) = result["validation"]
    assert row["measured_round_s"] > 0
    assert abs(row["relative_error"]) < 1e-9
    assert row["rounds"] == [2, 32]
    assert result["cores"] == scaling.usable_cores()


@pytest.mark.parametrize("sizes", [["2"], ["4", "65"]])
def test_ring_sizes_a_process_per_peer_cannot_run_are_refused_before_anything_runs(
    scaling, sizes, capsys
):
    with pytest.raises(SystemExit) as stopped:
        scaling.main(["--validate", *sizes, "--calibrate", "4"])
    assert stopped.value.code == 2
    assert "expected ring sizes of 3 to 64" in capsys.readouterr().err
