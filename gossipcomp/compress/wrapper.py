"""A compressor around another one, passing the inner compressor's traits on.

Error feedback (compress/feedback.py) and per-segment statistics (compress/segmented.py) each
wrap a compressor and change a few of its traits; everything else a caller asks of the wrapper
(its name, codec, spec, bias, contraction, whether payloads add up or sparsify, its consensus
step) is the inner compressor's. `Wrapper` says that once; a subclass overrides what it changes.
"""

from __future__ import annotations

from gossipcomp.compress.base import Compressor


class Wrapper:
    """Passes every trait of `inner` on; subclasses override the ones they change."""

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def codec(self) -> str:
        return self.inner.codec

    @property
    def spec(self) -> str:
        return self.inner.spec

    @property
    def unbiased(self) -> bool:
        return self.inner.unbiased

    @property
    def contractive(self) -> bool:
        return self.inner.contractive

    @property
    def summable(self) -> bool:
        return self.inner.summable

    @property
    def sparsifying(self) -> bool:
        return self.inner.sparsifying

    @property
    def consensus_step(self) -> float:
        return self.inner.consensus_step
