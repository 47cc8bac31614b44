"""The streaming NaN/Inf check: any bad value at any position refused, large finite ones kept."""

from __future__ import annotations

import numpy
import pytest
import torch

from gossipcomp.transport.base import EnvelopeRejected
from gossipcomp.transport.codec import (
    FiniteScanner,
    all_finite,
    check_finite,
    encode_raw,
    tensor_spec,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16}


def _scan(values: torch.Tensor, pieces: int = 3) -> None:
    """Feed a tensor's bytes to a scanner in `pieces` uneven steps, as chunks arrive."""
    spec = (tensor_spec("x", values),)
    scanner = FiniteScanner(spec)
    buffer = memoryview(values.reshape(-1).view(torch.uint8).numpy())
    for step in range(1, pieces + 1):
        scanner.scan(buffer, len(buffer) * step // pieces)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 100_000])
def test_nan_and_inf_anywhere_are_refused(dtype, size):
    values = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(DTYPES[dtype])
    _scan(values)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in {0, size // 2, size - 1}:
            spoiled = values.clone()
            spoiled[where] = bad
            with pytest.raises(EnvelopeRejected, match="expected finite"):
                _scan(spoiled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_values_whose_sum_overflows_are_accepted(dtype):
    largest = float(numpy.finfo(dtype).max)
    _scan(torch.full((50_000,), largest, dtype=DTYPES[dtype]))


def _scan_envelope(tensors: dict[str, torch.Tensor], pieces: int = 2) -> None:
    """Feed several tensors' bytes, back to back as in an envelope, to one scanner."""
    spec = tuple(tensor_spec(name, t) for name, t in tensors.items())
    scanner = FiniteScanner(spec)
    data = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    buffer = memoryview(data)
    for step in range(1, pieces + 1):
        scanner.scan(buffer, len(buffer) * step // pieces)


def test_a_bad_value_in_one_of_several_small_tensors_names_that_tensor():
    """Neighbouring tensors of one dtype are checked as one span; the refusal still names the
    tensor the NaN is in, wherever the chunks end."""
    tensors = {f"v{i}": torch.randn(9 + i) for i in range(5)}
    tensors["half"] = torch.randn(4).half()  # another dtype: a span of its own
    tensors["last"] = torch.randn(6)
    _scan_envelope(tensors)
    for name in tensors:
        spoiled = {k: v.clone() for k, v in tensors.items()}
        spoiled[name][-1] = float("nan")
        for pieces in (1, 3):
            with pytest.raises(EnvelopeRejected, match=f"tensor '{name}' values"):
                _scan_envelope(spoiled, pieces)


def test_tensors_whose_joint_sum_overflows_are_accepted():
    """Each tensor's sum is finite but the span's overflows: the element-wise check accepts."""
    largest = float(numpy.finfo(numpy.float32).max)
    _scan_envelope({"a": torch.full((3,), largest / 2), "b": torch.full((3,), largest / 2)})


@pytest.mark.parametrize("dtype", [*DTYPES, "bfloat16"])
@pytest.mark.parametrize("size", [1, 300, 20_000])
def test_a_stored_envelope_is_checked_by_the_same_rule(dtype, size):
    """check_finite (the in-memory transport's door, on the wire bytes) and all_finite (a
    model's tensors) refuse a NaN/Inf anywhere and accept finite values whose sum overflows,
    in every dtype the wire carries (bfloat16, which numpy lacks, decoded)."""
    torch_dtype = getattr(torch, dtype)
    values = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(torch_dtype)
    spec = (tensor_spec("x", values),)
    check_finite((encode_raw("x", values),), spec)
    assert all_finite(values) and all_finite(values.reshape(-1, 1).t())  # strided: torch's path
    largest = torch.full((size,), torch.finfo(torch_dtype).max, dtype=torch_dtype)
    check_finite((encode_raw("x", largest),), spec)
    assert all_finite(largest)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in {0, size // 2, size - 1}:
            spoiled = values.clone()
            spoiled[where] = bad
            with pytest.raises(EnvelopeRejected, match="tensor 'x' values: expected finite, got 1"):
                check_finite((encode_raw("x", spoiled),), spec)
            assert not all_finite(spoiled)
