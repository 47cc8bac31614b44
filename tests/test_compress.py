"""Compressors: exact wire sizes, error bounds, unbiasedness, shared randomness, payload validation,
error feedback, and the numpy (CPU) and torch (any device) paths agreeing."""

from __future__ import annotations

import math

import pytest
import torch

from gossipcomp.compress import (
    COMPRESSORS,
    Compressed,
    CompressionContext,
    ErrorFeedback,
    PayloadError,
    kernels,
    parse_spec,
)
from gossipcomp.compress.sparse import largest, shared_indices

SIZES = (1, 7, 8, 9, 1000, 4097)
DEFAULT_SPECS = tuple(COMPRESSORS)
VARIANT_SPECS = (
    "topk:ratio=0.3",
    "randomk:ratio=0.5",
    "randomk:ratio=0.05,unbiased=true",
    "qsgd:levels=1",
    "qsgd:levels=5",
    "qsgd:levels=127",
    "dgc:ratio=0.05",
    "ef+topk:ratio=0.1",
    "ef+qsgd",
)
ALL_SPECS = DEFAULT_SPECS + VARIANT_SPECS


def ctx(
    round: int = 0, receiver: int = 1, tensor_index: int = 0, seed: int = 7
) -> CompressionContext:
    return CompressionContext(
        seed=seed, sender=0, receiver=receiver, round=round, tensor_index=tensor_index
    )


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def roundtrip(
    spec: str, x: torch.Tensor, context: CompressionContext | None = None
) -> torch.Tensor:
    compressor = parse_spec(spec)
    context = context or ctx()
    return compressor.decompress(compressor.compress(x, context), context)


def plane(d: int) -> int:
    return (d + 7) // 8


def k_of(ratio: float, d: int) -> int:
    return min(d, max(1, math.ceil(ratio * d - 1e-9)))


# --- wire sizes ------------------------------------------------------------------------------


def expected_wire_bytes(spec: str, d: int) -> int:
    """The documented formulas, written out independently of the code under test."""
    name = spec.removeprefix("ef+").split(":")[0]
    params = dict(p.split("=") for p in spec.split(":")[1].split(",")) if ":" in spec else {}
    if name == "identity":
        return 4 * d
    if name in ("fp16", "bf16"):
        return 2 * d
    if name == "topk":
        return 8 * k_of(float(params.get("ratio", 0.01)), d)
    if name == "randomk":
        return 4 * k_of(float(params.get("ratio", 0.01)), d)
    if name == "dgc":
        return 4 + 8 * k_of(float(params.get("ratio", 0.001)), d)
    if name == "qsgd":
        levels = int(params.get("levels", 16))
        return 4 + (1 + math.ceil(math.log2(levels + 1))) * plane(d)
    if name == "terngrad":
        return 4 + 2 * plane(d)
    if name == "sign":
        return 4 + plane(d)
    if name == "onebit":
        return 8 + plane(d)
    raise AssertionError(spec)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_payload_length_is_wire_bytes_known_in_advance(spec: str) -> None:
    compressor = parse_spec(spec)
    for d in SIZES + (0,):
        announced = compressor.wire_bytes(d)  # before anything is compressed
        assert announced == expected_wire_bytes(spec, d), (spec, d)
        shape = (10, 100) if d == 1000 else (d,)
        x = randn(*shape, seed=d)
        payload = compressor.compress(x, ctx(tensor_index=d))
        assert payload.nbytes == len(bytes(payload.data)) == announced, (spec, d)
        assert payload.codec == compressor.codec and payload.shape == shape
        decoded = compressor.decompress(payload, ctx(tensor_index=d))
        assert decoded.shape == shape and decoded.dtype == torch.float32
        # the same bytes as an immutable `bytes` object decode identically
        again = compressor.decompress(
            Compressed(payload.codec, shape, bytes(payload.data)), ctx(tensor_index=d)
        )
        assert torch.equal(decoded, again)


def test_k_rule_is_ceiling_without_float_noise() -> None:
    assert parse_spec("topk:ratio=0.07").wire_bytes(100) == 8 * 7  # 0.07 * 100 = 7.000000000000001
    assert parse_spec("topk:ratio=0.01").wire_bytes(1) == 8  # at least one
    assert parse_spec("topk:ratio=0.01").wire_bytes(150) == 8 * 2  # ceil(1.5)
    assert parse_spec("topk:ratio=1.0").wire_bytes(9) == 8 * 9  # clamped to d
    assert parse_spec("randomk:ratio=0.001").wire_bytes(0) == 0


