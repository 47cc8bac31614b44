"""Bit packing of b-bit codes (1 <= b <= 8) as bit-planes, on any device.

Layout: plane j (j = 0 is the least significant bit of every code) comes before plane j + 1;
each plane is ceil(n / 8) bytes; element i lives in byte i // 8 of its plane at bit i % 8
(least significant bit first). Bits past element n - 1 in the last byte are zero. A 1-bit plane
therefore costs n / 8 bytes, and b planes exactly b * ceil(n / 8) bytes.

CPU tensors go through numpy's packbits / unpackbits (over 20x faster than the equivalent torch
ops here); other devices use torch ops. Both paths produce the same bytes (tested).
"""

from __future__ import annotations

import numpy
import torch

MAX_BITS = 8


def plane_bytes(numel: int) -> int:
    """Bytes of one bit-plane holding `numel` elements."""
    return (numel + 7) // 8


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of `bits` bit-planes holding `numel` elements."""
    _check_bits(bits)
    return bits * plane_bytes(numel)


def bits_for(values: int) -> int:
    """Bits needed to store codes 0 .. values - 1 (at least 1)."""
    if values < 1:
        raise ValueError(f"need at least one code value, got {values}")
    return max(1, (values - 1).bit_length())


def pack(codes: torch.Tensor, bits: int, *, use_numpy: bool | None = None) -> torch.Tensor:
    """Pack a 1-D tensor of codes (bool or integer, each < 2**bits) into uint8 bit-planes.

    Higher bits of a code are ignored. Returns a 1-D uint8 tensor of
    `packed_bytes(len(codes), bits)` bytes on the codes' device. `use_numpy` forces (True) or
    forbids (False) the numpy path; None picks it for CPU tensors.
    """
    _check_bits(bits)
    if codes.dim() != 1:
        raise ValueError(f"pack expects a 1-D tensor, got shape {tuple(codes.shape)}")
    zero_one = codes.dtype == torch.bool
    codes = codes.view(torch.uint8) if zero_one else codes.to(torch.uint8)
    if use_numpy if use_numpy is not None else codes.device.type == "cpu":
        planes = pack_numpy(codes.contiguous().numpy(), bits, zero_one)
        return torch.from_numpy(numpy.ascontiguousarray(planes).reshape(-1))
    return _pack_torch(codes, bits)


def unpack(
    packed: torch.Tensor, bits: int, numel: int, *, use_numpy: bool | None = None
) -> torch.Tensor:
    """Inverse of `pack`: a 1-D uint8 tensor of `numel` codes on the packed tensor's device."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"unpack expects 1-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_bytes(numel, bits):
        raise ValueError(
            f"{bits}-bit planes of {numel} codes take {packed_bytes(numel, bits)} bytes, "
            f"got {packed.numel()}"
        )
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8, device=packed.device)
    if use_numpy if use_numpy is not None else packed.device.type == "cpu":
        codes = unpack_numpy(packed.contiguous().numpy().reshape(bits, -1), numel)
        return torch.from_numpy(numpy.ascontiguousarray(codes))
    return _unpack_torch(packed, bits, numel)


def padding_is_clear(packed: torch.Tensor, bits: int, numel: int) -> bool:
    """True when the unused bits after element numel - 1 are zero in every plane."""
    spare = plane_bytes(numel) * 8 - numel
    if spare == 0 or numel == 0:
        return True
    last = packed.view(bits, plane_bytes(numel))[:, -1]
    return not bool(torch.any(last >> (8 - spare)))


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bit width must be in 1..{MAX_BITS}, got {bits}")


# Multi-bit planes with 64-bit words (8 codes at a time): masking bit j of 8 codes leaves one
# 0/1 byte per code, and multiplying by _GATHER moves byte i's bit to bit 56 + i (the partial
# products never carry into each other), so the top byte is those 8 bits packed LSB first.
# Unpacking looks each plane byte up in _SPREAD: the 8 bits as 8 bytes of 0/1.
_LOW_BITS = numpy.uint64(0x0101010101010101)
_GATHER = numpy.uint64(0x0102040810204080)
_SPREAD = numpy.array(
    [sum(((b >> i) & 1) << (8 * i) for i in range(8)) for b in range(256)], dtype=numpy.uint64
)


