"""Round-trip speed of every compressor on one big float32 tensor, as a ratio to a plain copy.

Run: python benchmarks/compressors.py --json docs/compressors.json
For each spec: compress, decompress and the round trip (compress then decompress) of a
16M-element float32 CPU tensor. A plain `dst.copy_(src)` of the same tensor (preallocated
destination) is timed right before them in every trial, since this machine is noisy; each ratio
is copy time / operation time, i.e. the operation's throughput relative to a copy (1.0: as fast
as a copy, 0.5: twice as long; higher is better), the median over trials after one warm-up
trial. Uses torch's default thread count (recorded in the JSON; the compressors' CPU passes use
as many threads).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results import save
from rich.console import Console
from rich.table import Table

from gossipcomp.compress import COMPRESSORS, CompressionContext, parse_spec

EXTRA_SPECS = (
    "topk:ratio=0.01",
    "randomk:ratio=0.01",
    "randomk:ratio=0.01,unbiased=true",
    "dgc:ratio=0.001",
    "ef+topk:ratio=0.01",
    "ef+sign",
)


def default_specs() -> list[str]:
    """Every registered compressor with its defaults, then the extra settings (no repeats)."""
    specs = [COMPRESSORS[name]().spec for name in COMPRESSORS]
    for spec in EXTRA_SPECS:
        canonical = parse_spec(spec).spec
        if canonical not in specs:
            specs.append(canonical)
    return specs


def seconds(operation: Callable[[], object]) -> float:
    start = time.perf_counter()
    operation()
    return time.perf_counter() - start


def measure(spec: str, source: torch.Tensor, trials: int, copy: Callable[[], object]) -> dict:
    """Per trial, back to back: a copy, a compress, a decompress, a round trip; ratios per trial.

    Interleaving keeps each ratio's two timings seconds apart on this noisy machine; the
    reported ratios and times are medians over trials, after one discarded warm-up trial.
    """
    compressor = parse_spec(spec)
    ctx = CompressionContext(seed=0, sender=0, receiver=1, round=0, tensor_index=0)
    payload = compressor.compress(source, ctx)
    operations = {
        "copy": copy,
        "compress": lambda: compressor.compress(source, ctx),
        "decompress": lambda: compressor.decompress(payload, ctx),
        "roundtrip": lambda: compressor.decompress(compressor.compress(source, ctx), ctx),
    }
    times: dict[str, list[float]] = {name: [] for name in operations}
    for trial in range(trials + 1):
        for name, operation in operations.items():
            elapsed = seconds(operation)
            if trial:
                times[name].append(elapsed)
    result: dict = {"spec": spec}
    for name in operations:
        result[f"{name}_seconds"] = statistics.median(times[name])
    for name in ("roundtrip", "compress", "decompress"):
        ratios = [c / t for c, t in zip(times["copy"], times[name], strict=True)]
        result[f"{name}_ratio"] = statistics.median(ratios)
    wire = compressor.wire_bytes(source.numel())
    result["wire_bytes"] = wire
    result["compression_factor"] = 4 * source.numel() / wire
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--specs", nargs="*", help="specs to time (default: all, see EXTRA_SPECS)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--threads", type=int, help="torch.set_num_threads first (default: torch's default)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    source = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    destination = torch.empty_like(source)

    def copy() -> torch.Tensor:
        return destination.copy_(source)

    load_before = os.getloadavg()[0]
    results = []
    console = Console()
    for spec in args.specs or default_specs():
        results.append(measure(spec, source, args.trials, copy))
        console.log(f"{spec}: round trip {results[-1]['roundtrip_ratio']:.3f}x copy")
    copy_seconds = statistics.median(r["copy_seconds"] for r in results)

    table = Table(title=f"{args.numel:,} float32 elements; ratio = copy time / op time")
    for column in ("spec", "round trip", "compress", "decompress", "wire bytes", "factor"):
        table.add_column(column, justify="left" if column == "spec" else "right")
    for r in results:
        table.add_row(
            r["spec"],
            f"{r['roundtrip_ratio']:.3f}",
            f"{r['compress_ratio']:.3f}",
            f"{r['decompress_ratio']:.3f}",
            f"{r['wire_bytes']:,}",
            f"{r['compression_factor']:.1f}",
        )
    console.print(table)
    console.print(
        f"copy: {copy_seconds * 1e3:.2f} ms median; torch threads {torch.get_num_threads()}"
    )

    if args.json:
        report = {
            "command": "python benchmarks/compressors.py " + " ".join(argv or sys.argv[1:]),
            "numel": args.numel,
            "trials": args.trials,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "load_average_1min": [load_before, os.getloadavg()[0]],  # other work on the machine
            "copy_seconds": copy_seconds,
            "results": results,
        }
        save(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
