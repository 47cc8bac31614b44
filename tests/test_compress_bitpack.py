"""Bit-planes: exact sizes, round trips for every width, the documented bit order, both paths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipcomp.compress import bitpack, kernels

LENGTHS = (0, 1, 7, 8, 9, 63, 1000, 4097)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", LENGTHS)
def test_round_trip_and_size(bits: int, n: int) -> None:
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    by_numpy = bitpack.pack(codes, bits, use_numpy=True)
    by_torch = bitpack.pack(codes, bits, use_numpy=False)
    assert by_numpy.numel() == bitpack.packed_bytes(n, bits) == bits * ((n + 7) // 8)
    assert torch.equal(by_numpy, by_torch)
    assert bitpack.padding_is_clear(by_numpy, bits, n)
    for use_numpy in (True, False):
        assert torch.equal(bitpack.unpack(by_numpy, bits, n, use_numpy=use_numpy), codes)


def test_documented_layout() -> None:
    # element i -> byte i // 8, bit i % 8 (least significant first); planes low bit first
    assert bitpack.pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [1, 1]
    assert bitpack.pack(torch.tensor([0, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [128]
    assert bitpack.pack(torch.tensor([3, 1, 2]), 2).tolist() == [0b011, 0b101]


def test_bool_masks_and_high_bits() -> None:
    mask = torch.tensor([True, False, True])
    assert bitpack.pack(mask, 1).tolist() == [0b101]
    # bits above the width are ignored
    for use_numpy in (True, False):
        assert bitpack.pack(torch.tensor([2, 3]), 1, use_numpy=use_numpy).tolist() == [0b10]


def test_bad_widths_and_sizes() -> None:
    with pytest.raises(ValueError, match="1..8"):
        bitpack.pack(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="1..8"):
        bitpack.packed_bytes(3, 0)
    with pytest.raises(ValueError, match="take 2 bytes, got 3"):
        bitpack.unpack(torch.zeros(3, dtype=torch.uint8), 1, 9)
    assert [bitpack.bits_for(v) for v in (1, 2, 3, 4, 5, 17, 128, 256)] == [1, 1, 2, 2, 3, 5, 7, 8]


def test_padding_check_sees_stray_bits() -> None:
    packed = bitpack.pack(torch.ones(9, dtype=torch.uint8), 2)
    assert bitpack.padding_is_clear(packed, 2, 9)
    packed[-1] |= 0b10
    assert not bitpack.padding_is_clear(packed, 2, 9)


@pytest.mark.parametrize("n", LENGTHS)
def test_decode_plane_expands_bits_to_values(n: int) -> None:
    bits = torch.randint(0, 2, (n,), dtype=torch.uint8)
    plane = bitpack.pack(bits, 1)
    expected = torch.where(bits.bool(), -2.5, 0.75)
    for use_numpy in (True, False):
        values = kernels.expand_plane(
            plane, n, 0.75, -2.5, torch.device("cpu"), use_numpy=use_numpy
        )
        assert values.dtype == torch.float32 and torch.equal(values, expected)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    codes=st.lists(st.integers(0, 255), max_size=70),
)
def test_round_trip_property(bits: int, codes: list[int]) -> None:
    tensor = torch.tensor(codes, dtype=torch.uint8) & ((1 << bits) - 1)
    packed = bitpack.pack(tensor, bits)
    assert packed.numel() == bits * ((len(codes) + 7) // 8)
    assert torch.equal(bitpack.unpack(packed, bits, len(codes)), tensor)
