"""Payloads as device tensors: every built-in codec writes its wire format into a uint8 tensor.

A collective (all-reduce, all-gather, point-to-point) moves tensors on the accelerator, so the
all-reduce mode needs a payload there, not in host bytes. `encode` writes exactly
`wire_bytes(numel)` bytes into a uint8 tensor on the input's device and `decode` reads one back
into float32, both in the same wire format as `Compressor.compress` (see each codec's module),
so gossip and all-reduce share one format.

Two paths:
- host (the default for CPU tensors): the codec's own compress/decompress, with their numpy
  kernels and full payload validation; the bytes are copied into / out of the uint8 tensor.
- device (the default elsewhere; `host=False` forces it on the CPU, which the tests do): torch
  ops only, with no host synchronisation: no `.item()`, no Python branch on a tensor's value, no
  boolean-mask indexing. Scales are computed and written on the device. Random choices that both
  ends must agree on (random-k's indices) come from the shared context on the CPU, as in the host
  path, and are uploaded (no device value is read). The device path produces the same bytes as
  the host path except: a scale may differ in its last float32 bit (sums in another order), and
  QSGD/TernGrad draw their uniforms from torch's generator on the device (the host path uses
  numpy's PCG64 on the CPU), as `Compressor.compress` already does for non-CPU tensors.
  Device decoding does not validate (that would read values back to the host): use it between
  ranks of one job, which trust each other as torch.distributed does; anything from a network or
  a file goes through the host path.

`summable_view` gives the typed values of a summable payload (fp16, bf16, identity, random-k),
which a collective may sum element-wise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from gossipcomp.compress import bitpack
from gossipcomp.compress.base import Compressed, CompressionContext, Compressor
from gossipcomp.compress.codec import Codec
from gossipcomp.compress.dense import BFloat16, Float16, Identity
from gossipcomp.compress.quantize import QSGD, TernGrad, _StochasticLevels
from gossipcomp.compress.registry import COMPRESSORS
from gossipcomp.compress.sign import OneBit, Sign
from gossipcomp.compress.sparse import DGC, DGC_MIN_SAMPLE, DGC_SAMPLE_FRACTION, RandomK, TopK
from gossipcomp.compress.sparse import shared_indices as _shared_indices

Encoder = Callable[[Codec, torch.Tensor, CompressionContext, torch.Tensor], None]
Decoder = Callable[[Codec, torch.Tensor, int, CompressionContext], torch.Tensor]


def encode(
    compressor: Compressor,
    tensor: torch.Tensor,
    ctx: CompressionContext,
    out: torch.Tensor | None = None,
    *,
    host: bool | None = None,
) -> torch.Tensor:
    """The payload of `tensor` as a 1-D uint8 tensor of exactly wire_bytes(numel) bytes.

    Written into `out` when given (1-D uint8 of that size, on the tensor's device); `host`
    picks the path (module docstring; None: host for CPU tensors).
    """
    codec = _built_in(compressor)
    if not tensor.is_floating_point():
        raise TypeError(f"{codec.name} compresses floating-point tensors, got {tensor.dtype}")
    flat = tensor.detach().reshape(-1)
    size = codec.wire_bytes(flat.numel())
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=tensor.device)
    elif out.dtype != torch.uint8 or out.shape != (size,) or out.device != tensor.device:
        raise ValueError(
            f"{codec.name} payload buffer: expected 1-D uint8 of {size} bytes on "
            f"{tensor.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if _use_host(tensor.device, host):
        data = codec.compress(flat, ctx).data
        if size:
            out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return out
    if flat.numel() == 0:
        out.zero_()  # every format's payload of an empty tensor is all zeros (scales, counts)
    else:
        _ENCODERS[codec.name](codec, flat, ctx, out)
    return out


def decode(
    compressor: Compressor,
    payload: torch.Tensor,
    shape: Sequence[int],
    ctx: CompressionContext,
    *,
    host: bool | None = None,
) -> torch.Tensor:
    """A fresh float32 tensor of `shape` on the payload's device, decoded from `payload`.

    The host path validates like `Compressor.decompress` (PayloadError); the device path does
    not (module docstring). A payload of the wrong size is refused on both.
    """
    codec = _built_in(compressor)
    dims = tuple(int(n) for n in shape)
    numel = math.prod(dims)
    size = codec.wire_bytes(numel)
    if payload.dtype != torch.uint8 or payload.shape != (size,):
        raise ValueError(
            f"{codec.name} payload for {numel} elements: expected 1-D uint8 of {size} bytes, "
            f"got {payload.dtype} {tuple(payload.shape)}"
        )
    if _use_host(payload.device, host):
        data = payload.detach().cpu().numpy().tobytes()
        return codec.decompress(Compressed(codec.codec, dims, data), ctx, payload.device)
    if numel == 0:
        return torch.zeros(dims, dtype=torch.float32, device=payload.device)
    return _DECODERS[codec.name](codec, payload, numel, ctx).view(dims)


def summable_dtype(compressor: Compressor) -> torch.dtype:
    """The dtype a collective sums a summable payload in (ValueError if it cannot be summed)."""
    codec = _built_in(compressor)
    dtype = _SUMMABLE_DTYPES.get(codec.name)
    if dtype is None:
        raise ValueError(
            f"{codec.name} payloads cannot be summed element-wise; summable: "
            f"{', '.join(sorted(_SUMMABLE_DTYPES))}"
        )
    return dtype


def summable_view(compressor: Compressor, payload: torch.Tensor) -> torch.Tensor:
    """The values of a summable payload, typed (a view, no copy): the tensor a collective sums.

    identity and random-k: float32; fp16: float16; bf16: bfloat16. The element-wise sum of the
    views of several payloads is the payload of the sum (exactly, up to the summing dtype's
    rounding). ValueError for compressors whose payloads cannot be summed.
    """
    return payload.view(summable_dtype(compressor))


def _use_host(device: torch.device, host: bool | None) -> bool:
    return device.type == "cpu" if host is None else host


def _built_in(compressor: Compressor) -> Codec:
    if not isinstance(compressor, Codec) or compressor.name not in _ENCODERS:
        raise TypeError(
            f"device payloads are defined for the built-in codecs ({', '.join(sorted(_ENCODERS))})"
            f", got {type(compressor).__name__}; error feedback is kept by the caller"
        )
    return compressor


def _section(payload: torch.Tensor, start: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    """`count` elements of `dtype` at byte `start` of the uint8 payload (a view)."""
    view = payload[start : start + count * dtype.itemsize]
    return view if dtype == torch.uint8 else view.view(dtype)


def _float32_of(value: torch.Tensor) -> torch.Tensor:
    """A float64 scalar tensor rounded to float32 (beyond float32's range: +-Inf, as on the
    host path)."""
    return value.to(torch.float32)


def _sign_plane(flat: torch.Tensor) -> torch.Tensor:
    return bitpack.pack(flat < 0, 1, use_numpy=False)


def _expand(
    plane: torch.Tensor, numel: int, clear: torch.Tensor, set_: torch.Tensor
) -> torch.Tensor:
    bits = bitpack.unpack(plane, 1, numel, use_numpy=False).bool()
    return torch.where(bits, set_, clear)


# --- encoders (torch ops, no host sync) -------------------------------------------------------


def _encode_identity(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    out.view(torch.float32).copy_(flat)


def _encode_half(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    dtype = _SUMMABLE_DTYPES[codec.name]
    limit = torch.finfo(dtype).max
    wide = flat.to(torch.float32)
    out.view(dtype).copy_(torch.where(wide.isinf(), wide, wide.clamp(-limit, limit)))


def _encode_sign(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    numel = flat.numel()
    abs_sum = flat.abs().sum(dtype=torch.float64)
    _section(out, 0, torch.float32, 1).copy_(_float32_of(abs_sum / max(1, numel)).view(1))
    _section(out, 4, torch.uint8, bitpack.plane_bytes(numel)).copy_(_sign_plane(flat))


def _encode_onebit(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    numel = flat.numel()
    negative = flat < 0
    negatives = negative.sum()
    positives = numel - negatives
    positive_sum = flat.clamp(min=0).sum(dtype=torch.float64)
    negative_sum = flat.clamp(max=0).sum(dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=flat.device)
    means = torch.stack(
        [
            torch.where(positives > 0, positive_sum / positives.clamp(min=1), zero),
            torch.where(negatives > 0, negative_sum / negatives.clamp(min=1), zero),
        ]
    )
    _section(out, 0, torch.float32, 2).copy_(_float32_of(means))
    _section(out, 8, torch.uint8, bitpack.plane_bytes(numel)).copy_(
        bitpack.pack(negative, 1, use_numpy=False)
    )


def _largest_first(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of `magnitude`, ties to the lowest index, ascending."""
    order = torch.sort(magnitude, descending=True, stable=True).indices[:k]
    return order.sort().values


def _write_sparse(
    out: torch.Tensor, start: int, k: int, indices: torch.Tensor, values: torch.Tensor
) -> None:
    _section(out, start, torch.float32, k).copy_(values)
    _section(out, start + 4 * k, torch.int32, k).copy_(indices)


def _encode_topk(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    assert isinstance(codec, TopK)
    k = codec.k(flat.numel())
    magnitude = flat.abs().to(torch.float32).nan_to_num(nan=math.inf)
    indices = _largest_first(magnitude, k)
    _write_sparse(out, 0, k, indices, flat[indices].to(torch.float32))


def _shared(ctx: CompressionContext, numel: int, k: int, device: torch.device) -> torch.Tensor:
    return _shared_indices(ctx, numel, k).to(device, non_blocking=True)


def _encode_randomk(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    assert isinstance(codec, RandomK)
    numel = flat.numel()
    k = codec.k(numel)
    values = flat[_shared(ctx, numel, k, flat.device)].to(torch.float32)
    scale = numel / k if codec.unbiased and k else 1.0
    _section(out, 0, torch.float32, k).copy_(values.mul_(scale))


def _encode_dgc(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    """The host rule (sparse.py) with the data-dependent count kept on the device: candidates
    are |x| >= the sampled threshold; the k largest of them, or all when fewer pass."""
    assert isinstance(codec, DGC)
    numel, k = flat.numel(), codec.k(flat.numel())
    count_slot = _section(out, 0, torch.int32, 1)
    if k == 0:
        count_slot.zero_()
        return
    magnitude = flat.abs().to(torch.float32)
    sample_size = min(numel, max(DGC_MIN_SAMPLE, math.ceil(DGC_SAMPLE_FRACTION * numel)))
    if sample_size == numel:  # the sample is everything: the threshold is exact
        indices = _largest_first(magnitude.nan_to_num(nan=math.inf), k)
        count_slot.fill_(k)
        _write_sparse(out, 4, k, indices, flat[indices].to(torch.float32))
        return
    rank = min(sample_size, math.ceil(k * sample_size / numel))
    generator = ctx.generator(flat.device)
    positions = torch.randint(0, numel, (sample_size,), generator=generator, device=flat.device)
    threshold = torch.topk(magnitude[positions], rank, sorted=False).values.min()
    candidate = magnitude >= threshold  # NaN never qualifies
    key = torch.where(candidate, magnitude, torch.full_like(magnitude, -1.0))
    chosen = torch.sort(key, descending=True, stable=True).indices[:k]
    passed = candidate[chosen]
    # candidates first, in ascending index order; non-candidates pushed past the end
    order = torch.where(passed, chosen, chosen + numel).sort().values
    valid = order < numel
    indices = torch.where(valid, order, torch.zeros_like(order))
    values = torch.where(
        valid, flat[indices].to(torch.float32), torch.zeros((), device=flat.device)
    )
    count_slot.copy_(valid.sum().to(torch.int32).view(1))
    _write_sparse(out, 4, k, indices, values)


def _encode_levels(
    codec: Codec, flat: torch.Tensor, ctx: CompressionContext, out: torch.Tensor
) -> None:
    assert isinstance(codec, _StochasticLevels)
    numel, levels, bits = flat.numel(), codec._levels, codec._level_bits
    wide = flat.to(torch.float32)
    if isinstance(codec, QSGD):
        scale = _float32_of(torch.linalg.vector_norm(flat, dtype=torch.float64))
    else:
        scale = _float32_of(wide.abs().max().to(torch.float64))
    _section(out, 0, torch.float32, 1).copy_(scale.view(1))
    usable = (scale > 0) & torch.isfinite(scale)
    factor = torch.where(usable, levels / scale, torch.zeros_like(scale))
    uniform = torch.rand(numel, generator=ctx.generator(flat.device), device=flat.device)
    level = (wide.abs() * factor + uniform).floor_().clamp_(max=levels).nan_to_num_(nan=0.0)
    level = torch.where(usable, level, torch.zeros_like(level)).to(torch.uint8)
    plane = bitpack.plane_bytes(numel)
    signs = torch.where(usable, wide < 0, torch.zeros_like(wide, dtype=torch.bool))
    _section(out, 4, torch.uint8, plane).copy_(bitpack.pack(signs, 1, use_numpy=False))
    _section(out, 4 + plane, torch.uint8, bits * plane).copy_(
        bitpack.pack(level, bits, use_numpy=False)
    )


# --- decoders (torch ops, no host sync, no validation) ----------------------------------------


def _decode_identity(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    return payload.view(torch.float32).clone()


def _decode_half(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    return payload.view(_SUMMABLE_DTYPES[codec.name]).to(torch.float32)


def _decode_sign(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    scale = _section(payload, 0, torch.float32, 1)[0]
    return _expand(payload[4:], numel, scale, -scale)


def _decode_onebit(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    means = _section(payload, 0, torch.float32, 2)
    return _expand(payload[8:], numel, means[0], means[1])


def _scatter(numel: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Zeros with `values` added at `indices` (unused slots carry index 0 and value 0)."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    return out.index_add_(0, indices.to(torch.int64), values)


def _decode_slots(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    """Top-k's and DGC's k value slots then k index slots (DGC's after its int32 count)."""
    assert isinstance(codec, TopK | DGC)
    k, start = codec.k(numel), 4 if isinstance(codec, DGC) else 0
    return _scatter(
        numel,
        _section(payload, start + 4 * k, torch.int32, k),
        _section(payload, start, torch.float32, k),
    )


def _decode_randomk(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    assert isinstance(codec, RandomK)
    k = codec.k(numel)
    indices = _shared(ctx, numel, k, payload.device)
    return _scatter(numel, indices, _section(payload, 0, torch.float32, k))


def _decode_levels(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: CompressionContext
) -> torch.Tensor:
    assert isinstance(codec, _StochasticLevels)
    levels, bits = codec._levels, codec._level_bits
    plane = bitpack.plane_bytes(numel)
    step = _section(payload, 0, torch.float32, 1)[0] / levels
    values = _expand(payload[4 : 4 + plane], numel, step, -step)
    level = bitpack.unpack(
        payload[4 + plane : 4 + (1 + bits) * plane], bits, numel, use_numpy=False
    )
    return values.mul_(level)


_SUMMABLE_DTYPES: dict[str, torch.dtype] = {
    Identity.name: torch.float32,
    Float16.name: torch.float16,
    BFloat16.name: torch.bfloat16,
    RandomK.name: torch.float32,
}
_ENCODERS: dict[str, Encoder] = {
    Identity.name: _encode_identity,
    Float16.name: _encode_half,
    BFloat16.name: _encode_half,
    Sign.name: _encode_sign,
    OneBit.name: _encode_onebit,
    TopK.name: _encode_topk,
    RandomK.name: _encode_randomk,
    DGC.name: _encode_dgc,
    QSGD.name: _encode_levels,
    TernGrad.name: _encode_levels,
}
_DECODERS: dict[str, Decoder] = {
    Identity.name: _decode_identity,
    Float16.name: _decode_half,
    BFloat16.name: _decode_half,
    Sign.name: _decode_sign,
    OneBit.name: _decode_onebit,
    TopK.name: _decode_slots,
    RandomK.name: _decode_randomk,
    DGC.name: _decode_slots,
    QSGD.name: _decode_levels,
    TernGrad.name: _decode_levels,
}
if set(_ENCODERS) != set(COMPRESSORS) or set(_DECODERS) != set(COMPRESSORS):
    raise ImportError("every registered compressor needs a device encoder and decoder")
if any(not COMPRESSORS[name].summable for name in _SUMMABLE_DTYPES) or any(
    cls.summable and name not in _SUMMABLE_DTYPES for name, cls in COMPRESSORS.items()
):
    raise ImportError("summable_view must cover exactly the summable compressors")
