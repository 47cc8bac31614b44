"""The GossipAlgorithm protocol and the Neighbourhood an algorithm sees at one peer.

An algorithm is a per-peer state object. It never reads globals: its peer's rank, neighbours and
mixing weights come in through the Neighbourhood, so any number of peers can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from gossipcomp.gossip.round_wait import RoundWait
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.levels.rate import LevelCosts
from gossipcomp.schedule.costs import TransferLog
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.transport.base import (
    RAW_CODEC,
    Envelope,
    ExchangeResult,
    Payload,
    PayloadSpec,
)
from gossipcomp.transport.codec import decode_raw
from gossipcomp.transport.protocol import Transport

_FLOATS = {"float32", "float64", "float16", "bfloat16"}

NamedParams = Sequence[tuple[str, torch.Tensor]]
RESUME_PHASE = "resume"  # the exchange that resynchronises an edge when it comes back


@dataclass
class LinkStats:
    """Serialised bytes and exchanges per neighbour, accumulated over a peer's life."""

    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    failures: dict[int, int] = field(default_factory=dict)
    epoch_mismatches: int = 0  # exchanges refused: the neighbour sent under another epoch
    # the last transfers of each link, (bytes both ways, seconds), for the cost model
    transfers: TransferLog = field(default_factory=lambda: TransferLog(per_link=64))
    # the last sends to each neighbour, (bytes sent, seconds until it had them): one link's
    # own speed, for the rate controller
    sends: TransferLog = field(default_factory=lambda: TransferLog(per_link=16))

    def add(self, result: ExchangeResult, seconds: float) -> None:
        """Count an exchange that took `seconds` (recorded as a transfer of every neighbour
        that answered)."""
        self.epoch_mismatches += len(result.epoch_mismatches)
        for j, received in result.bytes_received.items():
            sent = result.bytes_sent.get(j)
            if sent is not None:
                self.transfers.record(j, sent + received, seconds)
        for j, n in result.bytes_sent.items():
            self.bytes_sent[j] = self.bytes_sent.get(j, 0) + n
            if j in result.send_seconds:
                self.sends.record(j, n, result.send_seconds[j])
        for j, n in result.bytes_received.items():
            self.bytes_received[j] = self.bytes_received.get(j, 0) + n
        for j in result.failed:
            self.failures[j] = self.failures.get(j, 0) + 1


@dataclass
class Neighbourhood:
    """One peer's view of the network for one gossip round.

    `weights` holds w_ij for each neighbour j and `self_weight` w_ii (rows of the mixing matrix
    W). `exchange` sends one payload per neighbour for this round and returns what they sent; the
    bytes and the time it takes are accounted in `links` and `comm_seconds`. Every exchange of
    the round draws on the round's one waiting budget (`wait`, gossip/round_wait.py), so a round
    with several exchanges (a resume, an algorithm's phases) waits about one round timeout.
    """

    rank: int
    round: int
    weights: Mapping[int, float]
    self_weight: float
    transport: Transport
    wait: RoundWait  # what the round may still wait for its neighbours, shared by its exchanges
    links: LinkStats
    schedule_epoch: int = 0
    turns: ComputeTurns | None = None  # peers of one process taking turns: given up while waiting
    # rounds after which the graph repeats (topology.period: 1 static, None never): an edge of a
    # time-varying graph is active once a period, so per-edge alternations count periods
    period: int | None = 1
    comm_seconds: float = 0.0
    exchanges: int = 0  # exchanges made this round
    failed: dict[int, str] = field(default_factory=dict)  # neighbour -> why it failed this round
    # neighbour -> the envelopes it sent this round (references, no copies): what the peer
    # looks at to blame a neighbour when it has to refuse the round
    received: dict[int, list[Envelope]] = field(default_factory=dict)

    @property
    def neighbours(self) -> list[int]:
        return sorted(self.weights)

    @property
    def sweep(self) -> int:
        """The round counted in periods of the graph (the round itself when static or never
        repeating): what alternates from one activation of an edge to its next."""
        return self.round // self.period if self.period else self.round

    def exchange(self, phase: str, outgoing: Mapping[int, Payload] | Payload) -> ExchangeResult:
        """Send `outgoing` (one payload for all, or one per neighbour) and collect replies."""
        per_peer = (
            {j: outgoing for j in self.neighbours} if isinstance(outgoing, tuple) else outgoing
        )
        start = time.perf_counter()
        with self.turns.waiting() if self.turns is not None else nullcontext():
            sent = time.perf_counter()
            result = self.transport.exchange(
                self.round, phase, per_peer, self.wait.timeout(), self.schedule_epoch
            )
            self.wait.spent(time.perf_counter() - sent)
        elapsed = time.perf_counter() - start
        self.comm_seconds += elapsed
        self.exchanges += 1
        self.links.add(result, elapsed)
        self.failed.update(result.failed)
        for j, envelope in result.received.items():
            self.received.setdefault(j, []).append(envelope)
        return result

    def largest_raw_value(self, neighbour: int) -> float:
        """The largest magnitude among the raw floating-point values `neighbour` sent this
        round (already checked finite at receipt); 0 when it sent none. Compressed payloads
        are not counted."""
        return max(
            (
                float(decode_raw(t).abs().max())
                for envelope in self.received.get(neighbour, ())
                for t in envelope.tensors
                if t.codec == RAW_CODEC and t.dtype in _FLOATS and t.nbytes
            ),
            default=0.0,
        )


