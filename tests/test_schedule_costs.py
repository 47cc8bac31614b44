"""Tests for schedule/costs.py and groups.py: alpha-beta fits, the bounded transfer log,
measured compressor costs, the iteration equations, and the cover check of plans."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from gossipcomp.compress import parse_spec
from gossipcomp.schedule import (
    CompressorCost,
    CostModel,
    LinkCost,
    TensorGroup,
    TensorInfo,
    TransferLog,
    WireSize,
    check_cover,
    fit_link,
    measure_compressor,
    measure_seconds,
    predict_iteration,
)
from gossipcomp.schedule.groups import SHOWN_NAMES


def test_fit_link_recovers_latency_and_bandwidth_from_noisy_transfers() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1_000, 10_000_000, 200)
    alpha, beta = 4e-4, 2e-9
    seconds = alpha + beta * sizes + rng.normal(0, 2e-5, sizes.size)
    fit = fit_link(list(zip(sizes.tolist(), np.abs(seconds).tolist(), strict=True)))
    assert fit.latency_s == pytest.approx(alpha, rel=0.05)
    assert fit.seconds_per_byte == pytest.approx(beta, rel=0.01)


def test_fit_link_ignores_a_few_stalled_transfers() -> None:
    sizes = [1000 * k for k in range(1, 41)]
    samples = [(n, 1e-3 + 1e-8 * n) for n in sizes]
    samples[5] = (sizes[5], 2.0)  # a stall (a scheduler tick, a retransmit) far off the line
    samples[17] = (sizes[17], 3.5)
    fit = fit_link(samples)
    assert fit.latency_s == pytest.approx(1e-3, rel=1e-6)
    assert fit.seconds_per_byte == pytest.approx(1e-8, rel=1e-6)


def test_fit_link_never_returns_negative_costs() -> None:
    # times falling with size would fit a negative slope: clamped to 0, latency refitted alone
    fit = fit_link([(100, 3e-3), (10_000, 2e-3), (1_000_000, 1e-3)])
    assert fit.seconds_per_byte == 0.0 and fit.latency_s == pytest.approx(2e-3)


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([(100, 1e-3)], "expected (bytes, seconds) pairs of at least 2"),
        ([(100, 1e-3), (100, 2e-3)], "1 distinct size"),
        ([(-1, 1e-3), (100, 2e-3)], "bytes is -1"),
        ([(1 << 50, 1e-3), (100, 2e-3)], "bytes is 1125899906842624"),
        ([(True, 1e-3), (100, 2e-3)], "bytes is True"),
        ([(10, float("nan")), (100, 2e-3)], "seconds is nan"),
        ([(10, -1.0), (100, 2e-3)], "seconds is -1.0"),
        ([(10, 1e9), (100, 2e-3)], "seconds is 1000000000.0"),
        ([(10,), (100, 2e-3)], "not a (bytes, seconds) pair"),
    ],
)
def test_fit_link_refuses_bad_samples(samples: list, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fit_link(samples)


def test_errors_quote_hostile_values_shortened() -> None:
    with pytest.raises(ValueError) as caught:
        fit_link([("x" * 1_000_000, 1.0), (100, 2e-3)])
    assert len(str(caught.value)) < 300
    log = TransferLog()
    with pytest.raises(ValueError) as caught:
        log.record("L" * 1_000_000, 10, float("inf"))
    assert len(str(caught.value)) < 300


def test_transfer_log_keeps_only_the_newest_samples_per_link() -> None:
    log = TransferLog(per_link=16, max_links=4)
    for k in range(1000):
        log.record(3, 1000 + k, 1e-3 + 1e-9 * k)
    kept = log.samples(3)
    assert len(kept) == 16
    assert kept[0][0] == 1000 + 1000 - 16 and kept[-1][0] == 1999  # newest 16, oldest first
    assert log.links() == [3]


def test_transfer_log_fit_follows_a_link_that_slows_down() -> None:
    log = TransferLog(per_link=32)
    for k in range(64):  # fast, then ten times slower: the window keeps only the slow ones
        beta = 1e-9 if k < 32 else 1e-8
        size = 10_000 * (1 + k % 8)
        log.record("east", size, 5e-4 + beta * size)
    fit = log.fit("east")
    assert fit.seconds_per_byte == pytest.approx(1e-8, rel=1e-6)
    assert fit.latency_s == pytest.approx(5e-4, rel=1e-6)


def test_transfer_log_refuses_more_links_than_its_bound() -> None:
    log = TransferLog(per_link=4, max_links=2)
    log.record(0, 10, 1e-3)
    log.record(1, 10, 1e-3)
    log.record(1, 20, 1e-3)  # a known link: fine
    with pytest.raises(ValueError, match="expected at most 2"):
        log.record(2, 10, 1e-3)
    assert log.links() == [0, 1]


def test_transfer_log_with_one_size_needs_the_latency() -> None:
    log = TransferLog()
    for _ in range(10):
        log.record(1, 100_000, 2e-3)
    with pytest.raises(ValueError, match="one size only"):
        log.fit(1)
    fit = log.fit(1, latency_s=1e-3)
    assert fit.latency_s == 1e-3
    assert fit.seconds_per_byte == pytest.approx(1e-8)
    assert fit.seconds(100_000) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="no transfers recorded"):
        log.fit(7)


@pytest.mark.parametrize(("per_link", "max_links"), [(1, 4), (0, 4), (4, True), (4, 1 << 30)])
def test_transfer_log_bounds_are_checked(per_link: object, max_links: object) -> None:
    with pytest.raises(ValueError, match="TransferLog"):
        TransferLog(per_link=per_link, max_links=max_links)  # type: ignore[arg-type]


def test_measured_compressor_cost_grows_with_size() -> None:
    cost = measure_compressor("sign", [10_000, 1_000_000, 4_000_000], repeats=5)
    assert cost.per_element_s > 0
    # compress + decompress of 4M elements under the fit is at least the time to read them
    assert cost.seconds(4_000_000) > 4_000_000 * 1e-11


@pytest.mark.parametrize(
    ("sizes", "repeats", "message"),
    [([0, 100], 3, "size 0"), ([100, 1 << 30], 3, "size 1073741824"), ([10, 100], 0, "repeats")],
)
def test_measure_compressor_refuses_bad_arguments(sizes: list, repeats: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        measure_compressor("sign", sizes, repeats=repeats)


def test_measure_seconds_times_a_step() -> None:
    calls = []

    def step() -> None:
        calls.append(1)
        time.sleep(0.002)

    seconds = measure_seconds(step, repeats=3)
    assert len(calls) == 4  # one warm-up, three timed
    assert 0.002 <= seconds < 0.5


@pytest.mark.parametrize("spec", ["identity", "fp16", "sign", "qsgd:levels=16", "topk:ratio=0.01"])
def test_wire_size_matches_the_compressors_exact_size(spec: str) -> None:
    wire = WireSize.of(spec)
    compressor = parse_spec(spec)
    for numel in (1_000, 65_536, 3_000_001):
        exact = compressor.wire_bytes(numel)
        assert abs(wire.bytes(numel) - exact) <= max(8.0, 0.001 * exact)


def _model(mode: str = "gossip", compute_s: float = 0.01) -> CostModel:
    return CostModel(
        {"sign": CompressorCost(1e-4, 1e-9), "identity": CompressorCost(0.0, 0.0)},
        LinkCost(1e-3, 1e-8),
        compute_s,
        mode,  # type: ignore[arg-type]
    )


def test_gossip_iteration_is_compute_compression_and_one_transfer() -> None:
    tensors = [TensorInfo("a", 1000), TensorInfo("b", 3000)]
    groups = (TensorGroup(("a",), "sign"), TensorGroup(("b",), "identity"))
    sign_bytes = WireSize.of("sign").bytes(1000)
    expected = 0.01 + (1e-4 + 1e-9 * 1000) + 0.0 + 1e-3 + 1e-8 * (sign_bytes + 4 * 3000)
    assert predict_iteration(tensors, groups, _model()) == pytest.approx(expected, rel=1e-12)


def test_allreduce_iteration_follows_the_backward_timeline() -> None:
    # b is ready first (backward runs from the last tensor); identity costs nothing to compress
    tensors = [TensorInfo("a", 1000, ready_at=0.02), TensorInfo("b", 1000, ready_at=0.005)]
    groups = (TensorGroup(("a",), "identity"), TensorGroup(("b",), "identity"))
    transfer = 1e-3 + 1e-8 * 4000
    end_b = 0.005 + transfer
    end_a = max(0.02, end_b) + transfer
    assert predict_iteration(tensors, groups, _model("allreduce", 0.02)) == pytest.approx(end_a)
    # with compute longer than all communication, compute bounds the iteration
    assert predict_iteration(tensors, groups, _model("allreduce", 1.0)) == 1.0


def test_cost_model_refuses_unknown_compressors_and_bad_numbers() -> None:
    tensors = [TensorInfo("a", 10)]
    with pytest.raises(ValueError, match="no costs for compressor 'fp16'; measured: identity"):
        predict_iteration(tensors, (TensorGroup(("a",), "fp16"),), _model())
    with pytest.raises(
        ValueError, match=r"LinkCost: latency_s: expected a finite number in \[0, inf\), got -1"
    ):
        LinkCost(-1, 0)
    with pytest.raises(
        ValueError, match=r"per_element_s: expected a finite number in \[0, inf\), got nan"
    ):
        CompressorCost(0, math.nan)
    with pytest.raises(ValueError, match="mode is 'ring'"):
        CostModel({"sign": CompressorCost(0, 0)}, LinkCost(0, 0), 0.0, "ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^tensor 'a' numel: expected an integer >= 0, got -3$"):
        TensorInfo("a", -3)
    with pytest.raises(ValueError, match=r"ready_at \(seconds\): .* in \[0, inf\), got 'soon'$"):
        TensorInfo("a", 3, "soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ready_at \(seconds\): .*, got nan$"):
        TensorInfo("a", 3, math.nan)


NAMES = ["w0", "b0", "w1", "b1", "w2"]


def _groups(*runs: tuple[str, ...]) -> tuple[TensorGroup, ...]:
    return tuple(TensorGroup(run, "sign") for run in runs)


def test_check_cover_accepts_contiguous_runs_in_order() -> None:
    check_cover(_groups(("w0", "b0"), ("w1",), ("b1", "w2")), NAMES)
    check_cover(_groups(tuple(NAMES)), NAMES)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (_groups(("w0", "b0"), ("w1", "b1")), "leaves out 1 tensor.*'w2'"),
        (_groups(("w0", "b0", "w1"), ("w1", "b1", "w2")), "more than once.*'w1'"),
        (_groups(tuple(NAMES), ("ghost",)), "1 unknown tensor.*'ghost'"),
        (_groups(tuple(NAMES), ()), "group 1 is empty"),
    ],
)
def test_check_cover_refuses_what_is_not_a_cover(
    groups: tuple[TensorGroup, ...], message: str
) -> None:
    for contiguous in (True, False):
        with pytest.raises(ValueError, match=message):
            check_cover(groups, NAMES, contiguous=contiguous)


def test_any_sets_cover_when_not_contiguous() -> None:
    scattered = _groups(("w0", "w1", "w2"), ("b1", "b0"))
    check_cover(scattered, NAMES, contiguous=False)
    with pytest.raises(ValueError, match="out of model order at tensor 1"):
        check_cover(scattered, NAMES)


def test_check_cover_messages_stay_short_for_hostile_plans() -> None:
    ghosts = tuple("g" * 10_000 + str(k) for k in range(10_000))
    with pytest.raises(ValueError) as caught:
        check_cover(_groups(tuple(NAMES), ghosts), NAMES, contiguous=False)
    message = str(caught.value)
    assert "10000 unknown tensor(s)" in message and f"and {10_000 - SHOWN_NAMES} more" in message
    assert len(message) < 1000


def test_cost_model_and_tensors_refuse_hostile_specs_and_names() -> None:
    with pytest.raises(ValueError, match="expected a string of 1 to 200") as caught:
        _model().costs_of("sign" * 100_000)
    assert len(str(caught.value)) < 300
    with pytest.raises(ValueError, match="expected a CompressorCost"):
        CostModel({"sign": (1e-4, 1e-9)}, LinkCost(0, 0), 0.0)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="0 compressor costs"):
        CostModel({}, LinkCost(0, 0), 0.0)
    with pytest.raises(ValueError, match="tensor name"):
        TensorInfo("", 3)
    with pytest.raises(ValueError, match="tensor name"):
        TensorInfo(7, 3)  # type: ignore[arg-type]
