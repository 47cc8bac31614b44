"""Live membership: a topology that names a graph family and a capacity, not a fixed graph.

A topology file with `members:` (the initial member ranks) and `n` (the capacity: ranks
0..n-1 may ever take part) is *live*: the graph in force at a round is the family (ring,
complete, star, exponential, base-k, random matching) built over the members in force then, the
members taking the family's positions in rank order, with the family's own weights (Metropolis
for the static families), so every round's W over the members is symmetric and doubly
stochastic and the members' average is kept. Ranks outside the members mix with nobody.

Who is a member comes from schedules (schedule/schedule.py: a schedule may name `members`),
so a change of membership is a change of graph at an effective round that every member applies
at the same round. The union of every graph the family can give over some member set is the
complete graph on the capacity: it is the Topology's `graph` (the edges peers may ever hold),
and its uniform W is the Topology's static `mixing`, which describes no round (the spectrum a
peer uses is that of the family over the members in force: `slem`).

Families whose size is constrained (torus, hypercube, one-peer exponential: a power of two) or
given edge by edge (edges, rounds, random graphs) are refused: they cannot be built over any
member count.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

from gossipcomp.topology.checks import MAX_DENSE_PEERS
from gossipcomp.topology.rounds import RoundGraphs

LIVE_KINDS = ("ring", "complete", "star", "exponential", "base-k", "random-matching")
_CACHED_SIZES = 8  # member counts whose graphs a topology keeps built (a change or two ahead)

Built = sparse.csr_array | RoundGraphs  # the family over m positions: one W, or W per round
Builder = Callable[[int], Built]  # m >= 2 positions -> the family over them


@dataclass(eq=False)
class LiveMembers:
    """The family of a live topology over its capacity, and its initial members."""

    kind: str
    capacity: int
    initial: tuple[int, ...]  # sorted, distinct, each below capacity
    build: Builder = field(repr=False)
    _built: OrderedDict[int, Built] = field(default_factory=OrderedDict, repr=False)
    # peers of one process share a topology: one builds at a time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle without the lock and the built graphs (rebuilt on first use)."""
        return (LiveMembers, (self.kind, self.capacity, self.initial, self.build))

    def members(self, named: Sequence[int]) -> tuple[int, ...]:
        """The members a schedule's `named` list means (empty: the initial ones)."""
        return tuple(named) if named else self.initial

    def _family(self, m: int) -> Built:
        """The family over m >= 2 positions, built once (the last few sizes are kept)."""
        with self._lock:
            built = self._built.get(m)
            if built is None:
                built = self.build(m)
                self._built[m] = built
                while len(self._built) > _CACHED_SIZES:
                    self._built.popitem(last=False)
            else:
                self._built.move_to_end(m)
            return built

    def row(self, rank: int, round: int, named: Sequence[int]) -> dict[int, float]:
        """{j: w_ij} of `rank` at `round` when the members are `named` (empty: the initial
        ones): the family's row of rank's position, in ranks; {} for a rank that is not a
        member, or the only one."""
        members = self.members(named)
        position = _position(members, rank)
        if position is None or len(members) < 2:
            return {}
        built = self._family(len(members))
        if isinstance(built, RoundGraphs):
            row = built.row(position, round)
        else:
            start, stop = built.indptr[position], built.indptr[position + 1]
            columns, values = built.indices[start:stop].tolist(), built.data[start:stop].tolist()
            row = {j: v for j, v in zip(columns, values, strict=True) if j != position}
        return {members[j]: w for j, w in row.items()}

    def period(self, named: Sequence[int]) -> int | None:
        """Rounds after which the family over the members `named` repeats (1: static; None:
        random matchings never do)."""
        members = self.members(named)
        if len(members) < 2:
            return 1
        built = self._family(len(members))
        return built.period if isinstance(built, RoundGraphs) else 1

    def slem(self, named: Sequence[int]) -> float:
        """max(|lambda_2|, |lambda_min|) of the family's W over the members `named` (its mean W
        for a family that changes every round); 0 for one member."""
        members = self.members(named)
        if len(members) < 2:
            return 0.0
        if len(members) > MAX_DENSE_PEERS:
            return 1.0  # no spectrum this large: callers bound their rounds themselves
        built = self._family(len(members))
        w = built.mean() if isinstance(built, RoundGraphs) else built
        eigenvalues = np.linalg.eigvalsh(w.toarray())
        return float(max(abs(eigenvalues[-2]), abs(eigenvalues[0])))

    def hash_parts(self) -> list[np.ndarray]:
        """What the topology hash covers of live membership: capacity, initial members, and the
        family's W over the whole capacity (which tells the families and their parameters
        apart)."""
        parts = [np.array([self.capacity, len(self.initial)]), np.array(self.initial)]
        built = self._family(self.capacity)
        if isinstance(built, RoundGraphs):
            return [*parts, *built.hash_parts()]
        coo = built.tocoo()
        return [*parts, coo.row, coo.col, np.rint(coo.data * 1e12)]


def _position(members: tuple[int, ...], rank: int) -> int | None:
    index = int(np.searchsorted(members, rank))
    return index if index < len(members) and members[index] == rank else None
