"""Merged buffers compressed with statistics per segment (compress/segmented.py): exact wire
sizes, each segment decoded bit for bit as on its own (deterministic codecs), unbiasedness per
segment, hostile payloads refused, numpy and torch paths agreeing, and which codecs need it."""

from __future__ import annotations

import numpy
import pytest
import torch

from gossipcomp.compress import (
    CompressionContext,
    ErrorFeedback,
    PayloadError,
    Segmented,
    kernels,
    parse_spec,
    per_segment,
)
from gossipcomp.compress.base import Compressed

SCALED = ("sign", "onebit", "qsgd:levels=16", "qsgd:levels=1", "terngrad")
UNSCALED = ("identity", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1", "dgc:ratio=0.1")
CONTEXT = CompressionContext(seed=3, sender=1, receiver=-1, round=5, tensor_index=2)
# magnitudes 1e-3 to 1e2, an empty tensor, a single element, and a segment across a CPU span
SHAPES_AND_SCALES = ((10, 1.0), (0, 1.0), (3000, 0.01), (7, 100.0), (1, 0.5), (300_001, 3e-3))


def tensors(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) * s for n, s in SHAPES_AND_SCALES]


def numels(parts: list[torch.Tensor]) -> list[int]:
    return [t.numel() for t in parts]


def pieces(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, sizes))


def statistics_block(payload: Compressed, count: int) -> numpy.ndarray:
    """The float32 statistics at the head of a payload, as the docstrings lay them out."""
    return numpy.frombuffer(bytes(payload.data[: 4 * count]), dtype=numpy.float32)


@pytest.mark.parametrize("spec", SCALED)
def test_wire_bytes_are_known_in_advance_and_exact(spec):
    parts = tensors()
    inner = parse_spec(spec)
    compressor = per_segment(inner, numels(parts))
    assert isinstance(compressor, Segmented)
    flat = torch.cat(parts)
    announced = compressor.wire_bytes(flat.numel())
    scalars = 2 if spec == "onebit" else 1
    assert announced == inner.wire_bytes(flat.numel()) + 4 * scalars * (len(parts) - 1)
    payload = compressor.compress(flat, CONTEXT)
    assert payload.nbytes == announced
    assert payload.codec == f"{inner.codec}/segments"
    with pytest.raises(ValueError, match="built for"):
        compressor.wire_bytes(flat.numel() + 1)


@pytest.mark.parametrize("spec", ("sign", "onebit"))
@pytest.mark.parametrize("threads", (1, 2))
def test_a_merged_buffer_decodes_bit_for_bit_as_its_tensors_one_by_one(spec, threads):
    """Deterministic codecs: every segment's statistics are taken as for that tensor alone
    (a segment across CPU spans included, on one thread or two), so merging changes nothing."""
    parts = tensors()
    inner = parse_spec(spec)
    compressor = per_segment(inner, numels(parts))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decoded = compressor.decompress(compressor.compress(torch.cat(parts), CONTEXT), CONTEXT)
        alone = [inner.decompress(inner.compress(part, CONTEXT), CONTEXT) for part in parts]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(decoded, torch.cat(alone))


def test_per_segment_scale_beats_one_scale_over_the_buffer():
    """The point of it: one mean |x| over tensors 1e5 apart in scale loses the small ones."""
    parts = tensors()
    flat = torch.cat(parts)
    plain = parse_spec("sign")
    segmented = per_segment(plain, numels(parts))
    one_scale = plain.decompress(plain.compress(flat, CONTEXT), CONTEXT)
    own_scale = segmented.decompress(segmented.compress(flat, CONTEXT), CONTEXT)
    for part, merged, own in zip(
        parts, pieces(one_scale, numels(parts)), pieces(own_scale, numels(parts)), strict=True
    ):
        if part.numel() > 1:
            # sign's error is exactly ||x||^2 - ||x||_1^2 / d per tensor with its own scale,
            # the least over every scale, so no single scale for the buffer does better
            wide = part.double()
            exact = wide.square().sum() - wide.abs().sum() ** 2 / part.numel()
            own_error = (own.double() - wide).square().sum()
            torch.testing.assert_close(own_error, exact, rtol=1e-4, atol=1e-12)
            assert own_error <= (merged.double() - wide).square().sum() * (1 + 1e-6)
    # the 7 entries of scale 100 among 300k of scale 3e-3: one scale for all sends nothing of
    # them (relative error 1.0), their own scale what sign sends of any tensor
    large, merged_large, own_large = (
        values[3]
        for values in (parts, pieces(one_scale, numels(parts)), pieces(own_scale, numels(parts)))
    )
    assert (merged_large - large).norm() > 0.99 * large.norm()
    assert (own_large - large).norm() < 0.7 * large.norm()


