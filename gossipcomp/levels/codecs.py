"""One compression level per peer for the algorithms that broadcast a payload (Choco, DEF-ATC).

A sender compresses once for all its neighbours, so its level is its own: the lowest level
among its links in a coordinator's schedule (levels/rate.py `peer_levels`), or, without a
coordinator, the level it decides and announces (levels/senders.py). A level is a position on the
ladder of the algorithm's compressor (levels/ladder.py); it applies to every group the
schedule compresses with the algorithm's own compressor (the default one-group-per-parameter
layout included), while a group a planner gave another compressor keeps it. Levels change
compressors, never the groups, so the per-group buffers (public copies, references) keep
their layout across a change and only error-feedback memories move to the new compressors.

Each neighbour's envelope is decoded at that neighbour's level: `specs_for` builds one spec per
level in use, and the transport decodes each envelope with its sender's spec at receipt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gossipcomp.compress import parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.levels.ladder import Ladder, ladder_for
from gossipcomp.levels.rate import LevelCosts
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.transport.base import PayloadSpec

FLOOR_DIVISOR = 3  # a rate controller compresses a broadcast at most this much past the configured

if TYPE_CHECKING:  # gossip/ loads Choco and DEF-ATC, which import this module (see `grouping`)
    from gossipcomp.gossip.base import NamedParams
    from gossipcomp.gossip.grouping import Grouping
    from gossipcomp.gossip.merged import MergedCodec


class BroadcastLevels:
    """The ladder of a broadcasting algorithm's compressor and the level each peer of one
    neighbourhood (the peer itself and its neighbours) compresses at."""

    def __init__(
        self, params: NamedParams, compressor: Compressor, rank: int, neighbours: Sequence[int]
    ) -> None:
        self.ladder: Ladder = ladder_for(compressor.spec, [p.numel() for _, p in params])
        self.base = parse_spec(compressor.spec).spec
        self.rank = rank
        self.levels: dict[int, int] = {p: self.ladder.default for p in (rank, *neighbours)}

    @property
    def own(self) -> int:
        return self.levels[self.rank]

    @property
    def floor(self) -> int:
        """The lowest level the rate controller may choose: the lowest whose payload is at
        least 1/`FLOOR_DIVISOR` of the configured level's. A broadcast level is the lowest
        among a peer's links, and with the ladder's bottom allowed the slow link's ends went
        to top-k ratios of 1e-4 to 2e-3 (100 bytes: no learning; docs/benchmarks.md run 5);
        a level a few times cheaper than the one configured still learns (top-k 0.02 for the
        configured 0.05 reaches 0.95 where 0.01 stays at 0.92)."""
        least = self.ladder.nbytes[self.ladder.default - 1] / FLOOR_DIVISOR
        return next(level for level, n in enumerate(self.ladder.nbytes, start=1) if n >= least)

    def costs(self, exchanges: int) -> LevelCosts:
        """Bytes one round sends each neighbour at every level from `floor` up (`exchanges`
        payloads): the levels a rate controller chooses among."""
        return LevelCosts(
            {
                level: exchanges * n
                for level, n in enumerate(self.ladder.nbytes, start=1)
                if level >= self.floor
            },
            exchanges,
        )

    def checked(self, levels: Mapping[int, int]) -> dict[int, int]:
        """Every peer's level under `levels` (one not listed: the default); ValueError naming
        the peer for one outside the neighbourhood or a level off the ladder."""
        chosen = dict.fromkeys(self.levels, self.ladder.default)
        for peer, level in levels.items():
            if peer not in chosen:
                raise ValueError(
                    f"level for peer {peer}: expected this peer ({self.rank}) or a neighbour"
                )
            chosen[peer] = self.ladder.check(level, f"level of peer {peer}")
        return chosen

    def grouping(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None, level: int
    ) -> Grouping:
        """`groups` (None or empty: one per parameter) with the algorithm's compressor replaced
        by the one of `level`."""
        # imported here: gossip/'s __init__ imports Choco and DEF-ATC, which import this
        # module, so importing it first must not import gossip/ (it is loaded by now)
        from gossipcomp.gossip.grouping import Grouping

        spec = self.ladder.spec(level)
        leveled = None
        if groups:
            leveled = [
                TensorGroup(g.names, spec if self._is_base(g.compressor) else g.compressor)
                for g in groups
            ]
        return Grouping(params, parse_spec(spec), leveled)

    def _is_base(self, spec: str) -> bool:
        return parse_spec(spec).spec == self.base

    def specs_for(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
        codec: MergedCodec,
        key_of_round: Callable[[int], int],
    ) -> Mapping[int, PayloadSpec] | PayloadSpec:
        """What each neighbour's envelope holds when it compresses at its level in `levels`
        (checked), decoded with the randomness of `key_of_round`: one spec when all
        neighbours share a level."""
        neighbours = {p: level for p, level in self.checked(levels).items() if p != self.rank}
        by_level = {
            level: codec.spec(key_of_round, self.grouping(params, groups, level))
            for level in sorted(set(neighbours.values()))
        }
        if not by_level:  # no neighbour: nothing will arrive
            return codec.spec(key_of_round, self.grouping(params, groups, self.ladder.default))
        if len(by_level) == 1:
            return next(iter(by_level.values()))
        return {j: by_level[level] for j, level in neighbours.items()}

    def switch(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
        codec: MergedCodec,
    ) -> None:
        """Use `levels` (checked) from now on: `codec` compresses at this peer's level, its
        error-feedback memories carried over."""
        self.levels = self.checked(levels)
        memories = codec.feedback_memories()
        codec.use(self.grouping(params, groups, self.own))
        codec.load_feedback_memories(memories)
