"""All-reduce mode on torch.distributed: gossipcomp's compressors for DDP and torchrun users.

- `register(ddp, "topk:ratio=0.01")` / `register(ddp, "powersgd:rank=2")`: DDP communication
  hooks with error feedback and name-keyed state (hooks.py); `half_wrapper` composes fp16 with any.
- `MergedSync`: merged, overlapped gradient sync in planned groups (merged.py).
- `MarsitSync` / `marsit_allreduce`: one sign bit per element through a ring (marsit.py).
- `SSDSGD`: several steps of delay with local updates in between (ssd.py).
- `DiLoCoSync`: phases of local steps ended by compressed, error-fed pseudo-gradients and an
  outer optimizer step (diloco.py; `--sync diloco:...`).
- `init_from_env` (torchrun) and `spawn` (local processes), with dead ranks named (launch.py).

Each public name is imported from its module on first use (PEP 562): `gossipcomp allreduce
--help` reads settings.py and flags.py without loading torch.distributed.
"""

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.allreduce.comm": "Communicator Traffic",
    "gossipcomp.allreduce.diloco": "DiLoCoSpec DiLoCoSync parse_diloco",
    "gossipcomp.allreduce.hooks": (
        "CompressedState PowerSGDState compressed_hook half_wrapper powersgd_hook register"
    ),
    "gossipcomp.allreduce.launch": "LaunchError Session init_from_env spawn",
    "gossipcomp.allreduce.liveness": "RankFailure",
    "gossipcomp.allreduce.marsit": "MarsitSync marsit_allreduce",
    "gossipcomp.allreduce.merged": "MergedSync threshold_groups",
    "gossipcomp.allreduce.ssd": "SSDSGD",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
