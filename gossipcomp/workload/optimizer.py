"""torch's SGD, without importing torch._dynamo.

Every method of `torch.optim.Optimizer` that a training loop calls (`add_param_group` from the
constructor, `zero_grad`, `state_dict`, `load_state_dict`, and SGD's `step`) imports
torch._dynamo on first use, to keep the compiler out of it. That import is no part of training
here and costs as much as importing torch itself: 2.0-2.4 s on a 2-core machine (2026-11-27),
paid by every peer process, every `gossipcomp simulate` and every test that starts one; 22 ms a
round of a 100-round ring8 simulate's report (docs/benchmarks.md, "Engine: the compiler's
start-up import").

`SGD` is torch.optim.SGD (same constructor, hyper-parameters, state_dict layout, and an
`isinstance` of torch.optim.Optimizer for LR schedulers and the code that checks for one), with
those methods called past the decorator that imports the compiler (where a torch release does
not expose it, the decorated method runs as before: slower to start, same result), and a step
that applies torch's single-tensor SGD rule itself (weight decay, momentum with dampening,
Nesterov, maximize), the path torch takes for CPU tensors, so the updates are the same to the
bit (tests/test_optimizer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _undecorated(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` without torch's dynamo-disabling wrapper (functools.wraps keeps it as
    `__wrapped__`), or `method` itself where there is none."""
    return getattr(method, "__wrapped__", method)


_ADD_PARAM_GROUP = _undecorated(torch.optim.Optimizer.add_param_group)
_ZERO_GRAD = _undecorated(torch.optim.Optimizer.zero_grad)
_STATE_DICT = _undecorated(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = _undecorated(torch.optim.Optimizer.load_state_dict)


class SGD(torch.optim.SGD):
    """torch.optim.SGD that never imports torch._dynamo (module docstring). Dense gradients,
    one tensor at a time: `differentiable`, `foreach` and `fused` are refused."""

    def __init__(self, params: Any, **options: Any) -> None:
        for option in ("differentiable", "foreach", "fused"):
            if options.get(option):
                raise ValueError(
                    f"SGD: {option}={options[option]!r}: expected False or None (this SGD "
                    f"steps one tensor at a time; torch.optim.SGD has {option})"
                )
        super().__init__(params, **options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _LOAD_STATE_DICT(self, state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One SGD update of every parameter with a gradient; `closure` re-evaluates the loss
        first (with gradients enabled), as torch's does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr
            dampening, weight_decay = group["dampening"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if not group["maximize"] else -param.grad
                if weight_decay != 0:
                    grad = grad.add(param, alpha=weight_decay)
                if momentum != 0:
                    state = self.state[param]
                    buffer = state.get("momentum_buffer")
                    if buffer is None:
                        buffer = grad.detach().clone()
                        state["momentum_buffer"] = buffer
                    else:
                        buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
                    grad = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
                param.add_(grad, alpha=-lr)
        return loss
