"""torch's own DDP hooks (all-reduce, fp16, PowerSGD), for side-by-side comparisons.

Their bytes are counted by wrapping `torch.distributed.all_reduce` while they run (they call it
through the module), with the same accounting as `comm.Traffic`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce.comm import Traffic, tensor_bytes

REFERENCES = ("torch:allreduce", "torch:fp16", "torch:powersgd")


def register_reference(
    ddp: DistributedDataParallel,
    spec: str,
    *,
    error_feedback: bool = True,
    warm_start: bool = True,
) -> object:
    """Install torch's hook "torch:allreduce", "torch:fp16" or "torch:powersgd:rank=R"."""
    name, _, rest = spec.partition(":rank=")
    if name == "torch:allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return None
    if name == "torch:fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if name == "torch:powersgd":
        try:
            rank = int(rest or "1")
        except ValueError:
            raise ValueError(f"{spec!r}: rank must be an integer") from None
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2 if (error_feedback or warm_start) else 1,
            use_error_feedback=error_feedback,
            warm_start=warm_start,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    raise ValueError(f"unknown reference hook {spec!r}; known: {', '.join(REFERENCES)}")


@contextlib.contextmanager
def counted(traffic: Traffic, world: int) -> Iterator[None]:
    """Count every torch.distributed.all_reduce made inside into `traffic`."""
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        nbytes = tensor_bytes(tensor)
        traffic.payload_bytes += nbytes
        traffic.link_bytes += 2 * (world - 1) / world * nbytes
        traffic.collectives += 1
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_reduce = original
