"""Compressors: tensor -> payload of a size known in advance -> tensor. Pure tensor code.

Build one from a spec string with `parse_spec("topk:ratio=0.01")`, `parse_spec("ef+sign")`;
`COMPRESSORS` maps every name to its class. See each module for its exact wire format.
"""

from gossipcomp.compress.base import (
    Compressed,
    CompressionContext,
    Compressor,
    PayloadError,
)
from gossipcomp.compress.dense import BFloat16, Float16, Identity
from gossipcomp.compress.feedback import ErrorFeedback
from gossipcomp.compress.quantize import QSGD, TernGrad
from gossipcomp.compress.registry import COMPRESSORS, parameters, parse_spec
from gossipcomp.compress.segmented import Segmented, per_segment
from gossipcomp.compress.sign import OneBit, Sign
from gossipcomp.compress.sparse import DGC, RandomK, TopK

__all__ = [
    "COMPRESSORS",
    "DGC",
    "QSGD",
    "BFloat16",
    "CompressionContext",
    "Compressed",
    "Compressor",
    "ErrorFeedback",
    "Float16",
    "Identity",
    "OneBit",
    "PayloadError",
    "RandomK",
    "Segmented",
    "Sign",
    "TernGrad",
    "TopK",
    "parameters",
    "parse_spec",
    "per_segment",
]
