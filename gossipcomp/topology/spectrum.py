"""The two extreme eigenvalues of a large sparse mixing matrix, without a dense matrix.

Used by Topology above MAX_DENSE_PEERS peers (smaller ones take the exact dense spectrum): the
gossip step 'auto' and the spectral gap need lambda_2 and lambda_min only, and every peer must
derive the same values, so the methods here are deterministic.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse
from scipy.linalg import eigvals_banded
from scipy.sparse.csgraph import reverse_cuthill_mckee
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

from gossipcomp.topology.checks import _fail

_BANDED_WORK = 1e9  # n^2 * bandwidth: exact banded eigenvalues cost about this many flops
_LANCZOS_RESTARTS = 100  # implicit restarts of ARPACK (about 2300 products with W) at most


def _sparse_extremes(w: sparse.csr_array, source: str) -> tuple[float, float]:
    """(lambda_2, lambda_min) of a large sparse W, without a dense matrix.

    A graph of small bandwidth (rings, paths, thin tori: the ones whose lambda_2 sits in a tight
    cluster below 1) is reordered by reverse Cuthill-McKee and its two eigenvalues taken exactly
    from the banded matrix (LAPACK ?sbevx, about n^2 * bandwidth flops). Any other is solved by
    Lanczos (ARPACK eigsh) on W with the known eigenvector 1 moved to eigenvalue -1, so the
    largest left is lambda_2: such graphs mix fast and converge in tens of products with W.
    Eigenvalues are then within 1e-8 (the residual bound), and the start vector is fixed, so
    every peer derives the same step.
    """
    n = w.shape[0]
    order = reverse_cuthill_mckee(w, symmetric_mode=True)
    banded = w[order][:, order].tocoo()
    bandwidth = int(np.abs(banded.row - banded.col).max())
    if n * n * bandwidth <= _BANDED_WORK:
        band = np.zeros((bandwidth + 1, n))
        lower = banded.row >= banded.col
        band[(banded.row - banded.col)[lower], banded.col[lower]] = banded.data[lower]
        (smallest,) = eigvals_banded(band, lower=True, select="i", select_range=(0, 0))
        second, _ = eigvals_banded(band, lower=True, select="i", select_range=(n - 2, n - 1))
        return float(second), float(smallest)
    ones = np.full(n, 1.0 / np.sqrt(n))
    deflated = LinearOperator(
        (n, n), matvec=lambda x: w @ x - 2.0 * ones * (ones @ x), dtype=np.float64
    )
    start = np.random.default_rng(0).standard_normal(n)
    settings = {"k": 1, "ncv": 24, "tol": 1e-8, "maxiter": _LANCZOS_RESTARTS, "v0": start}
    try:
        (second,) = eigsh(deflated, which="LA", return_eigenvectors=False, **settings)
        (smallest,) = eigsh(w, which="SA", return_eigenvectors=False, **settings)
    except ArpackNoConvergence:
        problem = (
            f"the spectrum of W ({n} peers, bandwidth {bandwidth}) did not converge in "
            f"{_LANCZOS_RESTARTS} Lanczos restarts"
        )
        raise _fail(source, problem, "a gossip step given explicitly instead of 'auto'") from None
    return float(second), float(smallest)