@pytest.mark.parametrize("spec", ("qsgd:levels=4", "terngrad"))
def test_stochastic_codecs_are_unbiased_per_segment(spec):
    """Mean of 400 decodings (each round its own randomness) against x, segment by segment,
    within 5 standard errors of the per-element variance bound."""
    parts = [t for t in tensors(seed=1) if 0 < t.numel() < 5000]
    compressor = per_segment(parse_spec(spec), numels(parts))
    flat = torch.cat(parts)
    draws = 400
    total = torch.zeros_like(flat)
    for r in range(draws):
        context = CompressionContext(seed=3, sender=1, receiver=-1, round=r, tensor_index=0)
        total += compressor.decompress(compressor.compress(flat, context), context)
    mean = total / draws
    for got, part in zip(pieces(mean, numels(parts)), parts, strict=True):
        scale = part.norm() if spec.startswith("qsgd") else part.abs().max()
        step = scale / (4 if spec.startswith("qsgd") else 1)  # one level: the spread of a draw
        assert (got - part).abs().max() <= 5 * step / draws**0.5 + 1e-6, spec


def test_variance_bound_is_the_largest_segment_bound():
    sizes = [10, 3000, 7]
    compressor = per_segment(parse_spec("qsgd:levels=16"), sizes)
    inner = parse_spec("qsgd:levels=16")
    assert compressor.variance_bound(sum(sizes)) == inner.variance_bound(3000)
    assert compressor.variance_bound(sum(sizes)) < inner.variance_bound(sum(sizes))
    assert compressor.unbiased and not compressor.summable


@pytest.mark.parametrize("spec", UNSCALED)
def test_codecs_without_statistics_stay_as_they_are(spec):
    compressor = parse_spec(spec)
    assert per_segment(compressor, [10, 20, 30]) is compressor


def test_one_tensor_keeps_the_per_tensor_format_and_error_feedback_wraps_the_segments():
    sign = parse_spec("sign")
    assert per_segment(sign, [100]) is sign
    wrapped = per_segment(parse_spec("ef+sign"), [10, 20])
    assert isinstance(wrapped, ErrorFeedback) and isinstance(wrapped.inner, Segmented)
    assert wrapped.spec == "ef+sign" and wrapped.codec == "sign/segments"
    x = torch.cat([torch.ones(10), -1e-3 * torch.ones(20)])
    sent = wrapped.decompress(wrapped.compress(x, CONTEXT), CONTEXT)
    torch.testing.assert_close(sent, x)  # constant magnitude per segment: nothing left behind
    memory = wrapped.memory(-1, CONTEXT.tensor_index)
    assert memory is not None and float(memory.abs().max()) < 1e-6


def _corrupt(payload: Compressed, offset: int, value: bytes) -> Compressed:
    data = bytearray(payload.data)
    data[offset : offset + len(value)] = value
    return Compressed(payload.codec, payload.shape, data)


@pytest.mark.parametrize("spec", SCALED)
def test_hostile_payloads_are_refused(spec):
    sizes = [10, 30, 17]
    compressor = per_segment(parse_spec(spec), sizes)
    flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(4))
    payload = compressor.compress(flat, CONTEXT)
    with pytest.raises(PayloadError, match="expected .* bytes"):
        compressor.decompress(Compressed(payload.codec, payload.shape, payload.data[:-1]), CONTEXT)
    with pytest.raises(PayloadError, match="codec"):
        compressor.decompress(Compressed("sign", payload.shape, payload.data), CONTEXT)
    with pytest.raises(PayloadError, match="shape"):
        compressor.decompress(Compressed(payload.codec, (sum(sizes) + 1,), payload.data), CONTEXT)
    nan = numpy.float32("nan").tobytes()
    with pytest.raises(PayloadError, match="segment 1: expected a finite"):
        compressor.decompress(_corrupt(payload, 4 * (2 if spec == "onebit" else 1), nan), CONTEXT)
    with pytest.raises(PayloadError, match="padding"):
        compressor.decompress(_corrupt(payload, payload.nbytes - 1, b"\xff"), CONTEXT)


