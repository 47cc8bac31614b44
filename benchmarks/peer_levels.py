"""Choco-SGD with one slow link: one level per peer against one public copy per edge.

Run: python benchmarks/peer_levels.py --json docs/peer_levels.json

Choco-SGD and DEF-ATC broadcast one compressed copy that every neighbour tracks, so a level per
link needs one public copy per edge (each peer compresses x - xh_ij for every neighbour j at
that link's level), while one level per peer (what gossipcomp builds) compresses once at the
level of the peer's slowest link. This measures both on the consensus problem Choco solves
inside training (no gradients: peers start from different random vectors and gossip until they
agree), in one process, with the project's compressors:

- `fast`: every link at `--fast` (the reference: no slow link);
- `per_edge`: link 0-1 at `--slow`, the others at `--fast`, one public copy per edge;
- `per_peer`: the same links, each peer compressing at its slowest link's level;
- `slow`: every link at `--slow` (one level for the whole network).

Each link's consensus step is the smaller of its two ends' (the compressor's own step at the
level, as `Choco` does). Figures: consensus distance (mean squared distance to the average,
relative to the start) after `--rounds` rounds, bytes sent per round, seconds compressing per
round (all peers), and the floats of Choco state per peer. Memory per peer for other degrees
follows from the same count: per peer (1 + degree) models, per edge 2 x degree.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gossipcomp.cli import resolve_topology
from gossipcomp.compress import CompressionContext, parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.levels.rate import link, peer_levels
from gossipcomp.topology import Topology

Levels = dict[tuple[int, int], str]  # link -> compressor spec


def _step(compressor: Compressor, numel: int, given: float | None) -> tuple[float, float]:
    """Choco's consensus step (`given`, or the compressor's own) and 1 / (1 + beta) scale."""
    step = compressor.consensus_step if given is None else given
    return step, 1.0 / (1.0 + compressor.variance_bound(numel))


def run(
    topology: Topology,
    levels: Levels,
    per_edge: bool,
    d: int,
    rounds: int,
    seed: int,
    target: float,
    given: float | None,
) -> dict[str, float | None]:
    """Consensus by Choco-SGD with the link levels `levels`; see the module docstring."""
    n = topology.n
    generator = torch.Generator().manual_seed(seed)
    x = [torch.randn(d, generator=generator) for _ in range(n)]
    mean = torch.stack(x).mean(0)
    start = sum(float((xi - mean).pow(2).sum()) for xi in x) / n
    weights = {i: topology.neighbor_weights(i) for i in range(n)}
    specs = sorted(set(levels.values()), key=lambda s: parse_spec(s).wire_bytes(d))
    rank_of = {spec: index for index, spec in enumerate(specs)}
    compressors = {spec: parse_spec(spec) for spec in specs}
    if per_edge:
        sender_spec: Callable[[int, int], str] = lambda i, j: levels[link(i, j)]  # noqa: E731
    else:
        table = {key: rank_of[spec] for key, spec in levels.items()}
        around = {i: topology.neighbors(i) for i in range(n)}
        own = peer_levels(table, around, default=len(specs) - 1)
        sender_spec = lambda i, j: specs[own[i]]  # noqa: E731
    # own[i][j]: i's public copy for j (per edge) or i's one public copy (key -1);
    # tracked[i][j]: i's copy of what j sends it
    keys = {i: topology.neighbors(i) if per_edge else [-1] for i in range(n)}
    public = {i: {j: torch.zeros(d) for j in keys[i]} for i in range(n)}
    tracked = {i: {j: torch.zeros(d) for j in topology.neighbors(i)} for i in range(n)}
    nbytes, compress_s = 0, 0.0
    reached: tuple[int, int] | None = None  # (round, bytes) when the distance reached target
    for r in range(rounds):
        for i in range(n):
            for key in keys[i]:
                receivers = [key] if per_edge else topology.neighbors(i)
                spec = sender_spec(i, receivers[0])
                compressor = compressors[spec]
                context = CompressionContext(seed, i, key, r, 0)
                began = time.perf_counter()
                payload = compressor.compress(x[i] - public[i][key], context)
                decoded = compressor.decompress(payload, context)
                compress_s += time.perf_counter() - began
                scale = _step(compressor, d, given)[1]
                public[i][key].add_(decoded, alpha=scale)
                for j in receivers:
                    tracked[j][i].add_(decoded, alpha=scale)
                    nbytes += payload.nbytes
        for i in range(n):
            pull = torch.zeros(d)
            for j, w in weights[i].items():
                step = min(
                    _step(compressors[sender_spec(i, j)], d, given)[0],
                    _step(compressors[sender_spec(j, i)], d, given)[0],
                )
                mine = public[i][j if per_edge else -1]
                pull.add_(tracked[i][j] - mine, alpha=step * w)
            x[i].add_(pull)
        if reached is None:
            distance = sum(float((xi - mean).pow(2).sum()) for xi in x) / n
            if distance <= target * start:
                reached = (r + 1, nbytes)
    end = sum(float((xi - mean).pow(2).sum()) for xi in x) / n
    drift = float((torch.stack(x).mean(0) - mean).abs().max())
    copies = sum(len(v) for v in public.values()) + sum(len(v) for v in tracked.values())
    return {
        "consensus_distance": end / start,
        "bytes_per_round": nbytes / rounds,
        "compress_seconds_per_round": compress_s / rounds,
        "state_floats_per_peer": copies * d / n,
        "average_drift": drift,
        "rounds_to_target": None if reached is None else reached[0],
        "mb_to_target": None if reached is None else reached[1] / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="ring8")
    parser.add_argument("--d", type=int, default=1 << 18, help="elements per model")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--fast", default="topk:ratio=0.05", help="fast links' compressor")
    parser.add_argument("--slow", default="topk:ratio=0.005", help="link 0-1's compressor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step", type=float, help="consensus step of every link (default: each level's own)"
    )
    parser.add_argument(
        "--target", type=float, default=0.01, help="relative consensus distance to reach"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topology = resolve_topology(args.topology)
    edges = [link(a, b) for a, b in topology.graph.edges]
    one_slow = {e: (args.slow if e == (0, 1) else args.fast) for e in edges}

    def measure(levels: Levels, per_edge: bool) -> dict[str, float | None]:
        return run(
            topology, levels, per_edge, args.d, args.rounds, args.seed, args.target, args.step
        )

    runs = {
        "fast": measure(dict.fromkeys(edges, args.fast), False),
        "per_edge": measure(one_slow, True),
        "per_peer": measure(one_slow, False),
        "slow": measure(dict.fromkeys(edges, args.slow), False),
    }
    print(f"{args.topology}, d = {args.d}, {args.rounds} rounds, {args.fast} / {args.slow} on 0-1")
    print(
        f"{'run':<9} {'consensus':>10} {'MB/round':>9} {'rounds to':>9} {'MB to':>8} "
        f"{'compress s':>11} {'state floats':>13}"
    )
    for name, row in runs.items():
        print(
            f"{name:<9} {row['consensus_distance']:>10.3e} {row['bytes_per_round'] / 1e6:>9.3f} "
            f"{row['rounds_to_target'] or '-':>9} {row['mb_to_target'] or float('nan'):>8.1f} "
            f"{row['compress_seconds_per_round']:>11.4f} {row['state_floats_per_peer']:>13.0f}"
        )
    if args.json:
        payload = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
