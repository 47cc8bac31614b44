"""SSD-SGD (arXiv 2012.05396): several steps of delay between pulls of the global model.

A wrapper around a torch optimizer over the model's parameters. The rule implemented:
- warm-up (the first `warmup` steps): synchronous SGD: gradients averaged over ranks with one
  all-reduce, then `optimizer.step()`;
- delay stage: every step, this rank's gradient g_t (taken at its local weights w_t) goes into an
  asynchronous all-reduce and the rank moves on at once with the local update (GLU): the wrapped
  optimizer's own rule applied to w with g_t, continuing from the global model's optimizer state
  as of the last pull. That state (the momentum) is built from global gradients only, so the
  latest global gradients steer the local steps and make up for the delayed local weights.
  (Measured on digits, 4 ranks, k = 5: adding the last known gap G - g between the global and
  the local gradient as a correction diverged, 0.10 accuracy: it is one step's noise, doubled.)
  Every k-th step of the stage the rank pulls the global model: it waits for the pending
  all-reduces and applies their averaged gradients in order to the global model x with the
  optimizer in the global state, then sets w = x.
With k = 1 every step pulls at once: w = x and x takes exactly synchronous SGD's step, so the run
equals synchronous SGD bit for bit. The global model is the same on every rank (same averaged
gradients, same optimizer); local weights differ between pulls.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossipcomp.allreduce.agreement import check_model_sync
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
    ) -> None:
        if k < 1:
            raise ValueError(f"ssd k: expected steps between pulls >= 1, got {k}")
        if warmup < 0:
            raise ValueError(f"ssd warmup: expected steps >= 0, got {warmup}")
        check_model_sync(communicator, "SSDSGD", model, k=k, warmup=warmup, optimizer=optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layout = FlatLayout.of(self.params)
        self.optimizer, self.communicator = optimizer, communicator
        self.k, self.warmup = k, warmup
        self.global_model = self.layout.pack([p.detach() for p in self.params])
        self._global_state: dict[str, Any] | None = None  # optimizer state of x, when w != x
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
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
            self._apply(grads.div_(self.communicator.world))
            self.layout.pack([p.detach() for p in self.params], out=self.global_model)
            return
        if self._global_state is None:
            self._global_state = copy.deepcopy(self.optimizer.state_dict())
        summed = grads.clone()
        self._pending.append((self.communicator.all_reduce_async(summed), summed))
        self._apply(grads)  # GLU on the local weights
        if (self.steps - self.warmup) % self.k == 0:
            self.pull()

    def pull(self) -> None:
        """Wait for the pending global gradients, apply them to x in order, set w = x."""
        if not self._pending or self._global_state is None:
            return
        start = time.perf_counter()
        with torch.no_grad():
            self.layout.unpack(self.global_model, self.params)
        self.optimizer.load_state_dict(self._global_state)
        for work, summed in self._pending:
            work.wait()
            self._apply(summed.div_(self.communicator.world))
        self._pending.clear()
        self._global_state = copy.deepcopy(self.optimizer.state_dict())
        self.layout.pack([p.detach() for p in self.params], out=self.global_model)
        self.wait_seconds += time.perf_counter() - start

    def _apply(self, gradient: torch.Tensor) -> None:
        """One optimizer step with `gradient` (flat) as every parameter's .grad."""
        for p, view in zip(self.params, self.layout.views(gradient), strict=True):
            p.grad = view.view_as(p).clone()
        self.optimizer.step()
