"""Choco-SGD with slow links: one level per peer against one public copy per edge.

Run: python benchmarks/peer_levels.py --json docs/peer_levels.json
     python benchmarks/peer_levels.py --train --seeds 0 1 2 3 4 5 6 7 8 9 \
         --json docs/peer_levels_train.json

Choco-SGD and DEF-ATC broadcast one compressed copy that every neighbour tracks, so a level per
link needs one public copy per edge (each peer compresses x - xh_ij for every neighbour j at
that link's level), while one level per peer (what gossipcomp builds) compresses once at the
level of the peer's slowest link. This measures both in one process, with the project's
compressors, in two settings.

Consensus (the default): the problem Choco solves inside training, without gradients: peers
start from different random vectors and gossip until they agree.

- `fast`: every link at `--fast` (the reference: no slow link);
- `per_edge`: link 0-1 at `--slow`, the others at `--fast`, one public copy per edge;
- `per_peer`: the same links, each peer compressing at its slowest link's level;
- `slow`: every link at `--slow` (one level for the whole network).

Figures: consensus distance (mean squared distance to the average, relative to the start)
after `--rounds` rounds, bytes sent per round, seconds compressing per round (all peers), and
the floats of Choco state per peer. Memory per peer for other degrees follows from the same
count: per peer (1 + degree) models, per edge 2 x degree.

Training (`--train`): the workload of benchmarks/adaptive.py (a ring of 4, mlp on digits split
by Dirichlet 0.5, SGD at lr 0.1 with momentum 0.9, batches of 32, one local step a round, one
compressed group per parameter) with the links at `--link-levels` (in ring order: 0-1, 1-2,
2-3, 0-3). The default is what each link of that benchmark's first phase (1, 4, 64, 64 Mbit/s)
carries in the time its slow link takes at the floor of the top-k ladder (0.02, 0.05, 0.2):
the most any level per link could buy without making a round longer than the floor's.

- `floor`: every link at the lowest of the levels (the best fixed Choco level in every run
  of benchmarks/adaptive.py so far);
- `per_peer`: each peer at its slowest link's level (what gossipcomp's adaptive Choco can set);
- `per_edge`: every link at its own level, one public copy per edge;
- `top`: every link at the highest of the levels (a bound no slow link allows).

Figures: rounds until the peers' mean test accuracy, averaged over three evaluations in a row
(one every 2 rounds), reaches `--target` (benchmarks/adaptive.py's Choco target and window),
per seed, and each arrangement's rounds over the floor's in the same seed: at the floor's round
time (a level per link is chosen not to lengthen it) that ratio is the least time over the best
fixed level a controller of that kind could reach, before it pays for any reaction.

Each link's consensus step is the smaller of its two ends' (the compressor's own step at the
level, as `Choco` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import adaptive  # the sibling benchmark whose workload --train runs (benchmarks/ is no package)
import torch

from gossipcomp.cli import resolve_topology
from gossipcomp.compress import CompressionContext, parse_spec
from gossipcomp.compress.base import Compressor
from gossipcomp.levels.rate import link, peer_levels
from gossipcomp.topology import Topology
from gossipcomp.workload.catalog import DEFAULT_MOMENTUM
from gossipcomp.workload.data import load_split, parse_partition, partition_indices
from gossipcomp.workload.models import build_model
from gossipcomp.workload.training import BatchStream, evaluate_accuracy, local_step, make_optimizer

Levels = dict[tuple[int, int], str]  # link -> compressor spec
TRAIN_LEVELS = ("topk:ratio=0.02", "topk:ratio=0.05", "topk:ratio=0.2", "topk:ratio=0.2")
# each mode's own options and their defaults (the other mode refuses them)
CONSENSUS_ONLY = {
    "d": 1 << 18,
    "fast": "topk:ratio=0.05",
    "slow": "topk:ratio=0.005",
    "seed": 0,
    "step": None,
}
TRAIN_ONLY = {"seeds": [0], "link_levels": list(TRAIN_LEVELS)}
WORKLOAD = adaptive.Workload()  # what the training mode trains: the adaptive benchmark's


def _step(compressor: Compressor, numel: int, given: float | None) -> tuple[float, float]:
    """Choco's consensus step (`given`, or the compressor's own) and 1 / (1 + beta) scale."""
    step = compressor.consensus_step if given is None else given
    return step, 1.0 / (1.0 + compressor.variance_bound(numel))


class ChocoNetwork:
    """Choco-SGD's gossip over `topology` on the peers' tensors (`groups[i]`: peer i's, each
    compressed on its own and changed in place), each link at its level in `levels`, with a
    public copy per edge (`per_edge`) or one per peer at its slowest link's level."""

    def __init__(
        self,
        topology: Topology,
        levels: Levels,
        per_edge: bool,
        groups: list[list[torch.Tensor]],
        seed: int,
        given: float | None,
    ) -> None:
        n = topology.n
        self.topology, self.groups, self.seed, self.given = topology, groups, seed, given
        self.weights = {i: topology.neighbor_weights(i) for i in range(n)}
        size = sum(t.numel() for t in groups[0])
        specs = sorted(set(levels.values()), key=lambda s: parse_spec(s).wire_bytes(size))
        self.compressors = {spec: parse_spec(spec) for spec in specs}
        if per_edge:
            self.sender_spec: Callable[[int, int], str] = lambda i, j: levels[link(i, j)]
        else:
            rank_of = {spec: index for index, spec in enumerate(specs)}
            table = {key: rank_of[spec] for key, spec in levels.items()}
            around = {i: topology.neighbors(i) for i in range(n)}
            own = peer_levels(table, around, default=len(specs) - 1)
            self.sender_spec = lambda i, j: specs[own[i]]
        # public[i][key]: i's public copy for neighbour key (per edge) or its one (key -1);
        # tracked[i][j]: i's copy of what j sends it; one tensor per group
        self.keys = {i: topology.neighbors(i) if per_edge else [-1] for i in range(n)}
        self.public = {i: {k: _zeros(groups[i]) for k in self.keys[i]} for i in range(n)}
        self.tracked = {i: {j: _zeros(groups[i]) for j in topology.neighbors(i)} for i in range(n)}
        self.nbytes, self.compress_s = 0, 0.0

    def round(self, r: int) -> None:
        """One Choco step: every peer compresses x - xh for each of its public copies, its
        neighbours track what it sent, then every peer mixes in place."""
        topology = self.topology
        for i in range(topology.n):
            for key in self.keys[i]:
                receivers = [key] if key >= 0 else topology.neighbors(i)
                compressor = self.compressors[self.sender_spec(i, receivers[0])]
                for g, (x, public) in enumerate(
                    zip(self.groups[i], self.public[i][key], strict=True)
                ):
                    context = CompressionContext(self.seed, i, key, r, g)
                    began = time.perf_counter()
                    payload = compressor.compress((x - public).reshape(-1), context)
                    decoded = compressor.decompress(payload, context).view_as(x)
                    self.compress_s += time.perf_counter() - began
                    scale = _step(compressor, x.numel(), self.given)[1]
                    public.add_(decoded, alpha=scale)
                    for j in receivers:
                        self.tracked[j][i][g].add_(decoded, alpha=scale)
                        self.nbytes += payload.nbytes
        for i in range(topology.n):
            for g, x in enumerate(self.groups[i]):
                pull = torch.zeros_like(x)
                for j, w in self.weights[i].items():
                    step = min(
                        _step(self.compressors[self.sender_spec(i, j)], x.numel(), self.given)[0],
                        _step(self.compressors[self.sender_spec(j, i)], x.numel(), self.given)[0],
                    )
                    mine = self.public[i][j if j in self.public[i] else -1][g]
                    pull.add_(self.tracked[i][j][g] - mine, alpha=step * w)
                x.add_(pull)

    def state_floats_per_peer(self) -> float:
        """Floats of Choco state a peer keeps: its public copies and its copies of its
        neighbours'."""
        copies = sum(len(v) for v in self.public.values()) + sum(
            len(v) for v in self.tracked.values()
        )
        return copies * sum(t.numel() for t in self.groups[0]) / self.topology.n


