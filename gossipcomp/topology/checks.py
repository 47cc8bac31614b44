"""What a valid topology is: size limits, the error type, and the checks of a graph, its mixing
matrix and its addresses.

Shared by the Topology class (which runs every check on construction) and the spec reader
(which refuses oversized or malformed input before any graph is built), so a limit or a rule
is stated once. Every check is linear in the edges.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np
from scipy import sparse

from gossipcomp.inputs.text import quoted

MAX_PEERS = 16_384  # every size-dependent step of a topology stays within seconds up to here
MAX_EDGES = 1_000_000  # ~0.5 GB of networkx graph at most; a complete graph up to 1414 peers
MAX_DENSE_PEERS = 1024  # dense W, its full spectrum and explicit weights_matrix up to here
_TOL = 1e-9  # how far W may be from symmetric and stochastic (rounding)
_RANDOM_KINDS = ("random_regular", "erdos_renyi")  # disconnected: the hint is another seed


class TopologyError(ValueError):
    """A topology file or spec is invalid; the message names the source, the problem, the fix."""


def _fail(source: str, problem: str, expected: str | None = None) -> TopologyError:
    return TopologyError(f"{source}: {problem}" + (f"; expected {expected}" if expected else ""))


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


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
