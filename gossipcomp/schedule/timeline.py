"""Timeline simulator: predicted round time of many peers from measured per-peer costs.

A discrete-event model of synchronous rounds, fast enough for 1024 peers and tens of rounds.

Gossip (ring, torus, exponential graph): in round r peer i
  1. runs its local step and compresses its envelope: a CPU task of compute_i(r) + compress_s
     (compute_i(r) = compute_s times a mean-one lognormal factor of spread `compute_jitter`,
     drawn per peer and round from `seed`);
  2. sends the envelope to each neighbour; a transfer takes alpha + beta * message_bytes, and
     with `shared_uplink` a peer's sends leave one after another (the k-th neighbour, in rank
     order, receives at alpha + k * beta * bytes), otherwise all at once;
  3. when it has every neighbour's round-r envelope and its own sends are out, decodes and mixes
     them: a CPU task of decompress_s per neighbour. Its round ends there; round r + 1 starts.
  A peer is never more than one round ahead of a neighbour: it cannot finish round r without
  the neighbour's round-r envelope.

CPU: with `cores=None` every peer has its own processor (a real deployment) and the rounds are
a max-plus recurrence evaluated for all peers at once with numpy. With `cores=k`, all peers'
CPU tasks share k processors, first come first served, as when every peer runs in one process
(`gossipcomp simulate`: threads taking turns under one interpreter lock). Then the event loop
runs task by task. What `cores` does not model: preemption and time slices (a task runs to the
end once started), the interpreter lock's hand-over delays, and the network stack's own CPU;
those are folded into the per-task costs when they are calibrated from a measured run.

Ring all-reduce: compute and compress as in 1, then 2 (n - 1) steps (reduce-scatter, then
all-gather) in each of which every peer sends a chunk of message_bytes / n to its successor and
waits for its predecessor's chunk, then decompress_s once. The payload must be summable (fp16,
identity, sign bits through Marsit); one processor per peer.

Round time is the steady-state mean: (last finish of round R - last finish of round W) / (R - W)
with W = `warmup` rounds left out. Scaling efficiency = compute_s / round time: the fraction of
a lone peer's throughput each peer keeps.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.schedule.costs import LinkCost
from gossipcomp.topology import build_topology

Layout = Literal["ring", "torus", "exponential", "ring-allreduce"]
LAYOUTS: tuple[Layout, ...] = ("ring", "torus", "exponential", "ring-allreduce")
MAX_SIM_PEERS = 16_384
MAX_SIM_ROUNDS = 100_000
MAX_SIM_TASKS = 20_000_000  # peers x rounds the simulator accepts in one call


@dataclass(frozen=True)
class PeerCosts:
    """Measured costs of one peer's round (seconds, bytes); the same for every peer."""

    compute_s: float  # local step (forward, backward, optimiser), mean over rounds
    message_bytes: int  # one envelope to one neighbour (all-reduce: the whole payload)
    compress_s: float = 0.0  # compressing the envelope, once per round
    decompress_s: float = 0.0  # decoding and mixing one received envelope
    compute_jitter: float = 0.0  # spread (sigma of a mean-one lognormal) of compute per round

    def __post_init__(self) -> None:
        for key in ("compute_s", "compress_s", "decompress_s"):
            checked_number(f"PeerCosts: {key}", getattr(self, key), 0.0, 86_400.0)
        checked_number("PeerCosts: compute_jitter", self.compute_jitter, 0.0, 3.0)
        checked_integer("PeerCosts: message_bytes", self.message_bytes, 0, 1 << 40)


@dataclass(frozen=True)
class Timeline:
    """Finish time of every round at every peer, and the figures derived from it."""

    layout: str
    peers: int
    finish: np.ndarray  # [rounds, peers] seconds since the start when each peer ended each round
    warmup: int
    compute_s: float

    @property
    def round_s(self) -> float:
        """Steady-state seconds per round (see the module docstring)."""
        last = self.finish.max(axis=1)
        rounds = last.size
        if rounds - self.warmup < 1:
            return float(last[-1] / rounds)
        start = last[self.warmup - 1] if self.warmup > 0 else 0.0
        return float((last[-1] - start) / (rounds - self.warmup))

    @property
    def efficiency(self) -> float:
        """compute_s / round_s: 1.0 when communication is free and never waited for."""
        return self.compute_s / self.round_s if self.round_s > 0 else 1.0


