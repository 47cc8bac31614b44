"""The bookkeeping shared by the algorithms that broadcast one compressed payload a step.

Choco-SGD and DEF-ATC each keep a copy of themselves that every neighbour tracks exactly
(Choco's public copy xh_i, DEF-ATC's reference phi_k), each neighbour's copy as tracked here,
and a MergedCodec that compresses the current schedule's groups once for all neighbours at the
peer's own level (BroadcastLevels). `BroadcastGossip` holds that once: setup, the wire spec of
every phase, regrouping, levels, resynchronising an edge (both ends send their own copy
exactly) and checkpoints, where every saved tensor is checked before any is assigned. A
subclass names its phases, says where its copies start, and does its own step with the
helpers `_add_to_copies` and `_clipped`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from gossipcomp.compress.base import Compressor
from gossipcomp.gossip.base import RESUME_PHASE, NamedParams
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, difference_norm
from gossipcomp.gossip.merged import MergedCodec
from gossipcomp.gossip.state import (
    checked_tensors,
    load_edge_tensors,
    raw_copy_payload,
    raw_copy_spec,
    require_keys,
    restored_tensors,
    save_edge_tensors,
)
from gossipcomp.levels.codecs import BroadcastLevels
from gossipcomp.levels.rate import LevelCosts
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec

KeyOfRound = Callable[[int], int]  # a phase's compression key for a round


class BroadcastGossip:
    """Per-peer state of a broadcasting algorithm: its own copy, its neighbours' copies as
    tracked here, further per-group memories, the codec and the peers' levels.

    Buffers are one flat tensor per group of the current grouping; checkpoints and resume
    payloads hold them per parameter, so neither depends on the grouping.
    """

    name: ClassVar[str]
    label: ClassVar[str]  # how errors name the algorithm, e.g. "DEF-ATC"
    # checkpoint key and what errors call it: this peer's copy, its neighbours' copies, and
    # further memories of this peer (zero at first)
    OWN_COPY: ClassVar[tuple[str, str]]
    NEIGHBOUR_COPIES: ClassVar[tuple[str, str]]
    MEMORIES: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, compressor: Compressor, seed: int, clipping: ClipRadius | None) -> None:
        self.compressor = compressor
        self.seed = seed
        self.clipping = clipping
        self._codec: MergedCodec | None = None
        self._levels: BroadcastLevels | None = None
        self._groups: tuple[TensorGroup, ...] | None = None  # the schedule's (None: default)
        self._me = 0
        self.own_copy: list[torch.Tensor] = []
        self.tracked: dict[int, list[torch.Tensor]] = {}  # neighbour -> its copy
        self.memories: dict[str, list[torch.Tensor]] = {}  # checkpoint key -> buffers

    # --- what a subclass says ------------------------------------------------------------------

    def _phases(self) -> dict[str, KeyOfRound]:
        """Each phase of a round, with the key its payload is compressed under."""
        raise NotImplementedError

    def _initial_copy(self, params: NamedParams) -> list[torch.Tensor]:
        """Where this peer's copy and its neighbours' start (the same at every peer)."""
        raise NotImplementedError

    def _levels_changed(self, params: NamedParams) -> None:
        """Called once the codec compresses at this peer's (new) level."""

    # --- setup, specs, regrouping and levels ------------------------------------------------

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._codec = MergedCodec(params, self.compressor, self.seed, rank)
        self._levels = BroadcastLevels(params, self.compressor, rank, neighbours)
        self._me, self._groups = rank, None
        self._levels_changed(params)
        start = self._initial_copy(params)
        self.own_copy = [t.clone() for t in start]
        self.tracked = {j: [t.clone() for t in start] for j in neighbours}
        self.memories = {key: self._codec.zeros() for key, _ in self.MEMORIES}
        return self.specs(params, None)

    def specs(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> dict[str, PayloadSpec]:
        """Per phase, what a neighbour's envelope holds under `groups` (None or empty: one
        group per parameter with this algorithm's compressor), without changing anything."""
        codec = self._require_codec()
        grouping = codec.regrouped(params, groups)
        specs = {phase: codec.spec(key, grouping) for phase, key in self._phases().items()}
        specs[RESUME_PHASE] = raw_copy_spec(params)
        return specs

    def regroup(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Switch to `groups` (a schedule taking effect): state moves to the new buffers."""
        codec = self._require_codec()
        own = codec.per_parameter(self.own_copy)
        tracked = {j: codec.per_parameter(t) for j, t in self.tracked.items()}
        memories = {key: codec.per_parameter(t) for key, t in self.memories.items()}
        self._groups = tuple(groups) if groups else None
        levels = self._require_levels()
        levels.switch(params, self._groups, levels.levels, codec)
        self._levels_changed(params)
        self.own_copy = codec.flats(own)
        self.tracked = {j: codec.flats(t) for j, t in tracked.items()}
        self.memories = {key: codec.flats(t) for key, t in memories.items()}

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """The ladder of its compressor, with the bytes a round (one payload a phase) sends
        each neighbour."""
        return self._require_levels().costs(len(self._phases()))

    def level_label(self, level: int) -> str:
        return self._require_levels().ladder.spec(level)

    def default_level(self) -> int:
        return self._require_levels().ladder.default

    def peer_specs(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, each neighbour's envelope under `groups`, compressed at its level."""
        codec, ladder = self._require_codec(), self._require_levels()
        specs: dict[str, Mapping[int, PayloadSpec] | PayloadSpec] = {
            phase: ladder.specs_for(params, groups, levels, codec, key)
            for phase, key in self._phases().items()
        }
        specs[RESUME_PHASE] = raw_copy_spec(params)
        return specs

    def set_peer_levels(self, params: NamedParams, levels: Mapping[int, int], round: int) -> None:
        """Compress at this peer's level in `levels` from now on (neighbours' payloads are
        decoded at theirs by the transport, from `peer_specs`)."""
        self._require_levels().switch(params, self._groups, levels, self._require_codec())
        self._levels_changed(params)

    def _require_levels(self) -> BroadcastLevels:
        if self._levels is None:
            raise RuntimeError(f"{self.label} used before setup")
        return self._levels

    def _require_codec(self) -> MergedCodec:
        if self._codec is None:
            raise RuntimeError(f"{self.label} used before setup")
        return self._codec

    # --- a step's bookkeeping -------------------------------------------------------------------

    def _add_to_copies(
        self,
        own: Callable[[int], torch.Tensor],
        received: Mapping[int, Envelope],
        alpha: Callable[[int, int], float],
    ) -> None:
        """Group by group, this peer's copy plus alpha(rank, group) times `own(group)` (what it
        sent, decoded), and each neighbour heard's plus alpha(neighbour, group) times what it
        sent (decoded by the transport at receipt)."""
        codec = self._require_codec()
        for g, copy in enumerate(self.own_copy):
            copy.add_(own(g), alpha=alpha(self._me, g))
            for j, envelope in received.items():
                self.tracked[j][g].add_(codec.decoded(envelope, g), alpha=alpha(j, g))

    def _clipped(self, weights: Mapping[int, float]) -> Mapping[int, float]:
        """`weights`, each clipped by the distance of the neighbour's copy from this peer's
        (over the whole model) when clipping is on (gossip/clipping.py)."""
        if self.clipping is None:
            return weights
        distances = {j: difference_norm(self.tracked[j], self.own_copy) for j in weights}
        return clipped_weights(weights, distances, self.clipping)

    # --- edges that come back, checkpoints -----------------------------------------------------

    def resume_payload(self, params: NamedParams) -> Payload | None:
        """This peer's copy, exactly: the neighbour replaces its tracked copy with it."""
        return raw_copy_payload(params, self._require_codec().per_parameter(self.own_copy))

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        codec = self._require_codec()
        current = codec.per_parameter(self.tracked[neighbour])
        restored = restored_tensors(current, envelope, f"{self.name} resume")
        self.tracked[neighbour] = codec.flats(restored)

    def state_dict(self) -> dict[str, Any]:
        codec = self._require_codec()
        state: dict[str, Any] = {
            self.OWN_COPY[0]: [t.clone() for t in codec.per_parameter(self.own_copy)],
            self.NEIGHBOUR_COPIES[0]: save_edge_tensors(
                {j: codec.per_parameter(t) for j, t in self.tracked.items()}
            ),
        }
        for key, buffers in self.memories.items():
            state[key] = [t.clone() for t in codec.per_parameter(buffers)]
        state["feedback"] = codec.feedback_memories()  # ef+... compressors' memories
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        codec = self._require_codec()
        if isinstance(state, dict):  # older checkpoints saved no feedback memories
            state = {"feedback": {}, **state}
        (own_key, own_label), (tracked_key, tracked_label) = self.OWN_COPY, self.NEIGHBOUR_COPIES
        keys = {own_key, tracked_key, *(key for key, _ in self.MEMORIES), "feedback"}
        require_keys(state, keys, self.name)
        own = checked_tensors(
            f"{self.name} {own_label}", codec.per_parameter(self.own_copy), state[own_key]
        )
        memories = {
            key: checked_tensors(
                f"{self.name} {label}", codec.per_parameter(self.memories[key]), state[key]
            )
            for key, label in self.MEMORIES
        }
        tracked = load_edge_tensors(
            f"{self.name} {tracked_label}",
            {j: codec.per_parameter(t) for j, t in self.tracked.items()},
            state[tracked_key],
        )
        codec.load_feedback_memories(state["feedback"])  # checks all, then assigns
        self.own_copy = codec.flats(own)
        self.tracked = {j: codec.flats(t) for j, t in tracked.items()}
        self.memories = {key: codec.flats(t) for key, t in memories.items()}
