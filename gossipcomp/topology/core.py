"""The Topology class: a validated graph, mixing matrix W, addresses and public keys, with the
quantities peers derive from them (neighbour weights, spectrum, gossip step, hash).

A topology fixes who talks to whom (an undirected connected graph on ranks 0..n-1), how much each
peer trusts each neighbour (a symmetric doubly-stochastic W supported on edges and the diagonal),
and where each rank listens ("host:port"). Every peer loads the same file, so everything derived
here is deterministic; ``Topology.hash`` lets peers check in the handshake that they agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx
import numpy as np
from scipy import sparse

from gossipcomp.topology.checks import (
    MAX_DENSE_PEERS,
    _check_addresses,
    _check_graph,
    _checked_mixing,
    _fail,
    _is_int,
)
from gossipcomp.topology.members import LiveMembers
from gossipcomp.topology.rounds import RoundGraphs
from gossipcomp.topology.spectrum import _sparse_extremes

_HASH_TAG = b"gossipcomp topology v2\0"


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
    # time-varying topologies: W of every round (then `graph` is their union and `mixing` their
    # mean); None: `mixing` every round
    rounds: RoundGraphs | None = field(default=None, repr=False)
    # live membership (members.py): the family over the members in force (then `graph` is the
    # complete graph on the capacity n and `mixing` its uniform W); None: a fixed membership
    live: LiveMembers | None = field(default=None, repr=False)

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
        if self.rounds is not None:
            union = sorted(self.rounds.union_edges())
            if self.rounds.n != n or union != self.edges():
                problem = "the per-round graphs' union is not the topology's graph"
                raise _fail(self.source, problem, "the union of the rounds' edges as graph")
        if self.live is not None and (self.live.capacity != n or self.rounds is not None):
            problem = f"live membership over capacity {self.live.capacity}"
            raise _fail(self.source, problem, f"the capacity n={n} and no per-round graphs")
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

    @property
    def time_varying(self) -> bool:
        """Whether the graph changes from round to round (`round_weights`)."""
        return self.rounds is not None

    @property
    def period(self) -> int | None:
        """Rounds after which the per-round graphs repeat: 1 for a static topology, None for
        random matchings (which never repeat)."""
        return 1 if self.rounds is None else self.rounds.period

    def member_weights(self, rank: int, round: int, members: Sequence[int]) -> dict[int, float]:
        """{j: w_ij} of `rank` at `round` on a live topology whose members are `members` (a
        schedule's list; empty: the initial members): the family over them; {} when `rank`
        is not a member. A fixed topology: `round_weights`' row (members must be empty)."""
        i = self._rank(rank)
        if self.live is None:
            if members:
                raise _fail(self.source, "members named", "none: this topology's are fixed")
            return self.round_weights(i, round)[0]
        if not _is_int(round) or round < 0:
            raise _fail(self.source, f"round {round!r}", "an int >= 0")
        return self.live.row(i, int(round), members)

    def round_weights(self, rank: int, round: int) -> tuple[dict[int, float], float]:
        """({j: w_ij}, w_ii) of round `round` for `rank`: the neighbours it mixes with that
        round (a subset of `neighbors`) and its self weight. A static topology gives
        `neighbor_weights` and `self_weight` every round; every peer derives the same."""
        i = self._rank(rank)
        if not _is_int(round) or round < 0:
            raise _fail(self.source, f"round {round!r}", "an int >= 0")
        if self.rounds is None:
            return self.neighbor_weights(i), self.self_weight(i)
        row = self.rounds.row(i, int(round))
        return row, 1.0 - sum(row.values())

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
    def smallest_eigenvalue(self) -> float:
        """lambda_min of W (-1 < lambda_min < 1 on a connected graph with self weights): how
        far averaging overshoots, which bounds what may be fed back on it (outer/drift.py)."""
        return self._extreme_eigenvalues[1]

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
        minimises the spectral radius on the disagreement subspace (1.308 on an 8-ring). A
        time-varying topology's is 1: its rounds are built to average with their own weights
        (exactly over a period for one-peer exponential and base-k graphs), which the mean W's
        spectrum does not describe."""
        if self.rounds is not None or self.live is not None:
            return 1.0
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
        if self.rounds is not None:  # static topologies keep the hash they always had
            digest.update(b"rounds\0")
            for part in self.rounds.hash_parts():
                digest.update(np.ascontiguousarray(part, dtype="<i8").tobytes())
        if self.live is not None:
            digest.update(b"members\0")
            for part in self.live.hash_parts():
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
        return (Topology, (*fields, self.public_keys, self.source, self.rounds, self.live))

    def with_addresses(self, addresses: Sequence[str]) -> Topology:
        """A copy listening on ``addresses`` (one "host:port" per rank, validated)."""
        return dataclasses.replace(self, addresses=tuple(addresses))