@pytest.mark.parametrize("spec", DEFAULT_SPECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_and_layout(spec: str, dtype: torch.dtype) -> None:
    x = randn(30, 40).to(dtype).t().requires_grad_()  # non-contiguous, part of a graph
    decoded = roundtrip(spec, x)
    assert decoded.shape == (40, 30) and decoded.dtype == torch.float32
    if spec in ("identity", "topk", "randomk", "dgc", "sign", "onebit"):
        reference = roundtrip(spec, x.detach().to(torch.float32).contiguous())
        torch.testing.assert_close(decoded, reference, rtol=1e-6, atol=1e-6)


def test_integer_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        parse_spec("sign").compress(torch.arange(5), ctx())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_payload_is_deterministic_and_never_aliases_the_input(spec: str) -> None:
    x = randn(5000)
    original = x.clone()
    first = parse_spec(spec).compress(x, ctx())
    kept = bytes(first.data)
    x.mul_(3.0)  # the caller keeps training
    assert bytes(first.data) == kept
    assert bytes(parse_spec(spec).compress(original, ctx()).data) == kept


# --- error bounds ----------------------------------------------------------------------------


def test_identity_is_exact() -> None:
    x = randn(4097)
    assert torch.equal(roundtrip("identity", x), x)


def test_fp16_and_bf16_relative_error() -> None:
    x = randn(10000) * torch.logspace(-4, 4, 10000)
    fp16 = roundtrip("fp16", x)
    assert torch.all((fp16 - x).abs() <= 2**-11 * x.abs() + 2**-25)
    bf16 = roundtrip("bf16", x)
    assert torch.all((bf16 - x).abs() <= 2**-8 * x.abs())


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 65519.0, 3.0])
    assert roundtrip("fp16", x).tolist() == [65504.0, -65504.0, 65504.0, 3.0]
    assert roundtrip("bf16", torch.tensor([3.4e38, -3.4e38])).abs().max() < math.inf


def test_topk_error_is_the_dropped_energy_and_keeps_the_k_largest() -> None:
    for d in (1000, 200_000):  # exact selection, and the sampled-threshold path
        x = randn(d, seed=d)
        decoded = roundtrip("topk:ratio=0.01", x)
        k = k_of(0.01, d)
        kept = torch.nonzero(decoded).view(-1)
        assert kept.numel() == k
        assert torch.equal(decoded[kept], x[kept])
        expected = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(kept, expected)
        dropped = torch.ones(d, dtype=torch.bool)
        dropped[kept] = False
        error = float(((decoded - x) ** 2).sum())
        assert error == pytest.approx(float((x[dropped] ** 2).sum()), rel=1e-6)


def test_topk_ties_go_to_the_lowest_indices() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, -2.0, 0.5])
    decoded = roundtrip("topk:ratio=0.5", x)  # k = 4: both 3s, then the first two of the 2s
    assert decoded.tolist() == [0.0, -3.0, 2.0, 3.0, -2.0, 0.0, 0.0, 0.0]
    ties = torch.ones(300_000)
    assert torch.equal(
        torch.nonzero(roundtrip("topk:ratio=0.01", ties)).view(-1), torch.arange(3000)
    )


def test_exact_selection_does_not_depend_on_the_candidates() -> None:
    x = randn(5000)
    x[100:120] = 2.5  # ties at the cut
    k = 60
    reference_indices, reference_values = largest(x, k)
    cut = float(reference_values.abs().min())
    must = torch.nonzero(x.abs() >= cut).view(-1)
    for seed in range(5):
        extra = torch.randperm(5000, generator=torch.Generator().manual_seed(seed))[:300]
        candidates = torch.unique(torch.cat([must, extra]))
        for use_numpy in (True, False):
            indices, values = largest(x, k, candidates, use_numpy=use_numpy)
            assert torch.equal(indices, reference_indices)
            assert torch.equal(values, reference_values)


def test_randomk_keeps_shared_indices_and_scales_when_unbiased() -> None:
    x = randn(1000)
    indices = shared_indices(ctx(), 1000, 10)
    biased = roundtrip("randomk:ratio=0.01", x)
    assert torch.equal(torch.nonzero(biased).view(-1), indices)
    assert torch.equal(biased[indices], x[indices])
    unbiased = roundtrip("randomk:ratio=0.01,unbiased=true", x)
    torch.testing.assert_close(unbiased[indices], x[indices] * 100)
    dropped = torch.ones(1000, dtype=torch.bool)
    dropped[indices] = False
    assert float(((biased - x) ** 2).sum()) == pytest.approx(
        float((x[dropped] ** 2).sum()), rel=1e-6
    )