def pack_numpy(codes: numpy.ndarray, bits: int, zero_one: bool = False) -> numpy.ndarray:
    """numpy core of `pack`: uint8 codes -> a (bits, ceil(n / 8)) array of planes.

    `zero_one` promises every code is 0 or 1 (a bool mask), which skips masking the low bit.
    """
    if bits == 1:
        planes = codes if zero_one else codes & 1  # packbits sets a bit for any non-zero byte
        return numpy.packbits(planes, bitorder="little").reshape(1, -1)
    size = plane_bytes(codes.size)
    if codes.size != 8 * size or not codes.flags.c_contiguous:
        padded = numpy.zeros(8 * size, dtype=numpy.uint8)
        padded[: codes.size] = codes
        codes = padded
    words = codes.view(numpy.uint64)
    scratch = numpy.empty_like(words)
    planes = numpy.empty((bits, size), dtype=numpy.uint8)
    for j in range(bits):
        numpy.right_shift(words, numpy.uint64(j), out=scratch)
        numpy.bitwise_and(scratch, _LOW_BITS, out=scratch)
        numpy.multiply(scratch, _GATHER, out=scratch)  # wraps modulo 2**64 by design
        numpy.right_shift(scratch, numpy.uint64(56), out=scratch)
        planes[j] = scratch
    return planes


def unpack_numpy(planes: numpy.ndarray, numel: int) -> numpy.ndarray:
    """numpy core of `unpack`: a (bits, ceil(numel / 8)) array of planes -> numel uint8 codes."""
    if planes.shape[0] == 1:
        return numpy.unpackbits(planes[0], count=numel, bitorder="little")
    words = numpy.take(_SPREAD, planes[0])
    scratch = numpy.empty_like(words)
    for j in range(1, planes.shape[0]):
        numpy.take(_SPREAD, planes[j], out=scratch)
        numpy.left_shift(scratch, numpy.uint64(j), out=scratch)
        numpy.bitwise_or(words, scratch, out=words)
    return words.view(numpy.uint8)[:numel]


def _pack_torch(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.numel()
    padded = torch.zeros(plane_bytes(n) * 8, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    groups = padded.view(-1, 8)
    # made on the device: a tensor from a host list is a copy that waits for the device
    ones = torch.ones(8, dtype=torch.uint8, device=codes.device)
    weights = ones << torch.arange(8, dtype=torch.uint8, device=codes.device)
    planes = [((groups >> j) & 1).mul_(weights).sum(dim=1, dtype=torch.uint8) for j in range(bits)]
    return torch.cat(planes)


def _unpack_torch(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    planes = ((packed.view(bits, -1, 1) >> shifts) & 1).view(bits, -1)[:, :numel]
    codes = planes[0].clone()
    for j in range(1, bits):
        codes |= planes[j] << j
    return codes


def plane_table(clear: float, set_: float) -> torch.Tensor:
    """A (256, 8) float32 table: row b holds the 8 values that byte b of a plane expands to."""
    bits = (torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), set_, clear).to(torch.float32)


def decode_plane(
    plane: torch.Tensor, numel: int, clear: float, set_: float, device: torch.device
) -> torch.Tensor:
    """Expand one bit-plane straight to float32 values: `clear` where a bit is 0, `set_` where 1.

    One table lookup per byte (see plane_table), so no intermediate 0/1 tensor is built; torch
    ops on `device` (kernels.expand_plane spreads the CPU case over numpy spans and threads).
    Returns a fresh 1-D float32 tensor of `numel` values on `device`.
    """
    if plane.numel() != plane_bytes(numel):
        raise ValueError(f"a plane of {numel} bits takes {plane_bytes(numel)} bytes")
    table = plane_table(clear, set_)
    return table.to(device).index_select(0, plane.to(device).int()).view(-1)[:numel]
