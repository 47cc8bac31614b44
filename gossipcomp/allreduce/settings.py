"""The all-reduce mode's settings and their defaults, as fields only, and the names its flags
offer (syncs, models, data sets).

AllreduceConfig (train.py) is these fields, checked when a config is made, and the registries
behind the names (the models' builders) live beside the training loop, which needs torch. The
command line's flag tables (flags.py) read what is here, so `gossipcomp allreduce --help` loads
no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

SYNCS = ("ddp-hook", "merged", "marsit", "ssd", "diloco")  # diloco takes a spec (diloco.py)
# train.py's MODELS builds one under each name: mlp (the digits MLP), resmlp, resmlp-wide (the
# same 102 tensors, 256 wide: a backward long against one collective's fixed cost),
# chartransformer (for data set pysource)
MODEL_NAMES = ("mlp", "resmlp", "resmlp-wide", "chartransformer")
DATASETS = ("digits", "pysource")  # the models above are sized for these
THRESHOLD = "threshold"  # merged: groups of a fixed size (merged.threshold_groups), unplanned
MAX_CALIBRATION_STEPS = 100  # training steps under each probe plan (calibrate.py)
GATHER_AUTO, GATHER_WHOLE = "auto", "whole"  # --gather-pieces: measured (pieces.py), or whole
MAX_GATHER_PIECE_KIB = 1 << 20


def parse_gather_pieces(text: str) -> int | None:
    """--gather-pieces: None for "auto" (timed on the run's link, pieces.py), 0 for "whole",
    else the bytes of a piece from a whole number of KiB; ValueError naming what was given."""
    value = str(text).strip()
    if value == GATHER_AUTO:
        return None
    if value == GATHER_WHOLE:
        return 0
    if value.isascii() and value.isdecimal() and 1 <= int(value) <= MAX_GATHER_PIECE_KIB:
        return int(value) << 10
    raise ValueError(
        f"gather pieces {value[:32]!r}: expected {GATHER_AUTO}, {GATHER_WHOLE}, or the KiB of a "
        f"piece, a whole number from 1 to {MAX_GATHER_PIECE_KIB}"
    )


@dataclass(frozen=True)
class AllreduceSettings:
    """The fields of AllreduceConfig and their defaults, unchecked: build an AllreduceConfig
    to run."""

    sync: str = "ddp-hook"  # or a diloco spec
    compressor: str = "identity"
    planner: str = "mergecomp"  # merged: a gossipcomp.schedule planner, or "threshold"
    steps: int = 300
    lr: float = 0.1
    momentum: float = 0.9
    batch_size: int = 32
    seed: int = 0
    partition: str = "iid"
    eval_every: int = 0  # steps between accuracy checkpoints (0: only at the end)
    timeout_s: float = 30.0  # every collective; a dead rank is named within about this
    ssd_k: int = 5
    ssd_warmup: int = 50
    bucket_cap_mb: float = 25.0  # DDP bucket size
    model: str = "mlp"  # mlp (digits MLP), resmlp or resmlp-wide (102 parameter tensors)
    dataset: str = "digits"  # or pysource, for model chartransformer
    error_feedback: bool = True
    # merged with a planner: training steps under each probe plan (per-tensor, then single)
    # timed to price the plan (calibrate.py; they count among `steps`); 0: an idle link fit
    calibration_steps: int = 4
    # ddp-hook, merged with a compressor that all-gathers (top-k, ...): auto (whole or pieces,
    # as timed on the run's link: pieces.py), whole, or the KiB of a piece
    gather_pieces: str = GATHER_AUTO