def test_dgc_sends_the_largest_entries_in_at_most_k_slots() -> None:
    for d, ratio in ((500, 0.05), (300_000, 0.001), (300_000, 0.01)):
        x = randn(d, seed=d)
        compressor = parse_spec(f"dgc:ratio={ratio}")
        payload = compressor.compress(x, ctx())
        count = int.from_bytes(bytes(payload.data[:4]), "little")
        k = k_of(ratio, d)
        assert 0 < count <= k
        if d <= 1000:  # the sample is the whole tensor: the threshold is exact
            assert count == k
        decoded = compressor.decompress(payload, ctx())
        sent = torch.nonzero(decoded).view(-1)
        assert sent.numel() == count and torch.equal(decoded[sent], x[sent])
        unsent = torch.ones(d, dtype=torch.bool)
        unsent[sent] = False
        assert float(x[sent].abs().min()) >= float(x[unsent].abs().max())


def test_dgc_count_is_near_k() -> None:
    counts = []
    for round_ in range(20):
        payload = parse_spec("dgc:ratio=0.01").compress(randn(200_000, seed=round_), ctx(round_))
        counts.append(int.from_bytes(bytes(payload.data[:4]), "little"))
    assert 0.8 * 2000 <= sum(counts) / len(counts) <= 2000


def test_sign_error_is_exact() -> None:
    x = randn(4097)
    x[:5] = 0.0
    decoded = roundtrip("sign", x)
    d, l1 = x.numel(), float(x.abs().sum())
    scale = l1 / d
    assert torch.allclose(decoded.abs(), torch.full_like(decoded, scale))
    assert torch.all(decoded[:5] > 0)  # sign(0) = +1
    assert torch.equal(decoded > 0, x >= 0)
    error = float(((decoded.double() - x.double()) ** 2).sum())
    assert error == pytest.approx(float((x.double() ** 2).sum()) - l1**2 / d, rel=1e-5)
    assert torch.all(roundtrip("sign", torch.tensor([-0.0, 0.0])) >= 0)


def test_onebit_decodes_to_the_mean_of_each_side() -> None:
    x = randn(1001)
    decoded = roundtrip("onebit", x)
    negative = x < 0
    torch.testing.assert_close(
        decoded[negative], torch.full_like(decoded[negative], float(x[negative].mean()))
    )
    torch.testing.assert_close(
        decoded[~negative], torch.full_like(decoded[~negative], float(x[~negative].mean()))
    )
    assert torch.equal(roundtrip("onebit", torch.ones(9) * 2), torch.ones(9) * 2)  # no negatives


def test_qsgd_lands_on_adjacent_levels_within_the_variance_bound() -> None:
    d, levels = 500, 4
    x = randn(d)
    norm = float(x.norm())
    step = norm / levels
    errors = []
    for round_ in range(200):
        decoded = roundtrip(f"qsgd:levels={levels}", x, ctx(round_))
        scaled = x.abs() / step
        magnitude = decoded.abs() / step
        on_floor = (magnitude - scaled.floor()).abs() < 1e-4
        on_ceiling = (magnitude - scaled.ceil()).abs() < 1e-4
        assert torch.all(on_floor | on_ceiling)
        assert torch.all((decoded == 0) | (torch.sign(decoded) == torch.sign(x)))
        errors.append(float(((decoded - x) ** 2).sum()))
    bound = min(d / levels**2, math.sqrt(d) / levels) * norm**2
    assert sum(errors) / len(errors) <= bound


def test_terngrad_values_are_ternary() -> None:
    x = randn(1000)
    decoded = roundtrip("terngrad", x)
    top = float(x.abs().max())
    assert torch.all((decoded == 0) | ((decoded.abs() - top).abs() <= 1e-6 * top))
    assert bool((decoded != 0).any()) and bool((decoded == 0).any())
    assert torch.all((decoded == 0) | (torch.sign(decoded) == torch.sign(x)))


def test_huge_finite_values_keep_finite_scales() -> None:
    huge = torch.tensor([3e38, -3e38, 1.0]).repeat(400_000)  # float32 sums would overflow
    torch.testing.assert_close(roundtrip("sign", huge)[:3], torch.tensor([2e38, -2e38, 2e38]))
    torch.testing.assert_close(roundtrip("onebit", huge)[:3], torch.tensor([1.5e38, -3e38, 1.5e38]))
    payload = parse_spec("qsgd").compress(huge / 1e18, ctx())  # squares overflow, the norm fits
    scale = torch.frombuffer(bytearray(payload.data[:4]), dtype=torch.float32).item()
    assert scale == pytest.approx(3e20 * math.sqrt(800_000), rel=1e-5)
    with pytest.raises(PayloadError, match="scale: expected a finite number"):
        roundtrip("qsgd", huge)  # a norm beyond float32 cannot travel: every receiver refuses


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "sign", "onebit", "topk", "dgc"])
def test_zero_tensor_decodes_to_zero(spec: str) -> None:
    assert torch.equal(roundtrip(spec, torch.zeros(33)), torch.zeros(33))


