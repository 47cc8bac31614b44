"""Soak: 16 peers in one process gossiping over gRPC for thousands of rounds.

Run: python benchmarks/soak.py --rounds 2000 --json docs/soak.json
torus16, a small float64 MLP, exact gossip (D-PSGD). Every round each peer first adds a known
perturbation (a stand-in for its local step), so every message differs. Checked at the end:
- no lost messages: no exchange failed anywhere;
- no misapplied messages: exact gossip keeps the network sum, so the sum of all peers'
  parameters must equal the initial sum plus every perturbation added (float64, to 1e-9);
- no leaks: threads, open sockets and resident memory after the run against after warm-up
  (resident memory growth must stay under 10%).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time
from pathlib import Path

import torch
from rich.console import Console

from gossipcomp.gossip import DPSGD
from gossipcomp.peer import Peer
from gossipcomp.topology import load_topology
from gossipcomp.workload.models import build_mlp

ROOT = Path(__file__).resolve().parent.parent


def resources() -> dict[str, int]:
    """Threads, open sockets and resident memory (KiB) of this process, from /proc."""
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    rss = next(
        int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")
    )
    return {"threads": len(os.listdir("/proc/self/task")), "sockets": sockets, "rss_kib": rss}


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h, glibc 2.33 and later): byte counts of the heap."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_counts() -> dict[str, int]:
    """glibc's own counts of the heap: `heap_in_use_kib` (blocks malloc has handed out and not
    had back, mmapped ones included) and `heap_free_kib` (freed memory its arenas keep). The
    transport has glibc keep up to 64 MiB of free heap per arena on purpose
    (gossipcomp/transport/allocator.py), so resident memory alone cannot tell a leak from that
    cache. Empty where the C library is not glibc 2.33 or later."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {
        "heap_in_use_kib": (info.uordblks + info.hblkhd) // 1024,
        "heap_free_kib": info.fordblks // 1024,
    }


def heap_sample() -> dict[str, int]:
    """`heap_counts`, and `rss_trimmed_kib`: resident memory once malloc_trim(0) has given
    back to the kernel what it can. It trims the heap, so take `resources()` first where the
    untrimmed figure is wanted. Empty where the C library is not glibc 2.33 or later."""
    counts = heap_counts()
    if not counts:
        return {}
    trim = ctypes.CDLL(None).malloc_trim
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return {**counts, "rss_trimmed_kib": resources()["rss_kib"]}


def network_sum(peers: list[Peer]) -> torch.Tensor:
    return sum(
        torch.cat([p.detach().reshape(-1) for p in peer.model.parameters()]) for peer in peers
    )


def run(rounds: int, warmup: int, console: Console) -> dict:
    torch.set_num_threads(1)
    topology = load_topology(ROOT / "topologies" / "torus16.yaml")
    peers = [
        Peer.over_grpc(
            build_mlp(r, hidden=(16,)).double(),  # different models: messages really differ
            topology,
            r,
            DPSGD(consensus_step=1.0),
            bind="127.0.0.1:0",
            round_timeout=30.0,
        )
        for r in range(topology.n)
    ]
    addresses = {p.rank: p.address for p in peers}
    for peer in peers:  # every server already listens: handshakes can run one by one
        peer.start(timeout=30, addresses=addresses)
    expected = network_sum(peers).clone()
    warm: dict[str, int] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(peers) + 1)

    def loop(peer: Peer) -> None:
        g = torch.Generator().manual_seed(1000 + peer.rank)
        try:
            for r in range(rounds):
                with torch.no_grad():
                    for p in peer.model.parameters():
                        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype), alpha=1e-3)
                peer.gossip()
                if r + 1 == warmup:
                    barrier.wait()  # the main thread samples resources here
                    barrier.wait()
        except BaseException as error:  # reported below
            errors.append(error)
            barrier.abort()

    # the same perturbations, replayed, give the exact expected network sum
    for rank in range(len(peers)):
        g = torch.Generator().manual_seed(1000 + rank)
        shapes = [p.shape for p in peers[rank].model.parameters()]
        for _ in range(rounds):
            expected += torch.cat(
                [
                    torch.randn(s, generator=g, dtype=torch.float64).reshape(-1) * 1e-3
                    for s in shapes
                ]
            )
    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(p,), daemon=True) for p in peers]
    for t in threads:
        t.start()
    try:
        barrier.wait()
        warm = resources()
        console.print(f"after {warmup} rounds: {warm}")
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"soak failed: {errors[0]}") from errors[0]
    final_sum = network_sum(peers)
    end = resources()
    failures = sum(sum(p.stats.failed_exchanges.values()) for p in peers)
    rounds_done = [p.stats.rounds for p in peers]
    sum_error = float((final_sum - expected).abs().max())
    for p in peers:
        p.close()
    result = {
        "peers": len(peers),
        "topology": topology.name,
        "rounds": rounds,
        "warmup_rounds": warmup,
        "seconds": seconds,
        "ms_per_round": 1e3 * seconds / rounds,
        "failed_exchanges": failures,
        "all_rounds_done": all(r == rounds for r in rounds_done),
        "network_sum_max_error": sum_error,
        "after_warmup": warm,
        "at_end": end,
        "rss_growth": (end["rss_kib"] - warm["rss_kib"]) / warm["rss_kib"],
        "thread_growth": end["threads"] - warm["threads"],
        "socket_growth": end["sockets"] - warm["sockets"],
    }
    result["passed"] = bool(
        failures == 0
        and result["all_rounds_done"]
        and sum_error < 1e-9
        and result["rss_growth"] < 0.10
        and result["thread_growth"] <= 0
        and result["socket_growth"] <= 0
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    result = run(args.rounds, args.warmup, console)
    console.print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
