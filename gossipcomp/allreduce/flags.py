"""The flags of `gossipcomp allreduce` (command.py runs it). Their names and defaults come from
settings.py, so building this parser (`gossipcomp allreduce --help`) loads no torch."""

from __future__ import annotations

import argparse

from gossipcomp.allreduce.settings import (
    DATASETS,
    MAX_CALIBRATION_STEPS,
    MODEL_NAMES,
    SYNCS,
    AllreduceSettings,
)
from gossipcomp.inputs.arguments import (
    OptimizerFlags,
    Setting,
    add_optimizer_flags,
    add_report_flags,
    integer,
    number,
)

MAX_NPROC = 64
MAX_STEPS = 1_000_000
MAX_TIMEOUT_S = 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `gossipcomp allreduce`."""
    d = AllreduceSettings()
    parser.add_argument(
        "--nproc",
        type=integer("nproc", 1, MAX_NPROC),
        help="start this many local processes (default: be one rank of a torchrun job)",
    )
    parser.add_argument(
        "--sync",
        default=d.sync,
        help=f"how the ranks are kept in step: {', '.join(SYNCS[:-1])} (every step), or "
        "diloco[:steps=H,outer=(nesterov:lr=0.7,momentum=0.9),compressor=(SPEC)]: H local "
        "steps, then compressed, error-fed pseudo-gradients averaged and an outer step",
    )
    parser.add_argument(
        "--compressor",
        default=d.compressor,
        help="ddp-hook, merged: compressor spec (topk:ratio=0.01, sign, fp16, ...); ddp-hook "
        "also powersgd:rank=R and torch's own torch:allreduce, torch:fp16, torch:powersgd:rank=R",
    )
    parser.add_argument(
        "--planner",
        default=d.planner,
        help="merged: per-tensor, single, mgwfbp, mergecomp, strategy[:candidates=...], threshold",
    )
    parser.add_argument("--steps", type=integer("steps", 1, MAX_STEPS), default=d.steps)
    parser.add_argument(
        "--calibration-steps",
        type=integer("calibration-steps", 0, MAX_CALIBRATION_STEPS),
        default=d.calibration_steps,
        help="merged with a planner: steps under each probe plan (per-tensor, single) timed to "
        "price the plan, counted in --steps (0: price it on an idle link fit)",
    )
    parser.add_argument(
        "--gather-pieces",
        default=d.gather_pieces,
        help="ddp-hook, merged, with a compressor whose payloads are all-gathered (topk, ...): "
        "auto (whole all_gathers or pieces of 8, 16 or 64 KiB, whichever is faster on this "
        "run's link, timed at start), whole, or the KiB of a piece",
    )
    optimizer = OptimizerFlags(
        lr=Setting(d.lr, 10.0),
        momentum=Setting(d.momentum, 0.999),
        batch_size=Setting(d.batch_size, 1 << 16),
        partition=Setting(d.partition, None, "iid | by-label | dirichlet:ALPHA"),
        seed=Setting(d.seed, 2**62),
    )
    add_optimizer_flags(parser, optimizer)
    parser.add_argument(
        "--eval-every",
        type=integer("eval every", 0, MAX_STEPS),
        default=50,  # a history by default, for `gossipcomp plot` (like simulate)
        help="steps between accuracy checkpoints (0: only at the end)",
    )
    parser.add_argument(
        "--timeout",
        type=number("timeout (seconds)", 0.0, MAX_TIMEOUT_S),
        default=d.timeout_s,
        help="seconds a collective may take; a dead rank is named within about this",
    )
    parser.add_argument(
        "--ssd-k",
        type=integer("ssd k", 1, MAX_STEPS),
        default=d.ssd_k,
        help="ssd: steps between pulls of the global model",
    )
    parser.add_argument(
        "--ssd-warmup",
        type=integer("ssd warmup", 0, MAX_STEPS),
        default=d.ssd_warmup,
        help="ssd: synchronous steps first",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=number("bucket cap (MB)", 0.0, 1024.0),
        default=d.bucket_cap_mb,
        help="ddp-hook: DDP bucket size",
    )
    parser.add_argument("--model", default=d.model, choices=sorted(MODEL_NAMES))
    parser.add_argument(
        "--dataset",
        default=d.dataset,
        choices=DATASETS,
        help="digits, or pysource (the Python standard library's source) for model chartransformer",
    )
    parser.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="ddp-hook, merged: send the compressed gradient without memory",
    )
    add_report_flags(parser, "write the JSON report here", "no summary table")