# --- unbiasedness ----------------------------------------------------------------------------


def worst_z_score(spec: str, x: torch.Tensor, draws: int) -> float:
    """max over elements of |mean of decodings - x| / its standard error (over ctx rounds)."""
    samples = torch.stack([roundtrip(spec, x, ctx(r)).double() for r in range(draws)])
    mean, error = samples.mean(0), samples.std(0) / math.sqrt(draws)
    deviation = (mean - x.double()).abs()
    fixed = error == 0  # decoded the same every time: must be exact
    if bool((deviation[fixed] > 1e-6 * (1 + x.double().abs()[fixed])).any()):
        return math.inf
    return float((deviation[~fixed] / error[~fixed]).max()) if bool((~fixed).any()) else 0.0


@pytest.mark.parametrize(
    "spec", ["qsgd:levels=2", "qsgd", "terngrad", "randomk:ratio=0.25,unbiased=true"]
)
def test_unbiased_compressors_average_to_the_input(spec: str) -> None:
    assert parse_spec(spec).unbiased
    x = randn(48, seed=3)
    assert worst_z_score(spec, x, draws=1500) < 5.0


def test_the_unbiasedness_check_catches_a_biased_compressor() -> None:
    x = randn(48, seed=3)
    assert not parse_spec("randomk:ratio=0.25").unbiased
    assert worst_z_score("randomk:ratio=0.25", x, draws=1500) > 5.0


# --- shared randomness -----------------------------------------------------------------------


def test_shared_seed_hashes_the_whole_tuple() -> None:
    base = ctx()
    seed = base.shared_seed()
    assert 0 <= seed < 2**63 and seed == ctx().shared_seed()
    variants = [
        CompressionContext(8, 0, 1, 0, 0),
        CompressionContext(7, 1, 1, 0, 0),
        CompressionContext(7, 0, 2, 0, 0),
        CompressionContext(7, 0, 1, 1, 0),
        CompressionContext(7, 0, 1, 0, 1),
        CompressionContext(7, 0, -1, 0, 0),
    ]
    assert len({seed} | {v.shared_seed() for v in variants}) == 7
    # digits that would collide if concatenated
    assert (
        CompressionContext(1, 23, 0, 0, 0).shared_seed()
        != CompressionContext(12, 3, 0, 0, 0).shared_seed()
    )
    a, b = base.generator(), base.generator()
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


@pytest.mark.parametrize("d, k", [(1000, 10), (1000, 400), (50, 50), (100_000, 1000), (9, 1)])
def test_shared_indices_are_distinct_sorted_and_reproducible(d: int, k: int) -> None:
    first = shared_indices(ctx(), d, k)
    assert torch.equal(first, shared_indices(ctx(), d, k))
    assert first.numel() == k and first.dtype == torch.int64
    assert bool((first[1:] > first[:-1]).all()) and int(first[0]) >= 0 and int(first[-1]) < d


def test_randomk_ends_agree_and_contexts_differ() -> None:
    x = randn(10_000)
    sender, receiver = parse_spec("randomk:ratio=0.01"), parse_spec("randomk:ratio=0.01")
    payload = sender.compress(x, ctx())
    decoded = receiver.decompress(
        Compressed(payload.codec, payload.shape, bytes(payload.data)), ctx()
    )
    assert torch.equal(torch.nonzero(decoded).view(-1), shared_indices(ctx(), 10_000, 100))
    seen = {
        tuple(shared_indices(c, 10_000, 100).tolist())
        for c in (ctx(), ctx(round=1), ctx(receiver=2), ctx(tensor_index=3), ctx(seed=8))
    }
    assert len(seen) == 5
    wrong = receiver.decompress(
        payload, ctx(round=1)
    )  # a receiver using another ctx misplaces values
    assert not torch.equal(torch.nonzero(wrong).view(-1), torch.nonzero(decoded).view(-1))


def test_randomk_index_choice_is_uniform() -> None:
    counts = torch.zeros(20)
    for round_ in range(2000):
        counts[shared_indices(ctx(round_), 20, 4)] += 1
    expected = 2000 * 4 / 20  # 400 each, sd ~ 18
    assert float((counts - expected).abs().max()) < 90


