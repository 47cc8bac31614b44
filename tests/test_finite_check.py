"""The streaming NaN/Inf check: any bad value at any position refused, large finite ones kept."""

from __future__ import annotations

import numpy
import pytest
import torch

from gossipcomp.transport.base import EnvelopeRejected
from gossipcomp.transport.codec import FiniteScanner, tensor_spec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16}


def _scan(values: torch.Tensor, pieces: int = 3) -> None:
    """Feed a tensor's bytes to a scanner in `pieces` uneven steps, as chunks arrive."""
    spec = (tensor_spec("x", values),)
    scanner = FiniteScanner(spec, spec)
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
