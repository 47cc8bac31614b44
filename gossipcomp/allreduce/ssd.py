"""SSD-SGD (arXiv 2012.05396): several steps of delay between pulls of the global model.

A wrapper around a torch optimizer over the model's parameters. The rule implemented:
- warm-up (the first `warmup` steps): synchronous SGD: gradients averaged over ranks with one
  all-reduce, then `optimizer.step()`;
- delay stage: every step, this rank's gradient g_t (taken at its local weights w_t) goes into an
  asynchronous all-reduce and the rank moves on at once with the local update (GLU):
      w_{t+1} = w_t - lr * (g_t + c),   c = G_last - g_last,
  where G_last is the newest global (averaged) gradient that has arrived and g_last this rank's
  own gradient of that step (c = 0 before any has arrived): the local step is corrected by how far
  the rank's gradient was from the average the last time both were known. Every k-th step of the
  stage the rank pulls the global model: it waits for the pending all-reduces and applies their
  averaged gradients in order to the global model x with the wrapped optimizer (whose state,
  momentum included, belongs to x), then sets w = x.
With k = 1 every step pulls at once: w = x and x takes exactly synchronous SGD's step, so the run
equals synchronous SGD bit for bit. The global model is the same on every rank (same averaged
gradients, same optimizer); local weights differ between pulls.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from gossipcomp.allreduce.comm import Communicator
from gossipcomp.compress.flat import FlatLayout


class SSDSGD:
    """`step()` after backward instead of `optimizer.step()` (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        communicator: Communicator,
        k: int,
        warmup: int,
        local_lr: float | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"ssd k: expected steps between pulls >= 1, got {k}")
        if warmup < 0:
            raise ValueError(f"ssd warmup: expected steps >= 0, got {warmup}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layout = FlatLayout.of(self.params)
        self.optimizer, self.communicator = optimizer, communicator
        self.k, self.warmup = k, warmup
        self.local_lr = float(optimizer.param_groups[0]["lr"]) if local_lr is None else local_lr
        self.global_model = self.layout.pack([p.detach() for p in self.params])
        self.correction = torch.zeros_like(self.global_model)
        self._pending: list[tuple[torch.distributed.Work, torch.Tensor, torch.Tensor]] = []
        self.steps = 0
        self.wait_seconds = 0.0

    def step(self) -> None:
        grads = self.layout.pack(
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        )
        self.steps += 1
        if self.steps <= self.warmup:
            start = time.perf_counter()
            self.communicator.all_reduce_sum(grads)
            self.wait_seconds += time.perf_counter() - start
            self._global_step(grads.div_(self.communicator.world))
            return
        summed = grads.clone()
        self._pending.append((self.communicator.all_reduce_async(summed), summed, grads))
        with torch.no_grad():
            local = grads.add(self.correction)
            for p, view in zip(self.params, self.layout.views(local), strict=True):
                p.add_(view, alpha=-self.local_lr)
        if (self.steps - self.warmup) % self.k == 0:
            self.pull()

    def pull(self) -> None:
        """Wait for the pending global gradients, apply them to x in order, set w = x."""
        if not self._pending:
            return
        start = time.perf_counter()
        with torch.no_grad():
            self.layout.unpack(self.global_model, self.params)
        for work, summed, own in self._pending:
            work.wait()
            average = summed.div_(self.communicator.world)
            for p, view in zip(self.params, self.layout.views(average), strict=True):
                p.grad = view.view_as(p).clone()
            self.optimizer.step()
            torch.sub(average, own, out=self.correction)
        self._pending.clear()
        self.layout.pack([p.detach() for p in self.params], out=self.global_model)
        self.wait_seconds += time.perf_counter() - start

    def _global_step(self, average: torch.Tensor) -> None:
        for p, view in zip(self.params, self.layout.views(average), strict=True):
            p.grad = view.view_as(p).clone()
        self.optimizer.step()
        self.layout.pack([p.detach() for p in self.params], out=self.global_model)