def test_stochastic_rounding_is_reproducible_from_ctx() -> None:
    x = randn(3000)
    first = parse_spec("qsgd").compress(x, ctx(round=4))
    assert bytes(first.data) == bytes(parse_spec("qsgd").compress(x, ctx(round=4)).data)
    assert bytes(first.data) != bytes(parse_spec("qsgd").compress(x, ctx(round=5)).data)


# --- malformed payloads ----------------------------------------------------------------------


def tampered(spec: str, x: torch.Tensor, edit) -> tuple:
    compressor = parse_spec(spec)
    payload = compressor.compress(x, ctx())
    data = bytearray(payload.data)
    edit(data)
    return compressor, Compressed(payload.codec, payload.shape, bytes(data))


def put_int(offset: int, value: int):
    def edit(data: bytearray) -> None:
        data[offset : offset + 4] = value.to_bytes(4, "little", signed=True)

    return edit


def put_float(offset: int, value: float):
    def edit(data: bytearray) -> None:
        data[offset : offset + 4] = torch.tensor([value], dtype=torch.float32).numpy().tobytes()

    return edit


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_wrong_length_is_refused(spec: str) -> None:
    compressor = parse_spec(spec)
    payload = compressor.compress(randn(100), ctx())
    for data in (bytes(payload.data) + b"\0", bytes(payload.data)[:-1]):
        with pytest.raises(
            PayloadError, match=f"expected {compressor.wire_bytes(100)} bytes, got {len(data)}"
        ):
            compressor.decompress(Compressed(payload.codec, payload.shape, data), ctx())


def test_misaligned_and_foreign_buffers_decode_the_same() -> None:
    for spec in ("identity", "topk:ratio=0.1", "qsgd", "dgc:ratio=0.1"):
        compressor = parse_spec(spec)
        payload = compressor.compress(randn(333), ctx())
        expected = compressor.decompress(payload, ctx())
        shifted = memoryview(bytearray(b"\0" + bytes(payload.data)))[1:]  # odd address
        for data in (shifted, bytearray(payload.data), bytes(payload.data)):
            decoded = compressor.decompress(Compressed(payload.codec, payload.shape, data), ctx())
            assert torch.equal(decoded, expected)


def test_wrong_codec_or_shape_is_refused() -> None:
    payload = parse_spec("sign").compress(randn(16), ctx())
    with pytest.raises(PayloadError, match="codec: expected 'onebit', got 'sign'"):
        parse_spec("onebit").decompress(payload, ctx())
    with pytest.raises(PayloadError, match="for 17 elements: expected 7 bytes, got 6"):
        parse_spec("sign").decompress(Compressed("sign", (17,), payload.data), ctx())
    with pytest.raises(PayloadError, match="shape: expected non-negative integers, got \\(-16,\\)"):
        parse_spec("sign").decompress(Compressed("sign", (-16,), payload.data), ctx())


def test_topk_indices_are_validated() -> None:
    x = randn(100)  # k = 1 at the default ratio; use 4 entries
    spec = "topk:ratio=0.04"
    values_end = 16  # 4 float32 values, then 4 int32 indices
    compressor, payload = tampered(spec, x, put_int(values_end + 12, 100))
    with pytest.raises(PayloadError, match=r"index 100: expected in \[0, 100\)"):
        compressor.decompress(payload, ctx())
    compressor, payload = tampered(spec, x, put_int(values_end, -1))
    with pytest.raises(PayloadError, match=r"index -1: expected in \[0, 100\)"):
        compressor.decompress(payload, ctx())

    def duplicate(data: bytearray) -> None:
        data[values_end + 4 : values_end + 8] = data[values_end : values_end + 4]

    compressor, payload = tampered(spec, x, duplicate)
    with pytest.raises(PayloadError, match="expected unique, got index"):
        compressor.decompress(payload, ctx())

    def swap(data: bytearray) -> None:
        first = bytes(data[values_end : values_end + 4])
        data[values_end : values_end + 4] = data[values_end + 4 : values_end + 8]
        data[values_end + 4 : values_end + 8] = first

    compressor, payload = tampered(spec, x, swap)
    with pytest.raises(PayloadError, match="expected strictly increasing"):
        compressor.decompress(payload, ctx())


