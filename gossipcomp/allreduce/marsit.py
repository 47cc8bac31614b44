"""Marsit (Wu et al. 2022): sign bits through a multi-hop ring all-reduce, one bit per element.

Plain one-bit compression inside a ring all-reduce re-compresses at every hop and the errors
cascade. Marsit keeps exactly one bit per element on the wire:
- reduce-scatter (N - 1 hops): the bits arriving at hop s stand for k = s + 1 workers; the
  receiver keeps each incoming bit with probability k / (k + 1) and otherwise puts its own sign
  (a bitwise select with a random mask). By induction every output bit is the sign of a worker
  drawn uniformly among the N, so its +-1 value is an unbiased estimate of the mean sign;
- all-gather (N - 1 hops): the finished chunks are forwarded as they are, never recompressed.
Chunks are whole bytes of the bit-packed sign plane (compress.bitpack), so a rank sends
2 (N - 1) / N of ceil(d / 8) bytes per step, 1/32 of a ring all-reduce of float32 (plus padding).

`MarsitSync` applies it to a model's whole gradient with momentum and compensation: each rank
keeps a velocity u <- beta u + g (beta = `momentum`; 0 gives u = g) and a compensation e (zero at
first), forms v = u + e, and all ranks apply the same update s * b, where b is the aggregated +-1
vector and s the mean over ranks of ||v||_1 / d (one float32 all-reduced per step); then
e <- v - s_own * sign(v), with s_own = this rank's ||v||_1 / d: what this rank meant minus what
its own bits stood for (error feedback of its own compression, as EF-SignSGD). The optimizer
then runs without momentum: the applied update is already the momentum step.

Why both (measured on digits, 4 ranks, 300 steps, lr 0.1): with the optimizer's momentum 0.9
applied after the sign update, accuracy fell to 0.19 (the compensation's delayed remainder is
replayed by the momentum ten times over). Moving the momentum before the signs was not enough
while the compensation was global (e <- v - s * b, the paper's rule as we had read it: 0.88,
oscillating): e_i - e_j then sums g_i - g_j over all steps, a random walk that grows until the
ranks' signs carry their own noise. With the rank's own compression compensated it reached
0.978 against 0.969 for plain all-reduce with momentum 0.9 (docs/benchmarks.md).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from gossipcomp.allreduce.agreement import check_model_sync
from gossipcomp.allreduce.comm import Communicator
from gossipcomp.compress import CompressionContext, bitpack
from gossipcomp.compress.flat import FlatLayout
from gossipcomp.inputs.numbers import checked_number


def chunk_bounds(plane_bytes: int, world: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of the N ring chunks of a plane (sizes differ by at most 1)."""
    base, extra = divmod(plane_bytes, world)
    bounds, start = [], 0
    for c in range(world):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def marsit_allreduce(
    negative: torch.Tensor, communicator: Communicator, generator: torch.Generator
) -> torch.Tensor:
    """The aggregated sign bits (True: negative) of every rank's 1-D bool `negative`.

    `generator` (on the tensors' device) draws this rank's keep/replace masks; give every rank
    its own stream.
    """
    comm, world, rank = communicator, communicator.world, communicator.rank
    numel = negative.numel()
    own = bitpack.pack(negative.view(-1), 1)
    if world == 1:
        return negative.clone()
    bounds = chunk_bounds(own.numel(), world)
    current = own.clone()  # the chunks as this rank holds them (reduced so far / gathered)
    right, left = (rank + 1) % world, (rank - 1) % world
    for hop in range(world - 1):
        send_chunk, recv_chunk = (rank - hop) % world, (rank - hop - 1) % world
        start, end = bounds[recv_chunk]
        incoming = torch.empty(end - start, dtype=torch.uint8, device=own.device)
        comm.exchange(current[slice(*bounds[send_chunk])].clone(), right, incoming, left)
        workers = hop + 1  # incoming bits stand for this many workers
        take_own = torch.rand(8 * (end - start), generator=generator, device=own.device)
        mask = bitpack.pack(take_own < 1.0 / (workers + 1), 1)
        current[start:end] = (incoming & ~mask) | (own[start:end] & mask)
    for hop in range(world - 1):
        send_chunk, recv_chunk = (rank + 1 - hop) % world, (rank - hop) % world
        start, end = bounds[recv_chunk]
        incoming = torch.empty(end - start, dtype=torch.uint8, device=own.device)
        comm.exchange(current[slice(*bounds[send_chunk])].clone(), right, incoming, left)
        current[start:end] = incoming
    return bitpack.unpack(current, 1, numel).bool()


class MarsitSync:
    """Marsit over all of a model's gradients, with momentum and compensation (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        communicator: Communicator,
        seed: int = 0,
        momentum: float = 0.0,
    ) -> None:
        checked_number("marsit momentum", momentum, 0.0, 1.0, closed_high=False)
        check_model_sync(communicator, "MarsitSync", model, seed=seed, momentum=momentum)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layout = FlatLayout.of(self.params)
        self.communicator = communicator
        self.seed = seed
        self.momentum = momentum
        self.compensation = torch.zeros(self.layout.numel, device=self.params[0].device)
        self.velocity = torch.zeros_like(self.compensation)
        self.round = 0
        self.wait_seconds = 0.0

    def synchronize(self) -> None:
        """Replace every .grad by the applied update s * b (call after backward)."""
        start = time.perf_counter()
        comm = self.communicator
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        v = self.layout.pack(grads)
        if self.momentum:
            self.velocity.mul_(self.momentum).add_(v)
            v.copy_(self.velocity)
        v.add_(self.compensation)
        own = (v.abs().sum() / max(1, v.numel())).view(1)
        negative = v < 0
        torch.sub(v, torch.where(negative, -own, own), out=self.compensation)
        scale = own.clone()
        comm.all_reduce_sum(scale)
        scale /= comm.world
        ctx = CompressionContext(self.seed, comm.rank, -1, self.round, 0)
        bits = marsit_allreduce(negative, comm, ctx.generator(v.device))
        applied = torch.where(bits, -scale, scale)
        for p, view in zip(self.params, self.layout.views(applied), strict=True):
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
        self.round += 1
        self.wait_seconds += time.perf_counter() - start
