"""All-reduce mode on torch.distributed: gossipcomp's compressors for DDP and torchrun users.

- `register(ddp, "topk:ratio=0.01")` / `register(ddp, "powersgd:rank=2")`: DDP communication
  hooks with error feedback and name-keyed state (hooks.py); `half_wrapper` composes fp16 with any.
- `MergedSync`: merged, overlapped gradient sync in planned groups (merged.py).
- `MarsitSync` / `marsit_allreduce`: one sign bit per element through a ring (marsit.py).
- `SSDSGD`: several steps of delay with local updates in between (ssd.py).
- `DiLoCoSync`: phases of local steps ended by compressed, error-fed pseudo-gradients and an
  outer optimizer step (diloco.py; `--sync diloco:...`).
- `init_from_env` (torchrun) and `spawn` (local processes), with dead ranks named (launch.py).
"""

from gossipcomp.allreduce.comm import Communicator, Traffic
from gossipcomp.allreduce.diloco import DiLoCoSpec, DiLoCoSync, parse_diloco
from gossipcomp.allreduce.hooks import (
    CompressedState,
    PowerSGDState,
    compressed_hook,
    half_wrapper,
    powersgd_hook,
    register,
)
from gossipcomp.allreduce.launch import LaunchError, Session, init_from_env, spawn
from gossipcomp.allreduce.liveness import RankFailure
from gossipcomp.allreduce.marsit import MarsitSync, marsit_allreduce
from gossipcomp.allreduce.merged import MergedSync, threshold_groups
from gossipcomp.allreduce.ssd import SSDSGD

__all__ = [
    "SSDSGD",
    "Communicator",
    "CompressedState",
    "DiLoCoSpec",
    "DiLoCoSync",
    "LaunchError",
    "MarsitSync",
    "MergedSync",
    "PowerSGDState",
    "RankFailure",
    "Session",
    "Traffic",
    "compressed_hook",
    "half_wrapper",
    "init_from_env",
    "marsit_allreduce",
    "parse_diloco",
    "powersgd_hook",
    "register",
    "spawn",
    "threshold_groups",
]
