"""Topology specs: a mapping (a YAML file's, or keyword arguments) -> graph, W and addresses.

Reads every key of a spec as hostile input: sizes are checked against MAX_PEERS and MAX_EDGES
before any graph is built, and each error names the source, the key and what was expected.
Builds the graph of each kind and W (Metropolis-Hastings, uniform, or given explicitly), the
addresses and the public keys; Topology then checks the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from scipy import sparse

from gossipcomp.inputs.text import quoted
from gossipcomp.security.signing_keys import parse_public_key, read_allowlist
from gossipcomp.topology.checks import (
    MAX_DENSE_PEERS,
    MAX_PEERS,
    _check_address,
    _check_edge_count,
    _fail,
    _is_int,
)
from gossipcomp.topology.core import Topology
from gossipcomp.topology.members import LIVE_KINDS, LiveMembers
from gossipcomp.topology.rounds import (
    MAX_PERIOD,
    Pairs,
    RoundGraphs,
    base_k,
    one_peer_exponential,
    upper_pairs,
)

DEFAULT_BASE_PORT = 50100
_TOP_KEYS = tuple(
    "name kind n rows cols dim degree p seed edges k rounds weights weights_matrix base_port "
    "peers allowlist members".split()
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
    # time-varying (rounds.py): a graph per round
    "one-peer-exponential": (("n",), ()),
    "base-k": (("n", "k"), ()),
    "random-matching": (("n",), ("seed",)),
    "rounds": (("n", "rounds"), ()),
}
_TIME_VARYING = ("one-peer-exponential", "base-k", "random-matching", "rounds")
_PARAMS = {p for required, optional in _KINDS.values() for p in required + optional}
WEIGHT_SCHEMES = ("metropolis", "uniform", "explicit")


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


def _round_list(spec: Mapping[str, Any], n: int, scheme: object, source: str) -> list[Pairs]:
    """`rounds`: a list of rounds, each a non-empty list of [i, j] edges, weighted per round
    by `scheme` (metropolis or uniform)."""
    raw, expected = spec["rounds"], "a list of rounds, each a non-empty list of [i, j] pairs"
    if not isinstance(raw, list | tuple) or not raw:
        raise _fail(source, f"rounds is {quoted(raw)}", expected)
    if len(raw) > MAX_PERIOD:
        problem = f"rounds lists {len(raw)} rounds, over MAX_PERIOD ({MAX_PERIOD})"
        raise _fail(source, problem, f"at most {MAX_PERIOD} rounds in a period")
    if scheme not in ("metropolis", "uniform"):
        raise _fail(source, f"weights {quoted(scheme)} for kind 'rounds'", "metropolis or uniform")
    total = sum(len(r) if isinstance(r, list | tuple) else 0 for r in raw)
    _check_edge_count(total, f"rounds list {total} edges in all", source)
    rounds = []
    for t, edges in enumerate(raw):
        if not isinstance(edges, list | tuple) or not edges:
            raise _fail(source, f"round {t} is {quoted(edges)}", expected)
        graph = _edge_list({"edges": edges, "n": n}, f"{source} (round {t})")
        rounds.append(upper_pairs(_weights(graph, scheme, {}, source)))
    return rounds


def _round_graphs(kind: str, spec: Mapping[str, Any], source: str) -> RoundGraphs:
    """The per-round graphs of a time-varying kind (their weights are part of the kind, except
    for an explicit `rounds` list: metropolis or uniform per round)."""
    n = _int(spec, "n", source, kind, 2)
    if kind != "rounds" and "weights" in spec:
        problem = f"weights given for kind {kind!r}"
        raise _fail(source, problem, "no weights key: this kind's rounds carry their own weights")
    if kind == "random-matching":
        _check_edge_count(
            n * (n - 1) // 2, f"random matchings on {n} peers (complete union)", source
        )
        seed = _int(spec, "seed", source, kind, 0) if "seed" in spec else 0
        if seed >= 2**63:
            raise _fail(source, f"seed {seed} (too large)", f"an integer in 0..{2**63 - 1}")
        return RoundGraphs.random_matching(n, seed, source)
    if kind == "one-peer-exponential":
        if n & (n - 1):
            problem = f"one-peer-exponential on n={n} peers, not a power of two"
            raise _fail(source, problem, "n a power of two (any n: kind base-k with k: 1)")
        return RoundGraphs.periodic(n, one_peer_exponential(n), source)
    if kind == "base-k":
        k = _int(spec, "k", source, kind, 1)
        if k >= n:
            raise _fail(source, f"base-k with k={k} on {n} peers", f"k in 1..{n - 1}")
        return RoundGraphs.periodic(n, base_k(range(n), k), source)
    return RoundGraphs.periodic(
        n, _round_list(spec, n, spec.get("weights", "metropolis"), source), source
    )


@dataclass(frozen=True)
class _Family:
    """The graph family of a live topology, built over any number of positions (picklable,
    so a topology travels to simulate's worker processes)."""

    kind: str
    params: tuple[tuple[str, Any], ...]  # the kind's parameters other than n
    source: str

    def __call__(self, m: int) -> sparse.csr_array | RoundGraphs:
        spec = {**dict(self.params), "n": m}
        if self.kind == "base-k":
            spec["k"] = min(spec["k"], m - 1)  # fewer members than k + 1: one clique
        where = f"{self.source} (over {m} members)"
        if self.kind in _TIME_VARYING:
            return _round_graphs(self.kind, spec, where)
        graph = _build_graph(self.kind, spec, where)
        return sparse.csr_array(_weights(graph, "metropolis", {}, where))


def _live(kind: str, spec: Mapping[str, Any], source: str) -> LiveMembers:
    """The live membership `members:` asks for: the initial member ranks of a family that can
    be built over any number of them, within the capacity n."""
    raw = spec["members"]
    if kind not in LIVE_KINDS:
        problem = f"members given for kind {kind!r}"
        raise _fail(source, problem, f"a kind built over any member count: {list(LIVE_KINDS)}")
    if "weights" in spec and spec["weights"] != "metropolis":
        raise _fail(source, f"weights {quoted(spec['weights'])} with members", "metropolis")
    n = _int(spec, "n", source, kind, 2)
    _check_edge_count(n * (n - 1) // 2, f"live membership over {n} ranks (complete union)", source)
    expected = f"a non-empty list of distinct ranks in 0..{n - 1}"
    if not isinstance(raw, list | tuple) or not 1 <= len(raw) <= n:
        raise _fail(source, f"members is {quoted(raw)}", expected)
    if not all(_is_int(r) and 0 <= r < n for r in raw) or len(set(raw)) != len(raw):
        raise _fail(source, f"members {quoted(raw)}", expected)
    params = tuple(sorted((k, spec[k]) for k in ("k", "seed") if k in spec))
    return LiveMembers(kind, n, tuple(sorted(int(r) for r in raw)), _Family(kind, params, source))


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


def topology_from_dict(spec: Mapping[str, Any], source: str = "<dict>") -> Topology:
    """Build a Topology from a parsed spec. Keys: name, kind, kind parameters (n, rows, cols, dim,
    degree, p, seed, edges, k, rounds), members (live membership: the initial member ranks, n
    being the capacity; topology/members.py), weights (metropolis | uniform | explicit, with
    weights_matrix),
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
    live = _live(kind, spec, source) if "members" in spec else None
    rounds = _round_graphs(kind, spec, source) if kind in _TIME_VARYING and not live else None
    if live is not None:  # every pair may become neighbours: the complete graph, uniform W
        live.build(live.capacity)  # the family must build over the whole capacity
        graph = nx.complete_graph(live.capacity)
        w = _weights(graph, "uniform", {}, source)
    elif rounds is not None:  # the union graph, the mean W (validated by Topology.__post_init__)
        graph = nx.empty_graph(rounds.n)
        graph.add_edges_from(rounds.union_edges())
        w: sparse.csr_array | np.ndarray = rounds.mean()
    else:
        graph = _build_graph(kind, spec, source)  # validated with W by Topology.__post_init__
        w = _weights(graph, spec.get("weights", "metropolis"), spec, source)
    n = graph.number_of_nodes()
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
    return Topology(name, kind, graph, w, tuple(addresses), tuple(keys), source, rounds, live)


def build_topology(
    kind: str, *, name: str | None = None, weights: str | None = None, **params: Any
) -> Topology:
    """Programmatic form of a spec, e.g. ``build_topology("torus", rows=4, cols=4)``
    (weights: the file's default, metropolis, when not given; time-varying kinds other than
    `rounds` take none)."""
    spec: dict[str, Any] = {"kind": kind, **params}
    if weights is not None:
        spec["weights"] = weights
    if name is not None:
        spec["name"] = name
    return topology_from_dict(spec)