def test_dgc_count_and_slots_are_validated() -> None:
    x = randn(1000)
    spec = "dgc:ratio=0.01"  # 10 slots
    compressor, payload = tampered(spec, x, put_int(0, 11))
    with pytest.raises(PayloadError, match="count: expected 0..10 .*got 11"):
        compressor.decompress(payload, ctx())
    compressor, payload = tampered(spec, x, put_int(0, -1))
    with pytest.raises(PayloadError, match="count"):
        compressor.decompress(payload, ctx())
    compressor, payload = tampered(spec, x, put_int(0, 9))  # the 10th entry becomes padding
    with pytest.raises(PayloadError, match="slots past count 9: expected zeros"):
        compressor.decompress(payload, ctx())

    def stray_value(data: bytearray) -> None:  # a value left in a padding slot, index zeroed
        put_int(0, 9)(data)
        put_int(4 + 40 + 36, 0)(data)

    compressor, payload = tampered(spec, x, stray_value)
    with pytest.raises(PayloadError, match="slots past count 9: expected zeros"):
        compressor.decompress(payload, ctx())
    compressor, payload = tampered(spec, x, put_int(4 + 40 + 36, 5000))
    with pytest.raises(PayloadError, match="index 5000"):
        compressor.decompress(payload, ctx())


@pytest.mark.parametrize(
    "spec, offset, what",
    [
        ("sign", 0, "scale"),
        ("onebit", 0, "non-negative"),
        ("onebit", 4, "negative"),
        ("qsgd", 0, "scale"),
        ("terngrad", 0, "scale"),
    ],
)
def test_non_finite_or_negative_scales_are_refused(spec: str, offset: int, what: str) -> None:
    for bad in (math.nan, math.inf):
        compressor, payload = tampered(spec, randn(64), put_float(offset, bad))
        with pytest.raises(PayloadError, match=f"{what}.*expected a finite number"):
            compressor.decompress(payload, ctx())
    compressor, payload = tampered(spec, randn(64), put_float(offset, 2.0 if offset == 4 else -2.0))
    with pytest.raises(PayloadError, match=what):
        compressor.decompress(payload, ctx())


@pytest.mark.parametrize(
    "spec, offset",
    [("identity", 8), ("topk:ratio=0.1", 0), ("randomk:ratio=0.1", 4), ("dgc:ratio=0.1", 4)],
)
def test_non_finite_values_are_refused(spec: str, offset: int) -> None:
    compressor, payload = tampered(spec, randn(64), put_float(offset, math.nan))
    with pytest.raises(PayloadError, match="values: expected finite, got 1 NaN/Inf"):
        compressor.decompress(payload, ctx())


def test_fp16_infinity_is_refused() -> None:
    compressor = parse_spec("fp16")
    data = torch.tensor([1.0, math.inf], dtype=torch.float16).numpy().tobytes()
    with pytest.raises(PayloadError, match="NaN/Inf"):
        compressor.decompress(Compressed("fp16", (2,), data), ctx())


def test_levels_above_s_and_padding_bits_are_refused() -> None:
    compressor = parse_spec("qsgd:levels=5")  # 3 level bits: codes 6 and 7 are invalid
    d = 16

    def level_seven(data: bytearray) -> None:
        for j in range(3):
            data[4 + (1 + j) * 2] |= 1  # element 0, every level plane

    _, payload = tampered("qsgd:levels=5", randn(d), level_seven)
    with pytest.raises(PayloadError, match="levels: expected at most 5, got 7"):
        compressor.decompress(payload, ctx())

    def padding(data: bytearray) -> None:
        data[-1] |= 0x80  # past element 8 of 9

    compressor, payload = tampered("sign", randn(9), padding)
    with pytest.raises(PayloadError, match="padding"):
        compressor.decompress(payload, ctx())


# --- error feedback --------------------------------------------------------------------------


def test_error_feedback_memory_is_what_was_not_sent() -> None:
    ef = parse_spec("ef+topk:ratio=0.05")
    assert isinstance(ef, ErrorFeedback) and not ef.unbiased
    assert ef.codec == "topk" and ef.wire_bytes(1000) == parse_spec("topk:ratio=0.05").wire_bytes(
        1000
    )
    assert ef.memory(1, 0) is None
    for round_ in range(4):
        x = randn(1000, seed=round_)
        before = ef.memory(1, 0)
        corrected = x + (before if before is not None else 0)
        payload = ef.compress(x, ctx(round_))
        sent = ef.decompress(payload, ctx(round_))
        torch.testing.assert_close(ef.memory(1, 0), corrected - sent, rtol=0, atol=0)


def test_error_feedback_with_identity_keeps_zero_memory() -> None:
    ef = parse_spec("ef+identity")
    for round_ in range(3):
        ef.compress(randn(100, seed=round_), ctx(round_))
    assert torch.equal(ef.memory(1, 0), torch.zeros(100))


