"""The acceptance guard of a peer's model: a gossip round whose result would make the model
NaN/Inf, or move it further than `max_move` allows, is undone and its senders blamed; a model
that starts with NaN/Inf, or whose constant buffers changed, is refused with what to do. So
nothing a neighbour sends, and no training mistake, silently breaks the model."""

from __future__ import annotations

import logging
import math

import torch

from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.clipping import total_norm
from gossipcomp.inputs.numbers import checked_number
from gossipcomp.transport.codec import all_finite
from gossipcomp.workload.models import constant_tensors

MAX_GOSSIP_MOVE = 100.0  # a gossip round may move the model by this many times (||x|| + 1)
REFUSED_ROUND = "what it sent would make this peer's model NaN/Inf or move it absurdly far"
log = logging.getLogger("gossipcomp.peer")  # its warnings are the peer's


def check_max_move(max_move: float | None) -> None:
    """ValueError unless `max_move` is a finite number > 0 or None."""
    if max_move is not None:
        checked_number("max_move", max_move, 0.0, closed_low=False)


class ModelGuard:
    """Checks on the gossiped tensors `params` of peer `rank`'s `model` (see Peer)."""

    def __init__(
        self,
        rank: int,
        model: torch.nn.Module,
        params: NamedParams,
        max_move: float | None,
        gossip_buffers: bool,
        constant_buffers: bool,
    ) -> None:
        check_max_move(max_move)
        self.rank = rank
        self.model = model
        self.params = params
        self.max_move = max_move
        # (name, buffer, its value now): each checked unchanged every round
        self.constants = [
            (name, b, b.detach().clone())
            for name, b in constant_tensors(model, gossip_buffers, constant_buffers)
        ]

    def check_gossiped_finite(self) -> None:
        """Refuse to start with a gossiped tensor holding NaN/Inf, naming it and the remedy."""
        buffers = {name for name, _ in self.model.named_buffers()}
        for name, tensor in self.params:
            if all_finite(tensor.detach()):
                continue
            if name in buffers:
                raise ValueError(
                    f"peer {self.rank}: buffer {name!r} holds NaN/Inf, and every neighbour "
                    "refuses non-finite values, so this peer would train alone; expected finite "
                    "gossiped buffers: make it non-persistent (register_buffer(..., "
                    "persistent=False)) if it is no part of the model's state, or leave buffers "
                    "out of gossip (Peer(gossip_buffers=False), --no-gossip-buffers)"
                )
            raise ValueError(
                f"peer {self.rank}: parameter {name!r} holds NaN/Inf, and every neighbour "
                "refuses non-finite values; expected a finite model (look at its "
                "initialisation, or the checkpoint it was restored from)"
            )

    def constant_values(self) -> dict[str, torch.Tensor]:
        """The constant buffers' values taken when the peer was made, by state-dict key (a
        restored checkpoint must hold the same)."""
        return {name: value for name, _, value in self.constants}

    def check_constants(self, when: str) -> None:
        """Raise ValueError naming a constant buffer (not gossiped: see Peer) whose value is no
        longer what it was when the peer was made."""
        for name, buffer, value in self.constants:
            if not torch.equal(buffer.detach(), value):
                raise ValueError(
                    f"peer {self.rank}: buffer {name!r} changed {when}, but it was taken as "
                    "constant (it is not a normalisation layer's running statistic), so it is "
                    "not gossiped and peers would disagree on it; expected it unchanged, or "
                    "Peer(constant_buffers=False) to gossip every floating-point buffer every "
                    "round"
                )

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the gossiped tensors, to judge and maybe undo the round to come."""
        return [p.detach().clone() for _, p in self.params]

    def acceptable(self, before: list[torch.Tensor]) -> bool:
        """Whether the model after this round's gossip is finite and moved no more than
        `max_move` allows from `before`."""
        with torch.no_grad():
            moved = total_norm(p - b for (_, p), b in zip(self.params, before, strict=True))
            if not math.isfinite(moved):
                return False
            return self.max_move is None or moved <= self.max_move * (total_norm(before) + 1.0)

    def to_blame(
        self, hood: Neighbourhood, heard: list[int], before: list[torch.Tensor]
    ) -> list[int]:
        """The neighbours of a refused round that sent a raw value beyond what `max_move`
        allows; all those heard when none did (the lie was in a compressed payload)."""
        limit = (self.max_move or MAX_GOSSIP_MOVE) * (total_norm(before) + 1.0)
        blamed = [j for j in heard if hood.largest_raw_value(j) > limit]
        return blamed or heard

    def refuse_round(self, before: list[torch.Tensor], blamed: list[int], round: int) -> str:
        """Undo a gossip round that would break the model, saying so; returns the reason the
        `blamed` neighbours' edges are taken down for."""
        with torch.no_grad():
            for (_, p), saved in zip(self.params, before, strict=True):
                p.copy_(saved)
        log.warning(
            "peer %d: round %d would make the model NaN/Inf or move it more than %s x "
            "(its norm + 1); refused, model kept, neighbours %s taken down to resynchronise",
            self.rank,
            round,
            self.max_move,
            ", ".join(str(j) for j in blamed),
        )
        return REFUSED_ROUND
