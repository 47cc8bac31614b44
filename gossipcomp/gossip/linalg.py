"""Small linear-algebra helpers shared by gossip algorithms (pure tensor code)."""

from __future__ import annotations

import hashlib
import json

import torch

ORTHO_EPS = 1e-8


def hashed_seed(*parts: int | str) -> int:
    """A 63-bit seed from a tuple, hashed (never concatenated: (1, 123) and (11, 23) differ)."""
    blob = json.dumps(list(parts), separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") >> 1


def orthonormalize(vectors: torch.Tensor, eps: float = ORTHO_EPS) -> torch.Tensor:
    """Gram-Schmidt on the columns of `vectors` ([n, r]); returns a new [n, r] tensor.

    eps keeps a zero (or dependent) column at zero instead of dividing by zero; both ends of an
    edge run the same operations on the same numbers, so they get bitwise the same result.
    """
    out = vectors.clone()
    for c in range(out.shape[1]):
        column = out[:, c]
        for k in range(c):
            column -= (out[:, k] @ column) * out[:, k]
        column /= column.norm() + eps
    return out