def test_error_feedback_sent_sum_tracks_the_input_sum() -> None:
    ef = parse_spec("ef+sign")
    inputs, sent = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
    for round_ in range(30):
        x = randn(500, seed=round_)
        inputs += x.double()
        sent += ef.decompress(ef.compress(x, ctx(round_)), ctx(round_)).double()
    torch.testing.assert_close(sent, inputs - ef.memory(1, 0).double(), rtol=0, atol=1e-4)
    # without feedback the same compressor drifts much further
    plain = torch.zeros(500, dtype=torch.float64)
    for round_ in range(30):
        plain += roundtrip("sign", randn(500, seed=round_)).double()
    assert float((plain - inputs).norm()) > 3 * float((sent - inputs).norm())


def test_error_feedback_accepts_any_float_layout_and_refuses_integers() -> None:
    ef = parse_spec("ef+topk:ratio=0.1")
    x = randn(20, 30).t().to(torch.float16)
    for round_ in range(2):
        ef.compress(x, ctx(round_))
    saved = ef.memory(1, 0)
    assert saved.shape == (30, 20) and saved.dtype == torch.float32
    with pytest.raises(TypeError, match="floating-point"):
        ef.compress(torch.ones(30, 20, dtype=torch.int64), ctx())
    assert torch.equal(ef.memory(1, 0), saved)  # a refused input leaves the memory alone


def test_error_feedback_keeps_one_memory_per_receiver_and_tensor() -> None:
    ef = parse_spec("ef+topk:ratio=0.1")
    ef.compress(randn(50), ctx(receiver=1, tensor_index=0))
    ef.compress(randn(60), ctx(receiver=2, tensor_index=0))
    ef.compress(randn(70), ctx(receiver=1, tensor_index=1))
    assert {key: m.shape for key, m in ef.memories().items()} == {
        (1, 0): (50,),
        (2, 0): (60,),
        (1, 1): (70,),
    }
    with pytest.raises(ValueError, match="holds \\(50,\\)"):
        ef.compress(randn(51), ctx(receiver=1, tensor_index=0))
    saved = ef.memories()
    ef.reset()
    assert ef.memory(1, 0) is None and ef.memories() == {}
    ef.set_memory(1, 0, saved[(1, 0)])
    assert torch.equal(ef.memory(1, 0), saved[(1, 0)])


# --- numpy and torch paths agree -------------------------------------------------------------


