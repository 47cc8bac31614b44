"""One collective at a time on the shaped hub: how long it takes against its bytes' wire time,
and how far apart the ranks come out of it.

Why: on the shaped NICs of benchmarks/allreduce_merge.py, top-k's merged all-reduce (an
all_gather of each group's payload) never overlapped its backward, where the all_reduce of
identity and sign did. The steps' timelines showed one rank ending each step about 30 ms
before the other, then waiting that long in its next step's first collective, however small.
This measures the collectives alone: ranks that sleep (a step's compute, the link idle), then
run one collective of `--kib` each, `--steps` times (all_gather_pieces: the same bytes as
all_gathers of at most `--piece-kib` each, one after the other). Per kind: the median duration, the wire
time of the bytes one rank sends (what a full-duplex NIC needs), and the median of rank 1's
end minus rank 0's (ranks that stay in step end together).

    python benchmarks/collective_skew.py --mbit 14.7 --kib 110 --steps 40 --json skew.json

Needs root (network namespaces, tc): it builds the hub of benchmarks/shaped_hub.py and tears
it down.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from shaped_hub import ShapedHub, run_ranks

from gossipcomp.allreduce.comm import Communicator

# exchange: one isend and one irecv at once; all_gather_pieces: all_gathers of --piece-kib each
KINDS = ("all_reduce", "all_gather", "all_gather_pieces", "exchange")
WARMUP = 3  # collectives before the ones counted (connections, slow start)


def collectives(
    _session: object, kind: str, nbytes: int, steps: int, gap_s: float, piece_bytes: int
) -> list:
    """This rank's (start, end) monotonic times of `steps` collectives of `kind`."""
    torch.set_num_threads(1)
    payload = torch.zeros(nbytes // 4)  # float32: what each rank sends
    other = 1 - dist.get_rank()
    gather = Communicator()  # the all_gathers the hooks and MergedSync run, whole or pieced
    gather.gather_piece_bytes = piece_bytes if kind == "all_gather_pieces" else None
    times = []
    for _ in range(WARMUP + steps):
        time.sleep(gap_s)
        start = time.monotonic()
        if kind == "all_reduce":
            dist.all_reduce(payload)
        elif kind in ("all_gather", "all_gather_pieces"):
            gather.all_gather(payload)
        else:
            received = torch.empty_like(payload)
            ops = [dist.P2POp(dist.isend, payload, other), dist.P2POp(dist.irecv, received, other)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        times.append((start, time.monotonic()))
    gather.close()
    return times[WARMUP:]


def measure(
    kind: str, mbit: float, nbytes: int, steps: int, gap_s: float, piece_bytes: int
) -> dict[str, float]:
    with ShapedHub(2, mbit) as hub:
        arguments = (kind, nbytes, steps, gap_s, piece_bytes)
        first, second = run_ranks(hub, collectives, arguments, timeout_s=60)
    wire_ms = nbytes * 8 / (mbit * 1e6) * 1e3
    duration = statistics.median((end - start) * 1e3 for start, end in first)
    skew = [(b[1] - a[1]) * 1e3 for a, b in zip(first, second, strict=True)]
    return {
        "duration_ms": duration,
        "wire_ms": wire_ms,
        "duration_over_wire": duration / wire_ms,
        "end_skew_ms": statistics.median(skew),
        "end_skew_abs_max_ms": max(abs(s) for s in skew),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=14.7, help="each NIC's rate, each way")
    parser.add_argument("--kib", type=int, default=110, help="bytes each rank sends, KiB")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=40.0, help="idle time before each")
    parser.add_argument("--piece-kib", type=int, default=16, help="all_gather_pieces' pieces")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.kib, args.steps, args.piece_kib) < 1 or args.gap_ms < 0:
        parser.error("--kib, --steps, --piece-kib: expected at least 1; --gap-ms: expected >= 0")
    results = {}
    for kind in args.kinds:
        r = results[kind] = measure(
            kind, args.mbit, args.kib << 10, args.steps, args.gap_ms / 1e3, args.piece_kib << 10
        )
        print(
            f"{kind:10} {r['duration_ms']:7.1f} ms, wire {r['wire_ms']:.1f} ms "
            f"({r['duration_over_wire']:.2f}x), rank 1 ends {r['end_skew_ms']:+.1f} ms after rank 0"
        )
    if args.json:
        report = {"mbit": args.mbit, "kib": args.kib, "piece_kib": args.piece_kib}
        report |= {"steps": args.steps, "kinds": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