def neighbour_lists(layout: Layout, peers: int) -> list[np.ndarray]:
    """Each peer's neighbours (sorted ranks) on `layout` with `peers` peers, from the project's
    topology builders (torus: the most square rows x cols)."""
    if layout == "torus":
        rows = max(r for r in range(1, math.isqrt(peers) + 1) if peers % r == 0)
        if rows == 1:
            raise ValueError(
                f"torus: {peers} peers do not make a grid of at least 2 rows; "
                "expected a composite number of peers"
            )
        topology = build_topology("torus", rows=rows, cols=peers // rows)
    elif layout in ("ring", "exponential"):
        topology = build_topology(layout, n=peers)
    else:
        raise ValueError(
            f"no neighbour graph for layout {quoted(layout)}; expected ring, torus or exponential"
        )
    return [np.array(sorted(topology.graph.neighbors(i)), dtype=np.int64) for i in range(peers)]


def _compute_draws(costs: PeerCosts, rounds: int, peers: int, seed: int) -> np.ndarray:
    """compute_s per round and peer, times a mean-one lognormal factor ([rounds, peers])."""
    if costs.compute_jitter == 0:
        return np.full((rounds, peers), costs.compute_s)
    sigma = costs.compute_jitter
    factor = np.random.default_rng(seed).lognormal(-sigma * sigma / 2, sigma, (rounds, peers))
    return costs.compute_s * factor


def simulate(
    layout: Layout,
    peers: int,
    costs: PeerCosts,
    link: LinkCost,
    rounds: int = 20,
    *,
    cores: int | None = None,
    shared_uplink: bool = True,
    warmup: int = 2,
    seed: int = 0,
) -> Timeline:
    """Simulate `rounds` rounds of `peers` peers on `layout` (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {quoted(layout)}; expected one of {', '.join(LAYOUTS)}")
    checked_integer("simulate: peers", peers, 3, MAX_SIM_PEERS)
    checked_integer("simulate: rounds", rounds, 1, MAX_SIM_ROUNDS)
    checked_integer("simulate: warmup", warmup, 0, rounds - 1)
    if cores is not None:
        checked_integer("simulate: cores", cores, 1, 1 << 20)
    if peers * rounds > MAX_SIM_TASKS:
        raise ValueError(
            f"simulate: {peers} peers x {rounds} rounds is more than "
            f"{MAX_SIM_TASKS} peer-rounds; expected fewer rounds"
        )
    compute = _compute_draws(costs, rounds, peers, seed)
    if layout == "ring-allreduce":
        if cores is not None:
            raise ValueError(
                "simulate: ring-allreduce is modelled with one processor per peer; "
                "expected cores=None"
            )
        finish = _ring_allreduce(compute, costs, link)
    else:
        neighbours = neighbour_lists(layout, peers)
        if cores is None or cores >= peers:  # a peer runs one task at a time: k >= n is no limit
            finish = _gossip_dedicated(neighbours, compute, costs, link, shared_uplink)
        else:
            finish = _gossip_shared(neighbours, compute, costs, link, shared_uplink, cores)
    return Timeline(layout, peers, finish, warmup, costs.compute_s)


def _send_offsets(
    neighbours: Sequence[np.ndarray], costs: PeerCosts, link: LinkCost, shared_uplink: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Edge arrays (sender, receiver, delay from the end of the sender's step to arrival) and
    each peer's delay until its own sends are out."""
    per_send = link.seconds_per_byte * costs.message_bytes
    senders, receivers, delays = [], [], []
    for i, nbrs in enumerate(neighbours):
        order = np.arange(1, nbrs.size + 1) if shared_uplink else np.ones(nbrs.size)
        senders.append(np.full(nbrs.size, i))
        receivers.append(nbrs)
        delays.append(link.latency_s + per_send * order)
    delay = np.concatenate(delays)
    sender = np.concatenate(senders)
    sends_out = np.zeros(len(neighbours))
    np.maximum.at(sends_out, sender, delay)
    return sender, np.concatenate(receivers), delay, sends_out


def _gossip_dedicated(
    neighbours: Sequence[np.ndarray],
    compute: np.ndarray,
    costs: PeerCosts,
    link: LinkCost,
    shared_uplink: bool,
) -> np.ndarray:
    """Max-plus recurrence, one processor per peer:
    step_i = end_i(r-1) + compute_i(r) + compress; end_i(r) = max(step_i + sends_out_i,
    max_j step_j + delay_ji) + degree_i * decompress."""
    rounds, peers = compute.shape
    sender, receiver, delay, sends_out = _send_offsets(neighbours, costs, link, shared_uplink)
    mix = np.array([nbrs.size for nbrs in neighbours]) * costs.decompress_s
    finish = np.empty((rounds, peers))
    end = np.zeros(peers)
    for r in range(rounds):
        step = end + compute[r] + costs.compress_s
        ready = step + sends_out
        np.maximum.at(ready, receiver, step[sender] + delay)
        end = ready + mix
        finish[r] = end
    return finish


def _gossip_shared(
    neighbours: Sequence[np.ndarray],
    compute: np.ndarray,
    costs: PeerCosts,
    link: LinkCost,
    shared_uplink: bool,
    cores: int,
) -> np.ndarray:
    """Event loop: CPU tasks (a peer's step, then its mix) on `cores` shared processors, first
    come first served; a peer's mix becomes ready when its own sends are out and its neighbours'
    envelopes have arrived."""
    rounds, peers = compute.shape
    per_send = link.seconds_per_byte * costs.message_bytes
    degree = [int(nbrs.size) for nbrs in neighbours]
    # arrival delay after the sender's step, per (sender, k-th neighbour), and sends-out delay
    delays = [
        link.latency_s + per_send * (np.arange(1, d + 1) if shared_uplink else np.ones(d))
        for d in degree
    ]
    sends_out = [float(d.max()) if d.size else 0.0 for d in delays]
    finish = np.empty((rounds, peers))
    # per peer and round parity (a neighbour is at most one round ahead): envelopes still
    # awaited and the latest arrival so far
    awaited = np.array([[d, d] for d in degree], dtype=np.int64)
    latest = np.zeros((peers, 2))
    sent_by = np.full(peers, -1.0)  # when this round's own sends are out; -1: step not done
    peer_round = [0] * peers
    ready_event, end_event = 0, 1
    step_task, mix_task = 0, 1
    # (time, kind, order, task, peer): a task becomes ready, or a task ends; after each event,
    # free processors take waiting tasks first come first served
    events: list[tuple[float, int, int, int, int]] = [
        (0.0, ready_event, i, step_task, i) for i in range(peers)
    ]
    heapq.heapify(events)
    order = peers
    waiting: deque[tuple[int, int]] = deque()  # ready tasks in the order they became ready
    free = cores

    def mix_ready(peer: int, parity: int) -> None:
        nonlocal order
        at = max(float(latest[peer, parity]), float(sent_by[peer]))
        heapq.heappush(events, (at, ready_event, order, mix_task, peer))
        order += 1

    while events:
        now, kind, _, task, i = heapq.heappop(events)
        r = peer_round[i]
        parity = r % 2
        if kind == ready_event:
            waiting.append((task, i))
        elif task == step_task:
            free += 1
            sent_by[i] = now + sends_out[i]
            arrivals = now + delays[i]
            for k, j in enumerate(neighbours[i].tolist()):
                latest[j, parity] = max(latest[j, parity], arrivals[k])
                awaited[j, parity] -= 1
                if awaited[j, parity] == 0 and peer_round[j] == r and sent_by[j] >= 0:
                    mix_ready(j, parity)
            if awaited[i, parity] == 0:
                mix_ready(i, parity)
        else:
            free += 1
            finish[r, i] = now
            awaited[i, parity] = degree[i]
            latest[i, parity] = 0.0
            sent_by[i] = -1.0
            peer_round[i] = r + 1
            if r + 1 < rounds:
                heapq.heappush(events, (now, ready_event, order, step_task, i))
                order += 1
        while free > 0 and waiting:
            task, j = waiting.popleft()
            rj = peer_round[j]
            length = (
                compute[rj, j] + costs.compress_s
                if task == step_task
                else degree[j] * costs.decompress_s
            )
            free -= 1
            heapq.heappush(events, (now + float(length), end_event, order, task, j))
            order += 1
    return finish


def _ring_allreduce(compute: np.ndarray, costs: PeerCosts, link: LinkCost) -> np.ndarray:
    """Per round: t_i(0) = end_i(r-1) + compute_i(r) + compress, then 2 (n - 1) steps
    t_i(s) = max(t_i(s-1), t_{i-1}(s-1)) + c with c = alpha + beta * bytes / n, and
    end_i(r) = t_i(2 (n - 1)) + decompress. Every path through the steps adds the same s * c, so
    t_i(s) = s * c + max over the s + 1 predecessors i, i-1, ..., i-s of t(0); after
    2 (n - 1) >= n - 1 steps that is every peer: all end together, behind the slowest."""
    rounds, peers = compute.shape
    steps = 2 * (peers - 1)
    chunk = link.latency_s + link.seconds_per_byte * costs.message_bytes / peers
    finish = np.empty((rounds, peers))
    end = np.zeros(peers)
    for r in range(rounds):
        start = end + compute[r] + costs.compress_s
        end = np.full(peers, float(start.max()) + steps * chunk + costs.decompress_s)
        finish[r] = end
    return finish
