"""Device payloads (compress/device.py): same wire format as the host path, exact sizes, no
host synchronisation on the device path (forced on the CPU here; on CUDA where available)."""

from __future__ import annotations

import pytest
import torch

from gossipcomp.compress import COMPRESSORS, CompressionContext, ErrorFeedback, device, parse_spec

SPECS = [
    "identity",
    "fp16",
    "bf16",
    "sign",
    "onebit",
    "topk:ratio=0.05",
    "randomk:ratio=0.1",
    "randomk:ratio=0.1,unbiased=true",
    "dgc:ratio=0.01",
    "qsgd:levels=4",
    "terngrad",
]
EXACT = {"identity", "fp16", "bf16", "topk", "randomk", "dgc"}  # same bytes on both paths
SIZES = [0, 1, 13, 1000, 50_000]
CTX = CompressionContext(seed=7, sender=1, receiver=-1, round=3, tensor_index=2)


def test_every_registered_codec_is_covered() -> None:
    assert {parse_spec(s).name for s in SPECS} == set(COMPRESSORS)


def _input(numel: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    if numel > 8:
        x[5] = x[6]  # a tie: the lowest index wins in both paths
    return x


@pytest.mark.parametrize("spec", SPECS)
def test_device_path_writes_the_host_wire_format(spec: str) -> None:
    compressor = parse_spec(spec)
    for numel in SIZES:
        x = _input(numel)
        host = device.encode(compressor, x, CTX)
        on_device = device.encode(compressor, x, CTX, host=False)
        assert on_device.dtype == torch.uint8
        assert on_device.shape == (compressor.wire_bytes(numel),)
        # the host decoder validates everything: the device bytes are a valid payload
        checked = device.decode(compressor, on_device, (numel,), CTX)
        unchecked = device.decode(compressor, on_device, (numel,), CTX, host=False)
        torch.testing.assert_close(unchecked, checked, rtol=0, atol=0)
        if compressor.name in EXACT:
            assert torch.equal(host, on_device), (spec, numel)
        elif compressor.name in ("sign", "onebit") and numel:
            scales = 4 if compressor.name == "sign" else 8
            assert torch.equal(host[scales:], on_device[scales:])  # the sign plane
            torch.testing.assert_close(
                host[:scales].view(torch.float32),
                on_device[:scales].view(torch.float32),
                rtol=1e-6,
                atol=0,
            )


@pytest.mark.parametrize("spec", ["qsgd:levels=4", "terngrad", "randomk:ratio=0.25,unbiased=true"])
def test_device_path_of_unbiased_codecs_is_unbiased(spec: str) -> None:
    compressor = parse_spec(spec)
    x = _input(64)
    trials = 2000
    total = torch.zeros(64)
    for trial in range(trials):
        ctx = CompressionContext(0, 0, -1, trial, 0)
        total += device.decode(
            compressor, device.encode(compressor, x, ctx, host=False), (64,), ctx, host=False
        )
    error = (total / trials - x).abs().max()
    spread = x.abs().max() * 4 * (compressor.variance_bound(64) / trials) ** 0.5 + 1e-3
    assert error < spread


def test_device_path_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("host synchronisation on the device path")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for spec in SPECS:
        compressor = parse_spec(spec)
        if compressor.name == "randomk":
            continue  # its indices come from the context on the CPU (numpy), not from the data
        x = torch.randn(4096)
        payload = device.encode(compressor, x, CTX, host=False)
        device.decode(compressor, payload, (4096,), CTX, host=False)


@pytest.mark.parametrize("spec", ["identity", "fp16", "bf16", "randomk:ratio=0.1"])
def test_summable_payloads_sum_to_the_payload_of_the_sum(spec: str) -> None:
    compressor = parse_spec(spec)
    ctx = CompressionContext(1, -1, -1, 0, 0)  # shared: random-k draws the same indices
    xs = [_input(1000) * (i + 1) for i in range(3)]
    payloads = [device.encode(compressor, x, ctx) for x in xs]
    summed = torch.stack([device.summable_view(compressor, p).float() for p in payloads]).sum(0)
    total = torch.empty_like(payloads[0])
    device.summable_view(compressor, total).copy_(summed)
    decoded_sum = sum(device.decode(compressor, p, (1000,), ctx) for p in payloads)
    tolerance = 0.0 if compressor.name in ("identity", "randomk") else 2e-2
    torch.testing.assert_close(
        device.decode(compressor, total, (1000,), ctx), decoded_sum, rtol=tolerance, atol=tolerance
    )


def test_bad_buffers_and_wrappers_are_refused() -> None:
    compressor = parse_spec("sign")
    with pytest.raises(ValueError, match="expected 1-D uint8 of 17 bytes"):
        device.decode(compressor, torch.zeros(16, dtype=torch.uint8), (100,), CTX)
    with pytest.raises(ValueError, match="payload buffer"):
        device.encode(compressor, torch.randn(100), CTX, out=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="error feedback is kept by the caller"):
        device.encode(ErrorFeedback(compressor), torch.randn(10), CTX)
    with pytest.raises(ValueError, match="cannot be summed"):
        device.summable_view(compressor, torch.zeros(17, dtype=torch.uint8))
    with pytest.raises(TypeError, match="floating-point"):
        device.encode(compressor, torch.arange(10), CTX)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_payloads_without_sync_decode_on_the_host(spec: str) -> None:
    compressor = parse_spec(spec)
    x = _input(100_000).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        payload = device.encode(compressor, x, CTX)
        decoded = device.decode(compressor, payload, x.shape, CTX)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert payload.is_cuda and payload.numel() == compressor.wire_bytes(x.numel())
    checked = device.decode(compressor, payload.cpu(), x.shape, CTX)  # validated on the host
    torch.testing.assert_close(decoded.cpu(), checked)