def _zeros(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy that starts at 0 (Choco's public copies do), one tensor per group."""
    return [torch.zeros_like(t) for t in tensors]


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
    network = ChocoNetwork(topology, levels, per_edge, [[xi] for xi in x], seed, given)
    reached: tuple[int, int] | None = None  # (round, bytes) when the distance reached target
    for r in range(rounds):
        network.round(r)
        if reached is None:
            distance = sum(float((xi - mean).pow(2).sum()) for xi in x) / n
            if distance <= target * start:
                reached = (r + 1, network.nbytes)
    end = sum(float((xi - mean).pow(2).sum()) for xi in x) / n
    drift = float((torch.stack(x).mean(0) - mean).abs().max())
    return {
        "consensus_distance": end / start,
        "bytes_per_round": network.nbytes / rounds,
        "compress_seconds_per_round": network.compress_s / rounds,
        "state_floats_per_peer": network.state_floats_per_peer(),
        "average_drift": drift,
        "rounds_to_target": None if reached is None else reached[0],
        "mb_to_target": None if reached is None else reached[1] / 1e6,
    }


def train(
    topology: Topology, levels: Levels, per_edge: bool, rounds: int, seed: int, target: float
) -> dict[str, float | int | None]:
    """Choco-SGD training with the link levels `levels` on benchmarks/adaptive.py's workload
    (its data set, split, model, learning rate, batch size and target rule); see the module
    docstring."""
    w = WORKLOAD
    split = load_split(w.dataset, seed)
    parts = partition_indices(split.y_train.numpy(), topology.n, parse_partition(w.partition), seed)
    models = [build_model(w.model, seed) for _ in range(topology.n)]
    optimizers = [make_optimizer(m, lr=w.lr, momentum=DEFAULT_MOMENTUM) for m in models]
    batches = [
        BatchStream(split.x_train[part], split.y_train[part], w.batch_size, seed, i)
        for i, part in enumerate(parts)
    ]
    network = ChocoNetwork(
        topology, levels, per_edge, [[p.data for p in m.parameters()] for m in models], seed, None
    )
    points: list[tuple[int, float, float]] = []  # (round, mean test accuracy, unused seconds)
    for r in range(rounds):
        for model, optimizer, stream in zip(models, optimizers, batches, strict=True):
            local_step(model, optimizer, stream.next_batch())
        with torch.no_grad():
            network.round(r)
        if (r + 1) % w.eval_every == 0:
            accuracy = statistics.fmean(
                evaluate_accuracy(m, split.x_test, split.y_test) for m in models
            )
            points.append((r + 1, accuracy, 0.0))
    reached = adaptive.reached_target(points, target, w.target_window)
    return {
        "rounds_to_target": None if reached is None else reached[0],
        "final_accuracy": points[-1][1] if points else None,
        "bytes_per_round": network.nbytes / rounds,
        "compress_seconds_per_round": network.compress_s / rounds,
    }


def train_all(
    topology: Topology, link_levels: Sequence[str], seeds: Sequence[int], rounds: int, target: float
) -> dict[str, object]:
    """Every arrangement of the training mode for every seed, and each one's rounds to the
    target over the floor's in the same seed."""
    n = topology.n
    edges = [link(i, (i + 1) % n) for i in range(n)]  # ring order: 0-1, 1-2, ..., 0-(n-1)
    if set(edges) != {link(a, b) for a, b in topology.graph.edges}:
        raise ValueError(f"--train: expected a ring topology, got {topology.name!r}")
    if len(link_levels) != len(edges):
        raise ValueError(
            f"--link-levels: expected {len(edges)} (one per edge of {topology.name!r} in ring "
            f"order), got {len(link_levels)}"
        )
    size = sum(p.numel() for p in build_model(WORKLOAD.model, 0).parameters())
    by_bytes = sorted(set(link_levels), key=lambda s: parse_spec(s).wire_bytes(size))
    given = dict(zip(edges, link_levels, strict=True))
    arrangements = {
        "floor": (dict.fromkeys(edges, by_bytes[0]), False),
        "per_peer": (given, False),
        "per_edge": (given, True),
        "top": (dict.fromkeys(edges, by_bytes[-1]), False),
    }
    runs = {
        name: [train(topology, levels, per_edge, rounds, seed, target) for seed in seeds]
        for name, (levels, per_edge) in arrangements.items()
    }
    over_floor: dict[str, list[float] | None] = {}
    for name, per_seed in runs.items():
        pairs = list(zip(per_seed, runs["floor"], strict=True))
        ratios = [
            a["rounds_to_target"] / f["rounds_to_target"]
            for a, f in pairs
            if a["rounds_to_target"] and f["rounds_to_target"]
        ]
        over_floor[name] = ratios if len(ratios) == len(pairs) else None
    return {
        "link_levels": {f"{a}-{b}": spec for (a, b), spec in given.items()},
        "runs": runs,
        "rounds_over_floor": over_floor,
        "median_rounds_over_floor": {
            name: (statistics.median(r) if r else None) for name, r in over_floor.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="the training mode (see above)")
    parser.add_argument("--topology", help="default ring8; with --train, ring4")
    parser.add_argument("--d", type=int, help="elements per model (default 2^18)")
    parser.add_argument("--rounds", type=int, help="default 100; with --train, 160")
    parser.add_argument("--fast", help="fast links' compressor (default topk:ratio=0.05)")
    parser.add_argument("--slow", help="link 0-1's compressor (default topk:ratio=0.005)")
    parser.add_argument("--seed", type=int, help="default 0")
    parser.add_argument(
        "--step", type=float, help="consensus step of every link (default: each level's own)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="--train's seeds (default 0)")
    parser.add_argument(
        "--link-levels",
        nargs="+",
        help="--train: each link's compressor, in ring order (0-1, 1-2, ...; default "
        f"{' '.join(TRAIN_LEVELS)})",
    )
    parser.add_argument(
        "--target",
        type=float,
        help="relative consensus distance to reach (default 0.01); with --train, the mean "
        "test accuracy (default benchmarks/adaptive.py's Choco target, 0.90)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    own, other = (TRAIN_ONLY, CONSENSUS_ONLY) if args.train else (CONSENSUS_ONLY, TRAIN_ONLY)
    given = [f"--{name.replace('_', '-')}" for name in other if getattr(args, name) is not None]
    if given:
        mode = "the consensus mode" if args.train else "--train"
        parser.error(f"{', '.join(given)}: only for {mode}; expected none of them here")
    for name in other:
        delattr(args, name)  # not in the JSON's config of a run that did not use it
    for name, default in own.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    torch.set_num_threads(1)
    if args.train:
        report_training(args)
        return
    topology = resolve_topology(args.topology or "ring8")
    args.topology, args.rounds = topology.name, args.rounds or 100
    args.target = 0.01 if args.target is None else args.target
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
    print(f"{topology.name}, d = {args.d}, {args.rounds} rounds, {args.fast} / {args.slow} on 0-1")
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


def report_training(args: argparse.Namespace) -> None:
    """The training mode: run, print a table, write the JSON."""
    topology = resolve_topology(args.topology or "ring4")
    args.topology, args.rounds = topology.name, args.rounds or 160
    target = args.target = WORKLOAD.choco_target if args.target is None else args.target
    result = train_all(topology, args.link_levels, args.seeds, args.rounds, target)
    print(f"{topology.name}, links {result['link_levels']}, target {target}, seeds {args.seeds}")
    print(f"{'run':<9} {'rounds to target':>24} {'over floor':>24} {'final acc':>10}")
    for name, per_seed in result["runs"].items():
        reached = [row["rounds_to_target"] for row in per_seed]
        ratios = result["rounds_over_floor"][name]
        shown = "-" if ratios is None else ", ".join(f"{r:.2f}" for r in ratios)
        final = statistics.fmean(row["final_accuracy"] or 0.0 for row in per_seed)
        print(f"{name:<9} {str(reached):>24} {shown:>24} {final:>10.3f}")
    print(f"median rounds over the floor: {result['median_rounds_over_floor']}")
    if args.json:
        config = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, **result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
