"""Time-varying topologies: the mixing matrix W_t of every round t, derived alike by every peer.

A time-varying topology gives each round its own sparse graph and weights; the Topology holds
their union graph (what peers handshake on and keep per-edge state for) and the mean of the
W_t as its static `mixing`. Four families:

- one-peer exponential (Ying et al. 2021): round t pairs i with i XOR 2^(t mod log2 n), weight
  1/2; n must be a power of two, and then any log2 n consecutive rounds average exactly (the
  rounds of a hypercube, one dimension at a time);
- base-k: at most k neighbours a round, exact average after one period for any n. A recursive
  construction of this package (not the graphs of Takezawa et al. 2023, which have the same
  guarantee): split the peers into d equal parts (the largest d <= k + 1 dividing their count),
  average each part, then each d peers of equal index form a clique of weight 1/d. A count with
  no such divisor is split into a power of two p >= s/2 and the s - p others; both are averaged,
  each of the others is paired with one of the p with weight p/s (the others then hold the
  average, the p peers hold it as their mean), and the p peers are averaged once more;
- random matching (NoLoCo's gossip partner): every round a uniformly random matching, from the
  seed and the round through SHA-256 (the same in every process and library version), weight
  1/2; with n odd one peer a round keeps its model. No period; the union is the complete graph;
- an explicit list of per-round graphs (edges per round), weighted per round by Metropolis or
  uniform weights, repeated with its length as period.

Each W_t is symmetric and doubly stochastic (checked by checks._checked_mixing on its own
graph), so the network average is kept every round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx
import numpy as np
from scipy import sparse

from gossipcomp.topology.checks import MAX_DENSE_PEERS, _checked_mixing, _fail

MAX_PERIOD = 4096  # rounds of one period at most: memory is period * n diagonals plus the edges
RANDOM_MATCHING = "random-matching"
_MATCHING_TAG = b"gossipcomp random matching v1\0"

Pairs = dict[tuple[int, int], float]  # (i, j) with i < j -> w_ij of one round


def _matrix(n: int, pairs: Pairs) -> sparse.csr_array:
    """The symmetric doubly stochastic W of one round: w_ij on each pair, the rest on the
    diagonal."""
    rows = np.array([i for i, _ in pairs] + [j for _, j in pairs], dtype=np.int64)
    cols = np.array([j for _, j in pairs] + [i for i, _ in pairs], dtype=np.int64)
    values = np.array(list(pairs.values()) * 2, dtype=np.float64)
    off = sparse.csr_array((values, (rows, cols)), shape=(n, n))
    return off + sparse.diags_array(1.0 - off.sum(axis=1), format="csr")


def upper_pairs(w: sparse.csr_array | sparse.coo_array) -> Pairs:
    """{(i, j): w_ij} over the entries of W above the diagonal."""
    upper = sparse.triu(w, k=1, format="coo")
    rows, cols = upper.row.tolist(), upper.col.tolist()
    return dict(zip(zip(rows, cols, strict=True), upper.data.tolist(), strict=True))


def one_peer_exponential(n: int) -> list[Pairs]:
    """log2 n rounds; round t pairs i with i XOR 2^t (distance 2^t), weight 1/2."""
    return [
        {(i, i ^ (1 << t)): 0.5 for i in range(n) if i < i ^ (1 << t)}
        for t in range(n.bit_length() - 1)
    ]


def _in_parallel(schedules: Sequence[list[Pairs]]) -> list[Pairs]:
    """Schedules on disjoint peers run side by side, round by round."""
    length = max((len(s) for s in schedules), default=0)
    merged: list[Pairs] = [{} for _ in range(length)]
    for schedule in schedules:
        for t, pairs in enumerate(schedule):
            merged[t].update(pairs)
    return merged


def base_k(nodes: Sequence[int], k: int) -> list[Pairs]:
    """Rounds after which every peer of `nodes` holds their average, at most k neighbours a
    round (the construction of the module docstring)."""
    s = len(nodes)
    if s == 1:
        return []
    d = max((d for d in range(2, k + 2) if s % d == 0), default=0)
    if d:
        size = s // d
        parts = [list(nodes[p * size : (p + 1) * size]) for p in range(d)]
        clique = {
            (min(a, b), max(a, b)): 1.0 / d
            for index in range(size)
            for x, part in enumerate(parts)
            for other in parts[x + 1 :]
            for a, b in [(part[index], other[index])]
        }
        return [*_in_parallel([base_k(part, k) for part in parts]), clique]
    p = 1 << ((s - 1).bit_length() - 1)  # the power of two with s/2 <= p < s (s odd)
    first, rest = list(nodes[:p]), list(nodes[p:])
    merge = {(min(a, b), max(a, b)): p / s for a, b in zip(first, rest, strict=False)}
    return [*_in_parallel([base_k(first, k), base_k(rest, k)]), merge, *base_k(first, k)]


def _matching_pairs(n: int, seed: int, round: int) -> Pairs:
    """Round `round`'s random matching: a Fisher-Yates shuffle driven by SHA-256 of (seed,
    round, position), consecutive peers of the shuffle paired (with n odd the last is not)."""
    order = list(range(n))
    prefix = _MATCHING_TAG + np.array([seed, round], dtype="<u8").tobytes()
    for i in range(n - 1, 0, -1):
        digest = hashlib.sha256(prefix + i.to_bytes(4, "little")).digest()
        j = int.from_bytes(digest[:8], "little") % (i + 1)  # bias below 2^-40 for n <= 2^24
        order[i], order[j] = order[j], order[i]
    return {(min(a, b), max(a, b)): 0.5 for a, b in zip(order[0::2], order[1::2], strict=False)}


@dataclass(frozen=True, eq=False)
class RoundGraphs:
    """The per-round mixing matrices of a time-varying topology on n peers: a period of
    explicit matrices, or a random matching per round from `seed`."""

    n: int
    matrices: tuple[sparse.csr_array, ...] = field(default=(), repr=False)  # one per round
    seed: int | None = None  # random matching
    source: str = "<dict>"
    # the last random matching drawn, (round, pairs): replaced whole, so threads may share it
    _last: tuple[int, Pairs] | None = field(default=None, repr=False)

    @classmethod
    def periodic(cls, n: int, rounds: Sequence[Pairs], source: str) -> RoundGraphs:
        """Checked W_t for each round of one period (each symmetric, doubly stochastic)."""
        if not 1 <= len(rounds) <= MAX_PERIOD:
            problem = f"a period of {len(rounds)} rounds"
            raise _fail(source, problem, f"1..{MAX_PERIOD} rounds (MAX_PERIOD)")
        matrices = []
        for t, pairs in enumerate(rounds):
            graph = nx.empty_graph(n)
            graph.add_edges_from(pairs)
            matrices.append(_checked_mixing(_matrix(n, pairs), graph, f"{source} (round {t})"))
        return cls(n, tuple(matrices), None, source)

    @classmethod
    def random_matching(cls, n: int, seed: int, source: str) -> RoundGraphs:
        return cls(n, (), seed, source)

    @property
    def period(self) -> int | None:
        """Rounds after which the graphs repeat (None: random matchings never do)."""
        return None if self.seed is not None else len(self.matrices)

    def pairs(self, round: int) -> Pairs:
        """{(i, j): w_ij} for i < j of round `round`."""
        if self.seed is None:
            return upper_pairs(self.matrices[round % len(self.matrices)])
        last = self._last
        if last is None or last[0] != round:
            last = (round, _matching_pairs(self.n, self.seed, round))
            object.__setattr__(self, "_last", last)  # one round kept: memory linear in n
        return last[1]

    def matrix(self, round: int) -> sparse.csr_array:
        """W of round `round`."""
        if self.seed is None:
            return self.matrices[round % len(self.matrices)]
        return _matrix(self.n, self.pairs(round))

    def row(self, rank: int, round: int) -> dict[int, float]:
        """{j: w_ij} over the neighbours j of `rank` in round `round`."""
        if self.seed is None:
            w = self.matrices[round % len(self.matrices)]
            start, stop = w.indptr[rank], w.indptr[rank + 1]
            columns, values = w.indices[start:stop].tolist(), w.data[start:stop].tolist()
            return {j: v for j, v in zip(columns, values, strict=True) if j != rank}
        return {
            i if j == rank else j: w for (i, j), w in self.pairs(round).items() if rank in (i, j)
        }

    def union_edges(self) -> Iterator[tuple[int, int]]:
        """Every edge of some round (the complete graph for random matchings)."""
        if self.seed is not None:
            yield from ((i, j) for i in range(self.n) for j in range(i + 1, self.n))
            return
        seen: set[tuple[int, int]] = set()
        for t in range(len(self.matrices)):
            seen.update(self.pairs(t))
        yield from sorted(seen)

    def mean(self) -> sparse.csr_array:
        """The mean W over a period (random matching: the expected W, 1/(2(n-1)) off the
        diagonal for n even, 1/(2n) for n odd): the topology's static `mixing`."""
        if self.seed is None:
            return sum(self.matrices[1:], self.matrices[0]) / len(self.matrices)
        off = 1.0 / (2 * (self.n - 1)) if self.n % 2 == 0 else 1.0 / (2 * self.n)
        dense = np.full((self.n, self.n), off)
        np.fill_diagonal(dense, 1.0 - off * (self.n - 1))
        return sparse.csr_array(dense)

    def degrees(self) -> list[int]:
        """The largest degree of each round of a period (random matching: of round 0)."""
        rounds = range(self.period or 1)
        degree = [
            np.bincount(np.array(list(self.pairs(t)), dtype=np.int64).ravel()) for t in rounds
        ]
        return [int(d.max()) if d.size else 0 for d in degree]

    @cached_property
    def contraction(self) -> float:
        """||W_{P-1} ... W_0 - J||_2 with J = 11^T / n, over one period (random matchings: over
        rounds 0..ceil(log2 n) - 1): 0 when the period averages exactly. Dense: at most
        MAX_DENSE_PEERS peers."""
        if self.n > MAX_DENSE_PEERS:
            raise _fail(
                self.source,
                f"the contraction is not computed for {self.n} peers (over MAX_DENSE_PEERS)",
                f"at most {MAX_DENSE_PEERS} peers",
            )
        rounds = self.period or (self.n - 1).bit_length()
        product = np.eye(self.n)
        for t in range(rounds):
            product = self.matrix(t) @ product
        return float(np.linalg.norm(product - np.full((self.n, self.n), 1.0 / self.n), ord=2))

    def hash_parts(self) -> Iterator[np.ndarray]:
        """What the topology hash covers of the rounds (weights as integers of 1e-12)."""
        if self.seed is not None:
            yield np.array([-1, self.seed >> 32, self.seed & 0xFFFFFFFF])
            return
        yield np.array([len(self.matrices)])
        for w in self.matrices:
            coo = w.tocoo()
            yield np.array([len(coo.data)])
            yield from (coo.row, coo.col, np.rint(coo.data * 1e12))
