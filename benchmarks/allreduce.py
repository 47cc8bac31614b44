"""All-reduce mode side by side: bytes, step time and accuracy of every synchroniser on digits.

Run: python benchmarks/allreduce.py --json docs/allreduce.json
N gloo processes (default 4) on this machine train the digits MLP (85k parameters, 340 KB: one
DDP bucket, where torch's PowerSGD hook works) with each method in turn, in the same processes:
torch's plain all-reduce, fp16 and PowerSGD hooks; gossipcomp's PowerSGD, top-k and sign hooks;
SSD-SGD; and Marsit next to plain all-reduce at the same optimizer (lr 0.1 without momentum:
sign updates overshoot under momentum 0.9). Bytes are per rank per step: payload (what the rank
hands to collectives) and link (what the ring algorithm sends from it; exact for Marsit's
point-to-point hops), after the first five steps (torch's PowerSGD hook starts with two steps
of plain all-reduce). Step time: the median wall time of a step after the first five, median
over ranks and over `--repeats` rounds (the methods run in turn in each round, so a busy
machine slows all of them alike). Ratios: powersgd_vs_torch_time = ours / torch's (same rank,
error feedback and warm start on both); marsit_accuracy_gap = plain - Marsit (same optimizer);
marsit_bytes_ratio = Marsit's link bytes / plain all-reduce's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from allreduce_runs import machine, run_configs, show, summarise
from results import save

from gossipcomp.allreduce.launch import spawn
from gossipcomp.allreduce.train import AllreduceConfig

RANK = 2


def methods(steps: int) -> dict[str, AllreduceConfig]:
    base = AllreduceConfig(steps=steps)
    plain0 = replace(base, momentum=0.0)
    return {
        "allreduce": replace(base, compressor="torch:allreduce"),
        "torch fp16": replace(base, compressor="torch:fp16"),
        "torch powersgd": replace(base, compressor=f"torch:powersgd:rank={RANK}"),
        "powersgd": replace(base, compressor=f"powersgd:rank={RANK}"),
        "topk": replace(base, compressor="topk:ratio=0.01"),
        "sign": replace(base, compressor="sign"),
        "ssd": replace(base, sync="ssd", ssd_k=5, ssd_warmup=min(50, steps // 6)),
        "allreduce (no momentum)": replace(plain0, compressor="torch:allreduce"),
        "marsit (no momentum)": replace(plain0, sync="marsit"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    configs = methods(args.steps)
    ranks = spawn(run_configs, args.nproc, (configs, args.repeats), timeout_s=60, deadline_s=3600)
    table = summarise(ranks, configs)
    plain, plain0 = table["allreduce"], table["allreduce (no momentum)"]
    marsit = table["marsit (no momentum)"]
    result = {
        "nproc": args.nproc,
        "steps": args.steps,
        "repeats": args.repeats,
        "powersgd_rank": RANK,
        "methods": table,
        "powersgd_vs_torch_time": table["powersgd"]["step_ms"] / table["torch powersgd"]["step_ms"],
        "powersgd_accuracy": table["powersgd"]["accuracy"],
        "torch_powersgd_accuracy": table["torch powersgd"]["accuracy"],
        "marsit_accuracy_gap": plain0["accuracy"] - marsit["accuracy"],
        "marsit_bytes_ratio": marsit["link_bytes_per_step"] / plain0["link_bytes_per_step"],
        "ssd_accuracy_gap": plain["accuracy"] - table["ssd"]["accuracy"],
        "machine": machine(),
    }
    console = show(f"all-reduce on digits, {args.nproc} gloo ranks, {args.steps} steps", table)
    console.print(
        f"powersgd_vs_torch_time {result['powersgd_vs_torch_time']:.3f}, "
        f"marsit_accuracy_gap {result['marsit_accuracy_gap']:+.4f}, "
        f"marsit_bytes_ratio {result['marsit_bytes_ratio']:.5f} (1/32 = 0.03125)"
    )
    save(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
