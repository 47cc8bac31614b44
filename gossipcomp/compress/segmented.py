"""A merged buffer compressed with its statistics per tensor: one scale per segment.

Merged compression (gossip/grouping.py) packs a group's tensors into one flat buffer and
compresses it once, which saves the per-call cost of many small tensors. A codec whose decoded
values hang on a statistic of its whole input would then take that statistic over tensors of
very different magnitudes: one sign scale (mean |x|) for a model's 64 x 64 weights, its
LayerNorm gains and its biases shrinks the large entries and inflates the small ones; measured
on the 102 tensors of `resmlp`, Choco with sign ended 100 rounds 2.2 points below per-tensor
compression (docs/benchmarks.md). `Segmented` keeps the codec's bit-planes, its
random draws and its decoding over the whole buffer (vectorised, as before), but takes its
statistics per segment (one segment per original tensor), each with the codec's own one-tensor
kernel on a view of the segment, so every tensor is decoded against exactly the statistics it
would get on its own: for the deterministic codecs (sign, onebit) a merged buffer decodes bit
for bit as its tensors compressed one by one, so merging cannot change what an algorithm
computes. That costs a loop over the segments for the statistics (measured on resmlp's 102
tensors: 0.6 ms against 0.06 ms for one numpy reduceat over the buffer, whose float32 sums are
not numpy's pairwise sums of each tensor and so differ in the last bit; compressing the 102
tensors one by one costs 23 ms) and 4 bytes per extra statistic on the wire.

Which codecs need statistics per segment (`Codec.segment_scalars`), and why:
- sign (mean |x|), onebit (the mean of each side), qsgd (||x||_2), terngrad (max |x|): every
  decoded value is a multiple of one statistic, so a merged buffer needs one per tensor.
  For qsgd and terngrad the variance bound then holds per tensor: the merged buffer's bound is
  the largest of its tensors' (`variance_bound`), not the bound of the whole buffer's size.
- identity, fp16, bf16: element-wise, no statistic.
- topk, dgc: the values travel exactly; on a merged buffer the k largest entries of the whole
  buffer are chosen, the best k-sparse approximation of it (its error is at most that of any
  split of k over the tensors, per-tensor top-k included), which is the contraction Choco and
  error feedback rely on.
- randomk: uniform indices and a d / k factor that does not depend on the values: unbiased on
  the merged buffer as on each tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from gossipcomp.compress import kernels
from gossipcomp.compress.base import Compressed, CompressionContext, Compressor
from gossipcomp.compress.codec import Codec, Device, segmented_codec
from gossipcomp.compress.feedback import ErrorFeedback
from gossipcomp.compress.wrapper import Wrapper


class Segmented(Wrapper):
    """`inner` on a merged buffer of segments of `numels` elements, its statistics (scales,
    means) taken per segment. Wire codec "INNER/segments"; payload: the statistics of each
    segment in order, then the inner codec's element data over the whole buffer, exactly
    `wire_bytes(sum(numels))` bytes. Built from a schedule's group, not from a spec: its
    `spec` is the inner codec's (what the schedule names)."""

    inner: Codec

    def __init__(self, inner: Codec, numels: Sequence[int]) -> None:
        if not inner.segment_scalars:
            raise ValueError(f"{inner.name} keeps no statistics to take per segment")
        super().__init__(inner)
        self.segments = kernels.Segments(numels)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.segments.numels)

    @property
    def codec(self) -> str:
        return segmented_codec(self.inner.codec)

    @property
    def summable(self) -> bool:
        return False  # every segment's own scale: payloads do not add up

    def variance_bound(self, numel: int) -> float:
        """The largest of the segments' bounds: the error of each segment is bounded by its own
        (a codec that is unbiased per segment is unbiased on the whole buffer)."""
        self._check_numel(numel)
        return max((self.inner.variance_bound(n) for n in self.numels if n), default=0.0)

    def wire_bytes(self, numel: int) -> int:
        self._check_numel(numel)
        return self.inner.segmented_wire_bytes(self.segments)

    def compress(self, tensor: torch.Tensor, ctx: CompressionContext) -> Compressed:
        return self.inner.compress_segments(tensor, self.segments, ctx)

    def decompress(
        self, compressed: Compressed, ctx: CompressionContext, device: Device = None
    ) -> torch.Tensor:
        return self.inner.decompress_segments(compressed, self.segments, ctx, device)

    def _check_numel(self, numel: int) -> None:
        if operator.index(numel) != self.segments.numel:
            raise ValueError(
                f"{self.codec}: built for {self.segments.numel} elements in "
                f"{len(self.segments)} segments, asked about {numel}"
            )


def per_segment(compressor: Compressor, numels: Sequence[int]) -> Compressor:
    """The compressor for a merged buffer of tensors of `numels` elements: `compressor` itself
    when it has no statistics to keep per tensor or the buffer holds one tensor (the per-tensor
    wire format, unchanged), else `Segmented` (inside error feedback when it is wrapped)."""
    if isinstance(compressor, ErrorFeedback):
        inner = per_segment(compressor.inner, numels)
        return compressor if inner is compressor.inner else ErrorFeedback(inner)
    if len(numels) <= 1 or not isinstance(compressor, Codec) or not compressor.segment_scalars:
        return compressor
    return Segmented(compressor, numels)