def test_kernel_paths_agree() -> None:
    x = randn(300_001)
    x[:10] = 0.0
    plane_numpy = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    plane_torch = torch.empty_like(plane_numpy)
    by_numpy = kernels.sign_pass(x, plane_numpy, use_numpy=True)
    by_torch = kernels.sign_pass(x, plane_torch, use_numpy=False)
    assert torch.equal(plane_numpy, plane_torch)
    assert by_numpy.negatives == by_torch.negatives == int((x < 0).sum())
    assert by_numpy.positive_sum == pytest.approx(by_torch.positive_sum, rel=1e-6)
    assert by_numpy.negative_sum == pytest.approx(by_torch.negative_sum, rel=1e-6)
    assert by_numpy.abs_sum == pytest.approx(float(x.double().abs().sum()), rel=1e-6)
    for reduce in (kernels.l2_norm, kernels.abs_max):
        assert reduce(x, use_numpy=True) == pytest.approx(reduce(x, use_numpy=False), rel=1e-6)
    assert torch.equal(
        kernels.abs_at_least(x, 2.0, use_numpy=True), kernels.abs_at_least(x, 2.0, use_numpy=False)
    )
    for n in (1, 9, 300_001):
        plane = torch.randint(0, 256, ((n + 7) // 8,), dtype=torch.uint8)
        plane[-1] &= (1 << (n % 8 or 8)) - 1
        cpu = torch.device("cpu")
        by_numpy = kernels.expand_plane(plane, n, 0.5, -2.0, cpu, use_numpy=True)
        assert torch.equal(
            by_numpy, kernels.expand_plane(plane, n, 0.5, -2.0, cpu, use_numpy=False)
        )
    target, source = randn(300_001, seed=1), randn(300_001, seed=2).to(torch.bfloat16)
    expected = target + source.float()
    kernels.add_into(target, source)
    assert torch.equal(target, expected)
    kernels.add_into(target, source, -1.0)
    kernels.add_into(target, source, 0.5)
    torch.testing.assert_close(target, expected - 0.5 * source.float())
    values = torch.randn(1000)
    copy = values.clone()
    planes = torch.randint(0, 256, (3, 125), dtype=torch.uint8)
    assert kernels.multiply_levels(values, planes, 3, use_numpy=True) == kernels.multiply_levels(
        copy, planes, 3, use_numpy=False
    )
    assert torch.equal(values, copy)


def test_half_types_widen_exactly_on_the_numpy_path() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        x = randn(1001).to(dtype)
        assert torch.equal(torch.from_numpy(kernels.as_numpy(x)), x.float())


def test_work_spread_over_threads_matches_one_thread() -> None:
    x = randn(2_000_003)  # several spans per thread
    results = {}
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results[threads] = [
                bytes(parse_spec(s).compress(x, ctx()).data)
                for s in ("qsgd", "sign", "onebit", "topk")
            ]
        finally:
            torch.set_num_threads(previous)
    assert results[1] == results[2]


def test_stochastic_level_paths_agree_where_rounding_is_certain() -> None:
    # |x| * factor already an integer: floor(level + u) == level whatever the uniforms
    levels = torch.randint(0, 6, (10_001,)).float()
    x = levels * torch.where(torch.rand(10_001) < 0.5, -1.0, 1.0)
    shape = (4, (x.numel() + 7) // 8)
    by_numpy = torch.empty(shape, dtype=torch.uint8)
    by_torch = torch.empty(shape, dtype=torch.uint8)
    kernels.stochastic_levels(x, 1.0, 5, 123, by_numpy)
    kernels.stochastic_levels(x, 1.0, 5, torch.Generator().manual_seed(123), by_torch)
    assert torch.equal(by_numpy, by_torch)


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_compressor_runs_on_cuda(spec: str) -> None:
    x = randn(100_003, seed=1)
    compressor = parse_spec(spec)
    payload = compressor.compress(x.cuda(), ctx())
    assert payload.nbytes == compressor.wire_bytes(x.numel())
    on_gpu = compressor.decompress(payload, ctx(), device="cuda")
    on_cpu = compressor.decompress(payload, ctx())
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
    if spec in (
        "identity",
        "fp16",
        "bf16",
        "topk",
        "topk:ratio=0.3",
        "randomk",
        "randomk:ratio=0.5",
        "sign",
        "onebit",
    ):
        reference = parse_spec(spec).decompress(parse_spec(spec).compress(x, ctx()), ctx())
        torch.testing.assert_close(on_cpu, reference, rtol=1e-5, atol=1e-6)


# --- what compressors state about themselves --------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_stated_error_bounds_hold_on_average(spec: str) -> None:
    """A contractive compressor's mean squared error stays below ||x||^2 and an unbiased one's
    below variance_bound ||x||^2 (over shared-randomness draws, on a heavy-tailed vector)."""
    compressor = parse_spec(spec)
    x = randn(500, seed=5) ** 3
    errors = [float((roundtrip(spec, x, ctx(r)) - x).pow(2).sum()) for r in range(40)]
    mean_error, energy = sum(errors) / len(errors), float(x.pow(2).sum())
    if compressor.contractive and not spec.startswith("ef+"):
        assert mean_error < energy
    if compressor.unbiased:
        assert mean_error <= compressor.variance_bound(x.numel()) * energy * 1.1 + 1e-9
    else:
        assert compressor.variance_bound(x.numel()) == 0.0
    assert compressor.contractive or compressor.unbiased  # every one is usable by Choco
    assert 0.0 < compressor.consensus_step <= 1.0


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_summable_payloads_decode_to_the_sum(spec: str) -> None:
    """Where a compressor says its payloads can be summed, adding two payloads' values (as the
    wire's element type) decodes to the sum of the decoded tensors; top-k's cannot be."""
    compressor = parse_spec(spec)
    inner = getattr(compressor, "inner", compressor)
    a, b, context = randn(300, seed=1), randn(300, seed=2), ctx()
    first, second = compressor.compress(a, context), compressor.compress(b, context)
    if not compressor.summable:
        assert inner.name in {"topk", "dgc", "sign", "onebit", "qsgd", "terngrad"}
        return
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(inner.name, torch.float32)
    summed = (
        torch.frombuffer(bytearray(first.data), dtype=dtype).float()
        + torch.frombuffer(bytearray(second.data), dtype=dtype).float()
    ).to(dtype)
    total = compressor.decompress(
        type(first)(first.codec, first.shape, summed.view(torch.uint8).numpy().tobytes()), context
    )
    expected = compressor.decompress(first, context) + compressor.decompress(second, context)
    assert torch.allclose(total, expected, rtol=1e-2, atol=1e-2)


def test_sparsifiers_say_so_through_error_feedback() -> None:
    assert parse_spec("ef+topk").sparsifying and parse_spec("randomk").sparsifying
    assert not parse_spec("ef+sign").sparsifying and not parse_spec("fp16").sparsifying