def test_qsgd_levels_above_s_are_refused():
    sizes = [16, 16]
    compressor = per_segment(parse_spec("qsgd:levels=2"), sizes)  # 2 level bits: codes 0..3
    payload = compressor.compress(torch.randn(32), CONTEXT)
    top_plane = 4 * 2 + 2 * 4  # two scales, the sign plane, the low level bits (4 bytes each)
    with pytest.raises(PayloadError, match="levels: expected at most 2, got 3"):
        compressor.decompress(
            _corrupt(_corrupt(payload, top_plane, b"\x01"), 8 + 4, b"\x01"), CONTEXT
        )


@pytest.mark.parametrize("spec", SCALED)
def test_non_finite_input_yields_a_payload_every_receiver_refuses(spec):
    sizes = [10, 10]
    x = torch.randn(20)
    x[13] = float("nan")
    compressor = per_segment(parse_spec(spec), sizes)
    payload = compressor.compress(x, CONTEXT)
    with pytest.raises(PayloadError, match="segment 1"):
        compressor.decompress(payload, CONTEXT)


@pytest.mark.parametrize("opposite", (True, False))
def test_expanding_a_plane_per_segment_gives_exactly_the_segment_values(opposite):
    parts = tensors()
    segments = kernels.Segments(numels(parts))
    flat = torch.cat(parts)
    clear = numpy.arange(1, len(parts) + 1, dtype=numpy.float32) / 3
    set_ = -clear if opposite else clear * 7
    plane = torch.from_numpy(numpy.packbits((flat < 0).numpy(), bitorder="little"))
    cpu = torch.device("cpu")
    got = kernels.expand_plane_segments(plane, segments, clear, set_, cpu)
    on_torch = kernels.expand_plane_segments(plane, segments, clear, set_, cpu, use_numpy=False)
    ids = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(numels(parts)))
    want = torch.where(flat < 0, torch.from_numpy(set_)[ids], torch.from_numpy(clear)[ids])
    assert torch.equal(got, want) and torch.equal(on_torch, want)


def test_qsgd_quantises_each_segment_against_its_own_norm():
    sizes = [50, 70]
    compressor = per_segment(parse_spec("qsgd:levels=8"), sizes)
    x = torch.cat([torch.randn(50), 1e-3 * torch.randn(70)])
    payload = compressor.compress(x, CONTEXT)
    decoded = compressor.decompress(payload, CONTEXT)
    scales = statistics_block(payload, 2)
    for got, part, scale in zip(pieces(decoded, sizes), pieces(x, sizes), scales, strict=True):
        torch.testing.assert_close(float(scale), float(part.norm()), rtol=1e-6, atol=0)
        assert float((got - part).abs().max()) <= scale / 8 * (1 + 1e-5)
        assert torch.equal(torch.sign(got[got != 0]), torch.sign(part[got != 0]))


@pytest.mark.parametrize("torch_path", (False, True))
def test_stochastic_levels_take_a_factor_per_segment(torch_path):
    """floor or ceil of factor |x| per element, the factor of its segment, on both paths."""
    segments = kernels.Segments([300, 0, 500])
    x = torch.randn(800, generator=torch.Generator().manual_seed(9))
    factors = numpy.array([2.0, 5.0, 0.5], dtype=numpy.float32)
    planes = torch.empty(3, 100, dtype=torch.uint8)  # sign, then 2 level bits (levels=3)
    source = torch.Generator().manual_seed(1) if torch_path else 11
    kernels.stochastic_levels(x, kernels.PerSegment(segments, factors), 3, source, planes)
    level = torch.from_numpy(
        numpy.unpackbits(planes[1:].numpy(), axis=1, bitorder="little").astype(numpy.int64)
    )
    level = level[0] + 2 * level[1]
    target = x.abs() * torch.cat([torch.full((300,), 2.0), torch.full((500,), 0.5)])
    assert bool(((level >= target.floor().clamp(max=3)) & (level <= target.ceil())).all())
    signs = numpy.unpackbits(planes[0].numpy(), bitorder="little").astype(bool)
    assert numpy.array_equal(signs, (x < 0).numpy())


def test_bad_segments_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="one or more sizes >= 0"):
        kernels.Segments([])
    with pytest.raises(ValueError, match="one or more sizes >= 0"):
        kernels.Segments([3, -1])
    with pytest.raises(ValueError, match="keeps no statistics"):
        Segmented(parse_spec("topk"), [1, 2])  # type: ignore[arg-type]
    compressor = per_segment(parse_spec("sign"), [4, 4])
    with pytest.raises(ValueError, match="the segments cover 8 elements, got a tensor of 9"):
        compressor.compress(torch.ones(9), CONTEXT)
