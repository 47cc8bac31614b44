"""Choco-SGD (Koloskova, Stich, Jaggi 2019): gossip of compressed differences to public copies.

Each peer keeps a public copy xh_i of its model, which every neighbour tracks exactly (all start
at 0), and s_i = sum over N(i) and i of w_ij xh_j. A round:
    q_i = C(x_i - xh_i); send q_i to every neighbour
    xh_i += D(q_i); s_i += sum_j w_ij D(q_j) (j in N(i) and i); x_i += gamma (s_i - xh_i)
With a symmetric doubly stochastic W the network sum of x is unchanged by a round, for any
compressor, biased or not. gamma is the consensus step; defaults per compressor in
`default_consensus_step`, measured on ring8 digits (docs/benchmarks.md). Choco needs a contractive compressor (E||C(x) - x||^2 <= (1 - w)
||x||^2); an unbiased one with variance bound beta ||x||^2 (QSGD, TernGrad, unbiased random-k)
is made contractive by scaling its output by 1 / (1 + beta), as the Choco paper does; both ends
scale the same bytes by the same factor, so the public copies stay identical. gamma is the consensus step; defaults per compressor in
`default_consensus_step` (reference, 8-ring: 0.45 with scaled sign, 0.0375 with top-1%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.compressed import BroadcastCodec, compressed_spec, to_wire
from gossipcomp.transport.base import PayloadSpec

PHASE = "choco"

# consensus step by compressor family (8-ring references, see module docstring)
_FIXED_STEPS = {"identity": 1.0, "fp16": 1.0, "bf16": 1.0, "sign": 0.45, "onebit": 0.45}
# sparsifiers: the step scales with the fraction kept. The paper's reference for top-1% on an
# 8-ring is 0.0375; on digits it reached 0.9545 after 600 rounds where 0.1 reached 0.970
# (docs/benchmarks.md), so top-k takes 10 x ratio. Random entries carry less of the difference
# than the largest ones, so random-k takes smaller steps (a consensus sweep diverged above ~ratio).
_SPARSE_STEP_PER_RATIO = {"topk": 10.0, "dgc": 10.0, "randomk": 2.0}
_MAX_SPARSE_STEP = {"topk": 0.45, "dgc": 0.45, "randomk": 0.3}
# after the 1 / (1 + beta) scaling; from a consensus sweep on ring8 (docs/benchmarks.md)
_UNBIASED_STEPS = {"qsgd": 0.1, "terngrad": 0.3, "randomk": 0.1}


def variance_bound(compressor: Compressor, numel: int) -> float:
    """beta with E||D(C(x)) - x||^2 <= beta ||x||^2 for unbiased compressors; 0 for biased ones.

    QSGD with s levels: min(d / s^2, sqrt(d) / s) (Alistarh et al.); unbiased random-k: d/k - 1;
    TernGrad: max|x| ||x||_1 - ||x||^2 <= (sqrt(d) - 1) ||x||^2.
    """
    if not compressor.unbiased:
        return 0.0
    if compressor.name == "qsgd":
        s = compressor.levels
        return min(numel / s**2, math.sqrt(numel) / s)
    if compressor.name == "terngrad":
        return math.sqrt(numel) - 1.0
    if compressor.name == "randomk":
        k = max(1, math.ceil(compressor.ratio * numel))
        return numel / min(k, numel) - 1.0
    if compressor.name in _FIXED_STEPS:
        return 0.0
    raise ValueError(f"no variance bound known for unbiased compressor {compressor.spec!r}")


def default_consensus_step(compressor: Compressor) -> float:
    """The documented default gamma for a compressor (error-feedback wrappers: the inner one)."""
    inner = getattr(compressor, "inner", compressor)
    if inner.name in _FIXED_STEPS:
        return _FIXED_STEPS[inner.name]
    if inner.unbiased and inner.name in _UNBIASED_STEPS:
        return _UNBIASED_STEPS[inner.name]
    if inner.name in _SPARSE_STEP_PER_RATIO:
        step = _SPARSE_STEP_PER_RATIO[inner.name] * float(inner.ratio)
        return min(_MAX_SPARSE_STEP[inner.name], step)
    return 0.1


class Choco:
    """Choco-SGD's gossip step with any compressor, `steps` times per round.

    Each step compresses x - xh afresh and exchanges it (phase "choco{s}"): more steps buy faster
    consensus with more bytes, which pays when peers' data differ (docs/benchmarks.md).
    """

    name = "choco"

    def __init__(
        self,
        compressor: Compressor,
        consensus_step: float | None = None,
        seed: int = 0,
        steps: int = 1,
    ):
        step = default_consensus_step(compressor) if consensus_step is None else consensus_step
        if not 0.0 < step <= 1.0:
            raise ValueError(f"consensus_step must lie in (0, 1] for choco, got {step}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.compressor = compressor
        self.consensus_step = step
        self.seed = seed
        self.steps = steps
        self._codec: BroadcastCodec | None = None
        self._scales: list[float] = []  # 1 / (1 + beta) per tensor
        self.public: list[torch.Tensor] = []  # xh_i
        self.mixed_public: list[torch.Tensor] = []  # s_i

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._codec = BroadcastCodec(self.compressor, self.seed, rank)
        self._scales = [1.0 / (1.0 + variance_bound(self.compressor, p.numel())) for _, p in params]
        self.public = [torch.zeros_like(p, dtype=torch.float32) for _, p in params]
        self.mixed_public = [torch.zeros_like(p, dtype=torch.float32) for _, p in params]
        spec = compressed_spec(params, self.compressor)
        return {f"{PHASE}{s}": spec for s in range(self.steps)}

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        for s in range(self.steps):
            self._consensus_step(params, hood, s)

    def _consensus_step(self, params: NamedParams, hood: Neighbourhood, s: int) -> None:
        codec = self._codec
        if codec is None:
            raise RuntimeError("Choco.step before setup")
        key = hood.round * self.steps + s  # distinct compression randomness for every step
        with torch.no_grad():
            sent = [
                codec.compress(p.float() - self.public[i], key, i)
                for i, (_, p) in enumerate(params)
            ]
            payload = tuple(to_wire(n, c) for (n, _), c in zip(params, sent, strict=True))
            result = hood.exchange(f"{PHASE}{s}", payload)
            # neighbours that failed this round are left out of s_i (their weight stays unused)
            for i, (_, p) in enumerate(params):
                scale = self._scales[i]
                own = codec.decompress_own(sent[i], key, i, self.public[i])
                self.public[i].add_(own, alpha=scale)
                self.mixed_public[i].add_(own, alpha=scale * hood.self_weight)
                for j, envelope in result.received.items():
                    theirs = codec.decompress_from(envelope, i, self.public[i], key)
                    self.mixed_public[i].add_(theirs, alpha=scale * hood.weights[j])
                p.add_(
                    (self.mixed_public[i] - self.public[i]).to(p.dtype), alpha=self.consensus_step
                )
