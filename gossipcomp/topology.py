"""Topologies: YAML -> networkx graph -> mixing matrix W, validation and spectral quantities.

A topology fixes who talks to whom (an undirected connected graph on ranks 0..n-1), how much each
peer trusts each neighbour (a symmetric doubly-stochastic W supported on edges and the diagonal),
and where each rank listens ("host:port"). Every peer loads the same file, so everything derived
here is deterministic; ``Topology.hash`` lets peers check in the handshake that they agree.

W is sparse (memory linear in the edges: a peer needs only its own row), sizes are checked against
MAX_PEERS and MAX_EDGES before any graph is built, and the spectrum is computed only when asked:
exactly from the dense W up to MAX_DENSE_PEERS peers, by sparse methods above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from scipy import sparse
from scipy.linalg import eigvals_banded
from scipy.sparse.csgraph import reverse_cuthill_mckee
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

from gossipcomp.security.signing_keys import parse_public_key, read_allowlist
from gossipcomp.text import quoted
from gossipcomp.yaml_files import load_yaml_file

DEFAULT_BASE_PORT = 50100
MAX_PEERS = 16_384  # every size-dependent step below stays within seconds up to here
MAX_EDGES = 1_000_000  # ~0.5 GB of networkx graph at most; a complete graph up to 1414 peers
MAX_DENSE_PEERS = 1024  # dense W, its full spectrum and explicit weights_matrix up to here
_BANDED_WORK = 1e9  # n^2 * bandwidth: exact banded eigenvalues cost about this many flops
_LANCZOS_RESTARTS = 100  # implicit restarts of ARPACK (about 2300 products with W) at most
_HASH_TAG = b"gossipcomp topology v2\0"
_TOL = 1e-9
_TOP_KEYS = tuple(
    "name kind n rows cols dim degree p seed edges weights weights_matrix base_port peers "
    "allowlist".split()
)
# kind -> (required parameters, optional parameters)
_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "ring": (("n",), ()),
    "torus": (("rows", "cols"), ("n",)),
    "hypercube": ((), ("n", "dim")),
    "complete": (("n",), ()),
    "star": (("n",), ()),
    "exponential": (("n",), ()),
    "random_regular": (("n", "degree"), ("seed",)),
    "erdos_renyi": (("n", "p"), ("seed",)),
    "edges": (("edges",), ("n",)),
}
_PARAMS = {p for required, optional in _KINDS.values() for p in required + optional}
_RANDOM_KINDS = ("random_regular", "erdos_renyi")
WEIGHT_SCHEMES = ("metropolis", "uniform", "explicit")


class TopologyError(ValueError):
    """A topology file or spec is invalid; the message names the source, the problem, the fix."""


def _fail(source: str, problem: str, expected: str | None = None) -> TopologyError:
    return TopologyError(f"{source}: {problem}" + (f"; expected {expected}" if expected else ""))


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class Topology:
    """A validated topology. Construction checks every invariant, so holders can trust it."""

    name: str
    kind: str
    graph: nx.Graph  # nodes 0..n-1, undirected, connected, no self loops (frozen copy)
    mixing: sparse.csr_array = field(repr=False)  # W (n x n, CSR), arrays read-only
    addresses: tuple[str, ...]  # "host:port" per rank
    public_keys: tuple[str | None, ...] = field(repr=False)  # per rank, None if not given
    source: str = "<dict>"  # file path or "<dict>", used in error messages

    def __post_init__(self) -> None:
        n = self.graph.number_of_nodes()
        _check_graph(self.graph, self.source, self.kind)
        g = nx.Graph()  # canonical copy: nodes in rank order, frozen so the hash cannot go stale
        g.add_nodes_from(range(n))
        g.add_edges_from(sorted((min(e), max(e)) for e in self.graph.edges()))
        object.__setattr__(self, "graph", nx.freeze(g))
        object.__setattr__(self, "mixing", _checked_mixing(self.mixing, g, self.source))
        object.__setattr__(self, "addresses", _check_addresses(self.addresses, n, self.source))
        keys = tuple(self.public_keys)
        if len(keys) != n or any(k is not None and not isinstance(k, str) for k in keys):
            raise _fail(self.source, f"got {len(keys)} public_keys", f"{n}, each a str or None")
        listed: dict[str, int] = {}
        for rank, key in enumerate(keys):
            if key is not None and listed.setdefault(key, rank) != rank:
                problem = f"peers {listed[key]} and {rank} have the same public key {key}"
                raise _fail(self.source, problem, "one key per peer")
        object.__setattr__(self, "public_keys", keys)
        # W is symmetric, stochastic and connected, so 1 is a simple eigenvalue; -1 is one exactly
        # when the support of W (self weights as loops) is bipartite: decided without a spectrum
        if not self._diagonal.any() and nx.is_bipartite(g):
            problem = "W does not converge (bipartite graph and every self weight 0: eigenvalue -1)"
            raise _fail(self.source, problem, "a positive self weight on at least one peer")

    @property
    def n(self) -> int:
        """Number of peers."""
        return self.graph.number_of_nodes()

    def _rank(self, rank: int) -> int:
        if not _is_int(rank) or not 0 <= rank < self.n:
            raise _fail(self.source, f"rank {rank!r} out of range", f"an int in 0..{self.n - 1}")
        return int(rank)

    def neighbors(self, rank: int) -> list[int]:
        """Sorted neighbour ranks of ``rank`` (itself excluded)."""
        return sorted(self.graph.neighbors(self._rank(rank)))

    def neighbor_weights(self, rank: int) -> dict[int, float]:
        """{j: w_ij} over the neighbours j of ``rank``: what rank i applies to j's model (its row
        of W, read from the sparse matrix)."""
        i = self._rank(rank)
        start, stop = self.mixing.indptr[i], self.mixing.indptr[i + 1]
        columns = self.mixing.indices[start:stop].tolist()
        values = self.mixing.data[start:stop].tolist()
        return {j: w for j, w in zip(columns, values, strict=True) if j != i}

    def self_weight(self, rank: int) -> float:
        """w_ii: the weight a peer keeps on its own model."""
        return float(self._diagonal[self._rank(rank)])

    def edges(self) -> list[tuple[int, int]]:
        """All edges as sorted (i, j) pairs with i < j."""
        return sorted((min(e), max(e)) for e in self.graph.edges())

    @cached_property
    def _diagonal(self) -> np.ndarray:
        diagonal = self.mixing.diagonal()
        diagonal.flags.writeable = False
        return diagonal

    @cached_property
    def weights(self) -> np.ndarray:
        """W as a dense read-only (n, n) array, for topologies of at most MAX_DENSE_PEERS peers
        (larger ones: ``mixing``, or a peer's row through ``neighbor_weights``)."""
        self._dense_only("the dense mixing matrix (weights)")
        w = self.mixing.toarray()
        w.flags.writeable = False
        return w

    @cached_property
    def eigenvalues(self) -> np.ndarray:
        """Eigenvalues of W (real, since W is symmetric), largest first; the first is 1. Only up
        to MAX_DENSE_PEERS peers: larger topologies give their extremes through the properties
        below."""
        self._dense_only("the full spectrum (eigenvalues)")
        return np.linalg.eigvalsh(self.weights)[::-1].copy()

    @cached_property
    def _extreme_eigenvalues(self) -> tuple[float, float]:
        """(lambda_2, lambda_min), computed on first use: exactly (dense) up to MAX_DENSE_PEERS
        peers, else by the sparse methods of ``_sparse_extremes``."""
        if self.n <= MAX_DENSE_PEERS:
            ev = self.eigenvalues
            return float(ev[1]), float(ev[-1])
        return _sparse_extremes(self.mixing, self.source)

    @property
    def second_largest_eigenvalue_modulus(self) -> float:
        """max(|lambda_2|, |lambda_n|): exact gossip shrinks disagreement by this per round."""
        second, smallest = self._extreme_eigenvalues
        return max(abs(second), abs(smallest))

    @property
    def spectral_gap(self) -> float:
        """1 - SLEM; larger means faster consensus."""
        return 1.0 - self.second_largest_eigenvalue_modulus

    @property
    def optimal_consensus_step(self) -> float:
        """gamma* = 2 / (2 - lambda_2 - lambda_min): the step of x <- x + gamma (W x - x) that
        minimises the spectral radius on the disagreement subspace (1.308 on an 8-ring)."""
        second, smallest = self._extreme_eigenvalues
        return 2.0 / (2.0 - second - smallest)

    @cached_property
    def hash(self) -> str:
        """sha256 hex over n, the sorted edges, their weights and the self weights (weights as
        integers of 1e-12, so rounding noise below that does not matter), all little-endian
        int64: linear in the edges, identical in every process. Addresses are left out so a
        topology whose ports were rebound still matches."""
        upper = sparse.triu(self.mixing, k=1, format="coo")  # exactly the edges, since W is valid
        order = np.lexsort((upper.col, upper.row))
        digest = hashlib.sha256(_HASH_TAG)
        for part in (
            np.array([self.n, len(order)]),
            upper.row[order],
            upper.col[order],
            np.rint(upper.data[order] * 1e12),
            np.rint(self._diagonal * 1e12),
        ):
            digest.update(np.ascontiguousarray(part, dtype="<i8").tobytes())
        return digest.hexdigest()

    def _dense_only(self, what: str) -> None:
        if self.n > MAX_DENSE_PEERS:
            raise _fail(
                self.source,
                f"{what} is not built for {self.n} peers (over MAX_DENSE_PEERS, {MAX_DENSE_PEERS})",
                "neighbor_weights / self_weight, the sparse `mixing`, or the spectral properties",
            )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle through the constructor, so a copy is re-validated and W stays read-only."""
        fields = (self.name, self.kind, self.graph, self.mixing, self.addresses)
        return (Topology, (*fields, self.public_keys, self.source))

    def with_addresses(self, addresses: Sequence[str]) -> Topology:
        """A copy listening on ``addresses`` (one "host:port" per rank, validated)."""
        return dataclasses.replace(self, addresses=tuple(addresses))


def _check_graph(graph: nx.Graph, source: str, kind: str) -> None:
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise _fail(source, f"graph is a {type(graph).__name__}", "an undirected simple nx.Graph")
    n, m = graph.number_of_nodes(), graph.number_of_edges()
    if not 2 <= n <= MAX_PEERS:
        raise _fail(source, f"topology has {n} peer(s)", f"2..{MAX_PEERS} (MAX_PEERS)")
    _check_edge_count(m, f"the graph has {m} edges", source)
    if set(graph.nodes()) != set(range(n)):
        raise _fail(source, "graph nodes are not the ranks", f"ints 0..{n - 1}")
    for u, v in graph.edges():
        if u == v:
            raise _fail(source, f"self-loop on node {u}", "edges between distinct peers")
    components = nx.number_connected_components(graph)
    if components > 1:
        hint = " (try another seed or a larger degree / p)" if kind in _RANDOM_KINDS else ""
        problem = f"graph is disconnected ({components} components)"
        raise _fail(source, problem, "a connected graph" + hint)


def _checked_mixing(w: object, graph: nx.Graph, source: str) -> sparse.csr_array:
    """W as a canonical CSR matrix (float64, sorted, no stored zeros, arrays read-only), after
    checking it is a valid mixing matrix for `graph`; every check is linear in the edges."""
    n = graph.number_of_nodes()
    shape = getattr(w, "shape", None)
    if shape != (n, n):
        raise _fail(source, f"weights_matrix has shape {shape}", f"({n}, {n}) for {n} peers")
    w = sparse.csr_array(w, dtype=np.float64, copy=True)
    w.sum_duplicates()
    if not np.all(np.isfinite(w.data)):
        raise _fail(source, "weights_matrix has NaN or infinite entries", "finite numbers")
    w.eliminate_zeros()
    w.sort_indices()
    coo = w.tocoo()  # row-major, so the first entry reported is the first a reader would see
    negative = np.flatnonzero(coo.data < 0)
    if len(negative):
        k = negative[0]
        i, j = int(coo.row[k]), int(coo.col[k])
        raise _fail(source, f"negative weight {coo.data[k]:.6g} at ({i}, {j})", "entries >= 0")
    off = coo.row != coo.col
    given = coo.row[off].astype(np.int64) * n + coo.col[off]
    edges = np.array(graph.edges(), dtype=np.int64).reshape(-1, 2)
    wanted = np.sort(np.concatenate([edges[:, 0] * n + edges[:, 1], edges[:, 1] * n + edges[:, 0]]))
    stray = np.flatnonzero(~np.isin(given, wanted, assume_unique=True))
    if len(stray):
        i, j = divmod(int(given[stray[0]]), n)
        problem = f"weight {w[i, j]:.6g} on non-edge ({i}, {j})"
        raise _fail(source, problem, "zero off the edges and diagonal")
    if len(given) != len(wanted):
        missing = np.sort(wanted[~np.isin(wanted, given, assume_unique=True)])
        i, j = sorted(divmod(int(missing[0]), n))
        raise _fail(source, f"zero weight on edge ({i}, {j})", "a positive weight per edge")
    asymmetric = (w - w.T).tocsr()
    asymmetric.sort_indices()
    diff = asymmetric.tocoo()
    far = np.flatnonzero(np.abs(diff.data) > _TOL)
    if len(far):
        i, j = int(diff.row[far[0]]), int(diff.col[far[0]])
        problem = f"W is not symmetric: w[{i},{j}]={w[i, j]:.12g}, w[{j},{i}]={w[j, i]:.12g}"
        raise _fail(source, problem, "w_ij == w_ji")
    sums = w.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > _TOL)
    if len(bad):
        problem = f"W is not doubly stochastic: row {bad[0]} sums to {sums[bad[0]]:.12g}"
        raise _fail(source, problem, "every row and column to sum to 1")
    for array in (w.data, w.indices, w.indptr):
        array.flags.writeable = False
    return w


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


def _check_edge_count(count: float, what: str, source: str) -> None:
    """Refuse a graph of more than MAX_EDGES edges, before it is built when the count is known."""
    if count > MAX_EDGES:
        problem = f"{what}, over the limit of {MAX_EDGES} (MAX_EDGES)"
        raise _fail(source, problem, f"at most {MAX_EDGES} edges")


def _check_address(addr: object, what: str, source: str) -> str:
    expected = '"host:port" with port 1..65535 (IPv6 as "[::1]:50100")'
    if not isinstance(addr, str):
        raise _fail(source, f"{what} address {quoted(addr)} is not a string", expected)
    host, sep, port = addr.rpartition(":")
    ipv6_ok = ":" not in host or (host.startswith("[") and host.endswith("]"))
    host_ok = bool(host) and ipv6_ok and not any(c.isspace() for c in host)
    if not sep or not host_ok or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _fail(source, f"{what} address {quoted(addr)} is not host:port", expected)
    return addr


def _check_addresses(addresses: Sequence[str], n: int, source: str) -> tuple[str, ...]:
    addrs = (addresses,) if isinstance(addresses, str) else tuple(addresses)
    if len(addrs) != n:
        raise _fail(source, f"got {len(addrs)} addresses", f"one per rank ({n})")
    seen: dict[str, int] = {}
    for r, a in enumerate(addrs):
        _check_address(a, f"rank {r}", source)
        if a in seen:
            problem = f"duplicate address {quoted(a)} for ranks {seen[a]} and {r}"
            raise _fail(source, problem, "a distinct address per rank")
        seen[a] = r
    return addrs


def _int(spec: Mapping[str, Any], key: str, source: str, kind: str, low: int) -> int:
    v, high = spec[key], {"seed": 2**63, "dim": MAX_PEERS.bit_length() - 1}.get(key, MAX_PEERS)
    if not _is_int(v) or not low <= v <= high:
        size = "" if not _is_int(v) else " (too small)" if v < low else " (too large)"
        raise _fail(
            source, f"{kind} parameter {key!r} is {quoted(v)}{size}", f"an integer in {low}..{high}"
        )
    return int(v)


def _edge_list(spec: Mapping[str, Any], source: str) -> nx.Graph:
    raw = spec["edges"]
    n = _int(spec, "n", source, "edges", 2) if "n" in spec else None
    if not isinstance(raw, list | tuple) or not raw:
        raise _fail(source, f"edges is {quoted(raw)}", "a non-empty list of [i, j] pairs")
    _check_edge_count(len(raw), f"edges lists {len(raw)} edges", source)
    pairs: list[tuple[int, int]] = []
    for e in raw:
        if not (isinstance(e, list | tuple) and len(e) == 2 and all(map(_is_int, e))):
            problem = f"edge {quoted(e)} is malformed"
            raise _fail(source, problem, "a pair of integer peer ids [i, j]")
        i, j = e
        if i == j:
            raise _fail(source, f"self-loop on node {i}", "edges between distinct peers")
        if min(i, j) < 0 or max(i, j) >= (n or MAX_PEERS):
            ids = f"ids in 0..{(n or MAX_PEERS) - 1}"
            raise _fail(source, f"edge {[i, j]} refers to a peer out of range", ids)
        pairs.append((i, j))
    g = nx.empty_graph(n if n is not None else max(max(p) for p in pairs) + 1)
    g.add_edges_from(pairs)
    return g


def _exponential(n: int) -> nx.Graph:
    """i linked to i +- 2^k (mod n) for every 2^k < n: log-degree with a fast-mixing spectrum."""
    g = nx.empty_graph(n)
    hops = [2**k for k in range(n.bit_length()) if 2**k < n]
    g.add_edges_from((i, (i + s) % n) for i in range(n) for s in hops if (i + s) % n != i)
    return g


def _build_graph(kind: str, spec: Mapping[str, Any], source: str) -> nx.Graph:
    def num(key: str, low: int = 2) -> int:
        return _int(spec, key, source, kind, low)

    if kind == "edges":
        return _edge_list(spec, source)
    seed = num("seed", 0) if "seed" in spec else 0
    if kind == "torus":
        rows, cols = num("rows", 1), num("cols", 1)
        if not 2 <= rows * cols <= MAX_PEERS or ("n" in spec and num("n") != rows * cols):
            but = f" but n={spec['n']}" if "n" in spec else ""
            problem = f"torus {rows}x{cols} has {rows * cols} peers{but}"
            raise _fail(source, problem, f"n == rows * cols in 2..{MAX_PEERS}")
        grid = nx.grid_2d_graph(rows, cols, periodic=True)
        return nx.relabel_nodes(grid, {(r, c): r * cols + c for r, c in grid.nodes()})
    if kind == "hypercube":
        if "n" not in spec and "dim" not in spec:
            raise _fail(source, "missing parameter 'n' or 'dim' for kind 'hypercube'", "n or dim")
        dim = num("dim", 1) if "dim" in spec else num("n").bit_length() - 1
        if "n" in spec and num("n") != 2**dim:
            problem = f"hypercube n={spec['n']} is not a power of two (or 2**dim, dim={dim})"
            raise _fail(source, problem, "n = 2**dim")
        cube = nx.hypercube_graph(dim)
        return nx.relabel_nodes(cube, {t: int("".join(map(str, t)), 2) for t in cube.nodes()})
    if kind == "random_regular":
        n, degree = num("n"), num("degree", 1)
        if degree >= n or (n * degree) % 2:
            raise _fail(
                source, f"no {degree}-regular graph on {n} peers", "degree < n, n*degree even"
            )
        _check_edge_count(n * degree // 2, f"a {degree}-regular graph on {n} peers", source)
        return nx.random_regular_graph(degree, n, seed=seed)
    if kind == "erdos_renyi":
        p, n = spec["p"], num("n")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            problem = f"erdos_renyi parameter 'p' is {quoted(p)}"
            raise _fail(source, problem, "a probability in (0, 1]")
        expected = p * n * (n - 1) / 2
        _check_edge_count(
            expected, f"erdos_renyi on {n} peers expects {expected:.0f} edges", source
        )
        return nx.fast_gnp_random_graph(n, float(p), seed=seed)  # O(n + edges), not O(n^2)
    n = num("n")
    if kind == "complete":
        _check_edge_count(n * (n - 1) // 2, f"a complete graph on {n} peers", source)
    builders: dict[str, Callable[[int], nx.Graph]] = {
        "ring": lambda n: nx.path_graph(2) if n == 2 else nx.cycle_graph(n),
        "complete": nx.complete_graph,
        "star": lambda n: nx.star_graph(n - 1),  # centre 0
        "exponential": _exponential,
    }
    return builders[kind](n)


def _weights(
    graph: nx.Graph, scheme: object, spec: Mapping[str, Any], source: str
) -> sparse.csr_array | np.ndarray:
    """W for `scheme`: Metropolis-Hastings (w_ij = 1 / (1 + max(d_i, d_j))) or uniform
    (1 / (1 + max degree)) as a sparse matrix built from the edges, or the explicit dense
    weights_matrix (at most MAX_DENSE_PEERS peers); Topology checks it."""
    n = graph.number_of_nodes()
    if scheme == "explicit":
        expected = f"weights_matrix: {n} x {n} list of lists of numbers"
        if "weights_matrix" not in spec:
            raise _fail(source, "weights: explicit without weights_matrix", expected)
        if n > MAX_DENSE_PEERS:
            problem = f"weights: explicit on {n} peers (over MAX_DENSE_PEERS, {MAX_DENSE_PEERS})"
            raise _fail(source, problem, "weights: metropolis or uniform for larger topologies")
        try:
            return np.array(spec["weights_matrix"], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            problem = f"weights_matrix is not numeric ({quoted(str(exc))})"
            raise _fail(source, problem, expected) from None
    if "weights_matrix" in spec:
        raise _fail(source, f"weights_matrix given with weights: {scheme}", "weights: explicit")
    if scheme not in WEIGHT_SCHEMES:
        expected = f"one of {list(WEIGHT_SCHEMES)}"
        raise _fail(source, f"unknown weights scheme {quoted(scheme)}", expected)
    edges = np.array(graph.edges(), dtype=np.int64).reshape(-1, 2)
    degree = np.bincount(edges.ravel(), minlength=n)
    if scheme == "metropolis":
        w = 1.0 / (1.0 + np.maximum(degree[edges[:, 0]], degree[edges[:, 1]]))
    else:
        w = np.full(len(edges), 1.0 / (1.0 + degree.max()))
    rows, cols = (
        np.concatenate([edges[:, 0], edges[:, 1]]),
        np.concatenate([edges[:, 1], edges[:, 0]]),
    )
    off = sparse.csr_array((np.concatenate([w, w]), (rows, cols)), shape=(n, n))
    return off + sparse.diags_array(1.0 - off.sum(axis=1), format="csr")


def _peers(raw: object, n: int, base_port: int, source: str) -> tuple[list[str], list[str | None]]:
    addresses = [f"127.0.0.1:{base_port + r}" for r in range(n)]
    keys: list[str | None] = [None] * n
    if raw is None:
        return addresses, keys
    if not isinstance(raw, Mapping):
        raise _fail(source, f"peers is {type(raw).__name__}", "a mapping rank -> address")
    for r_raw, value in raw.items():
        r = int(r_raw) if isinstance(r_raw, str) and r_raw.isdigit() else r_raw
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            problem = f"peers has rank {quoted(r_raw)} out of range"
            raise _fail(source, problem, f"ranks 0..{n - 1}")
        if isinstance(value, Mapping):
            extra = set(value) - {"address", "public_key"}
            if "address" not in value or extra:
                problem = f"peer {r} entry has keys {quoted(sorted(map(str, value)))}"
                raise _fail(source, problem, "address (required) and public_key (optional)")
            key = value.get("public_key")
            if key is not None:
                try:
                    parse_public_key(key, f"peer {r}")
                except ValueError as error:
                    raise _fail(source, str(error)) from None
            value, keys[r] = value["address"], key
        addresses[r] = _check_address(value, f"peer {r}", source)
    return addresses, keys


def _allowlisted(raw: object, keys: list[str | None], source: str) -> list[str | None]:
    """Merge the allowlist file `raw` names (relative to the topology file's folder) into the
    per-rank public keys; a rank given in both places must have the same key in both."""
    if raw is None:
        return keys
    if not isinstance(raw, str) or not raw:
        expected = "a path to a YAML file of rank -> public key"
        raise _fail(source, f"allowlist is {quoted(raw)}", expected)
    folder = Path(source).parent if source != "<dict>" else Path.cwd()
    try:
        listed = read_allowlist(folder / raw)
    except (FileNotFoundError, ValueError) as error:
        raise _fail(source, str(error)) from None
    merged = list(keys)
    for rank, key in listed.items():
        if rank >= len(merged):
            raise _fail(source, f"allowlist has rank {rank}", f"ranks 0..{len(merged) - 1}")
        if merged[rank] not in (None, key):
            problem = f"peer {rank} has public_key {merged[rank]} but the allowlist says {key}"
            raise _fail(source, problem, "one key per peer")
        merged[rank] = key
    return merged


def shipped_topologies() -> list[str]:
    """The names of the topologies that ship inside the package (gossipcomp/topologies)."""
    folder = resources.files("gossipcomp.topologies")
    return sorted(
        f.name.removesuffix(".yaml") for f in folder.iterdir() if f.name.endswith(".yaml")
    )


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read and validate a topology: a YAML file (schema: see ``topology_from_dict``) or, when
    no file has that name, a shipped topology by name ('ring4', 'torus16': shipped_topologies()),
    as the command line takes them. Files go through the hardened reader of
    gossipcomp.yaml_files: no aliases, bounded size, depth and node count."""
    source = os.fspath(path)
    if not os.path.lexists(source):
        names = shipped_topologies()
        if source not in names:
            problem = "no such file, and not a shipped topology"
            raise TopologyError(
                f"topology file {source}: {problem}; expected a file or one of {names}"
            )
        shipped = resources.files("gossipcomp.topologies").joinpath(f"{source}.yaml")
        with resources.as_file(shipped) as shipped_path:
            return load_topology(shipped_path)
    try:
        spec = load_yaml_file(source, "topology file", "a YAML mapping of topology keys")
    except (FileNotFoundError, ValueError) as error:
        raise TopologyError(str(error)) from None
    if not isinstance(spec, Mapping):
        problem = f"top level is {type(spec).__name__}, not a mapping"
        raise _fail(source, problem, f"a mapping with keys from {list(_TOP_KEYS)}")
    return topology_from_dict(spec, source=source)


def topology_from_dict(spec: Mapping[str, Any], source: str = "<dict>") -> Topology:
    """Build a Topology from a parsed spec. Keys: name, kind, kind parameters (n, rows, cols, dim,
    degree, p, seed, edges), weights (metropolis | uniform | explicit, with weights_matrix),
    base_port (default 50100: rank r at 127.0.0.1:base_port+r), peers (rank -> "host:port"
    or {address, public_key}) and allowlist (a YAML file of rank -> public key, relative to the
    topology file)."""
    if not isinstance(spec, Mapping):
        raise _fail(source, f"spec is {type(spec).__name__}, not a mapping", "a mapping")
    unknown = [str(k) for k in spec if k not in _TOP_KEYS]
    if unknown:
        raise _fail(source, f"unknown key(s) {quoted(unknown)}", f"keys from {list(_TOP_KEYS)}")
    if "kind" not in spec:
        raise _fail(source, "missing parameter 'kind'", f"one of {list(_KINDS)}")
    kind = spec["kind"]
    if not isinstance(kind, str) or kind not in _KINDS:
        raise _fail(source, f"unknown kind {quoted(kind)}", f"one of {list(_KINDS)}")
    required, optional = _KINDS[kind]
    takes = f"kind {kind!r} takes {list(required + optional)}"
    for key in required:
        if key not in spec:
            raise _fail(source, f"missing parameter {key!r} for kind {kind!r}", takes)
    stray = sorted(k for k in spec if k in _PARAMS and k not in required + optional)
    if stray:
        raise _fail(source, f"parameter(s) {stray} do not apply to kind {kind!r}", takes)
    graph = _build_graph(kind, spec, source)  # validated with W by Topology.__post_init__
    n = graph.number_of_nodes()
    w = _weights(graph, spec.get("weights", "metropolis"), spec, source)
    base_port = spec.get("base_port", DEFAULT_BASE_PORT)
    if not _is_int(base_port) or not 1 <= base_port <= 65536 - n:
        raise _fail(source, f"base_port is {quoted(base_port)}", f"an integer in 1..{65536 - n}")
    addresses, keys = _peers(spec.get("peers"), n, base_port, source)
    keys = _allowlisted(spec.get("allowlist"), keys, source)
    name = spec.get("name")
    if name is None:
        name = Path(source).stem if source != "<dict>" else f"{kind}{n}"
    if not isinstance(name, str) or not name:
        raise _fail(source, f"name is {quoted(name)}", "a non-empty string")
    return Topology(name, kind, graph, w, tuple(addresses), tuple(keys), source)


def build_topology(
    kind: str, *, name: str | None = None, weights: str = "metropolis", **params: Any
) -> Topology:
    """Programmatic form of a spec, e.g. ``build_topology("torus", rows=4, cols=4)``."""
    spec = {"kind": kind, "weights": weights, **params}
    if name is not None:
        spec["name"] = name
    return topology_from_dict(spec)