class GossipAlgorithm(Protocol):
    """Per-peer gossip state: what it expects to receive, and one gossip step."""

    name: str

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        """Prepare per-peer state; return, per phase, what a neighbour's envelope must hold."""
        ...

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        """Gossip once with the neighbourhood; mutates `params` in place (and own state)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything `step` depends on besides the parameters (tensors, numbers, strings), so a
        peer restored from a checkpoint continues exactly; empty for stateless algorithms."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (after `setup`); raises ValueError on a mismatch."""
        ...


@runtime_checkable
class Resumable(Protocol):
    """An algorithm with per-edge state that both ends must hold alike (Choco's public copies,
    DEF-ATC's references, PowerGossip's power vectors). When an edge comes back (after a
    failure, a partition or a restart), both ends call these at the same agreed round."""

    def resume_payload(self, params: NamedParams) -> Payload | None:
        """What this peer sends a resuming neighbour (phase RESUME_PHASE, spec given by
        `setup`), or None when the edge can be reset without data."""
        ...

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        """Reset this peer's state for the edge to `neighbour` from what it sent (`envelope`),
        identically at both ends."""
        ...


@runtime_checkable
class Regroupable(Protocol):
    """An algorithm whose payload follows a schedule's tensor groups (Choco-SGD, DEF-ATC): each
    group is fused into one buffer and compressed once with the group's compressor."""

    def specs(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> dict[str, PayloadSpec]:
        """Per phase, what a neighbour's envelope holds under `groups` (None: one group per
        parameter with the algorithm's compressor), without changing anything; ValueError
        when the groups do not fit the model."""
        ...

    def regroup(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Switch to `groups` at the round a schedule takes effect, keeping all state."""
        ...


@runtime_checkable
class LinkLeveled(Protocol):
    """An algorithm whose compression level can differ per link (PowerGossip's rank): a
    schedule's link levels set it, both ends of an edge switching at the same round."""

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """Its ladder of levels with the bytes one round sends one neighbour at each."""
        ...

    def level_label(self, level: int) -> str:
        """How a level reads in logs and reports, e.g. "rank=4"."""
        ...

    def link_specs(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, what each neighbour's envelope holds under `groups` with `levels`
        (neighbour -> level; one not listed: the algorithm's own), changing nothing;
        ValueError for a level it cannot use."""
        ...

    def set_levels(self, levels: Mapping[int, int], round: int) -> None:
        """Use `levels` from this round on (at the round a schedule takes effect)."""
        ...


@runtime_checkable
class PeerLeveled(Protocol):
    """An algorithm that broadcasts one compressed payload per step to every neighbour
    (Choco-SGD, DEF-ATC), so its compression level belongs to the sender, not to a link: each
    peer compresses at the lowest level among its links (levels/rate.py `peer_levels`, from
    a schedule's link table), and each neighbour, holding the same table and topology, decodes
    at that level. All switch at the round a schedule takes effect (without a coordinator, at
    the round a peer's notice of its own level names: levels/senders.py). (A level per link
    needs a public copy per edge: `choco-edge`, which is LinkLeveled; docs/design.md,
    "Bandwidth-adaptive levels".)"""

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """Its ladder of levels with the bytes one round sends each neighbour at each."""
        ...

    def level_label(self, level: int) -> str:
        """How a level reads in logs and reports: its compressor spec."""
        ...

    def default_level(self) -> int:
        """The level of the algorithm's own compressor: what a link no schedule lists counts
        as (after `setup`)."""
        ...

    def peer_specs(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, what each neighbour's envelope holds under `groups` when peers compress
        at `levels` (this peer and its neighbours -> level; one not listed: the default),
        changing nothing; ValueError naming the peer for a level not on the ladder."""
        ...

    def set_peer_levels(self, params: NamedParams, levels: Mapping[int, int], round: int) -> None:
        """Compress at this peer's level and decode each neighbour at its own, from `round`
        on (at the round a schedule takes effect); levels checked by `peer_specs` first."""
        ...
