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


def orthonormal_basis(vectors: torch.Tensor, eps: float = ORTHO_EPS) -> torch.Tensor:
    """The columns of `vectors` ([n, r]) orthonormalised in order, as Gram-Schmidt would give
    them (same signs; a zero or dependent column stays at zero, eps keeping it from dividing by
    zero), computed by one Householder QR: vectors = Q R, column c scaled by R_cc / (|R_cc| +
    eps). Both ends of an edge run it on bitwise equal vectors, so they get the same basis.
    One column needs no factorisation: it is v / (|v| + eps), at a third of a QR's cost."""
    if vectors.shape[-1] == 1:
        return vectors / (torch.linalg.vector_norm(vectors) + eps)
    q, r = torch.linalg.qr(vectors)
    diagonal = r.diagonal()
    return q * (diagonal / (diagonal.abs() + eps))
