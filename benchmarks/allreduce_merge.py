"""Merged compressed all-reduce: per-tensor collectives, one group, and planned groups.

Run: python benchmarks/allreduce_merge.py --json docs/allreduce_merge.json
N gloo processes (default 4) train the residual MLP (102 parameter tensors) on digits with
`MergedSync` under three groupings for each compressor (sign, top-1%): one compressed collective
per tensor, one group of everything, and the groups of a gossipcomp.schedule planner (default
mergecomp), each group launched as soon as backward completes it. Every planner (per-tensor and
single too) plans on costs measured inside the run's first training steps
(gossipcomp/allreduce/calibrate.py: 4 steps under one group per tensor, 4 under one group of
all, the compressor timed alone) and reports the step time it predicts and the per-collective
cost (alpha) it priced. Step time: the median wall
time of a step after the first five, median over ranks and over `--repeats` rounds (the
groupings run in turn within each round). Ratios: merged_speedup = per-tensor / planned,
planned_vs_single = single / planned, per compressor; accuracy after the same steps.

Links that bind: `--links shaped` (root, Linux) puts each rank in its own network namespace
behind a NIC of X Mbit/s each way (benchmarks/shaped_hub.py; default 2 ranks, and the residual
MLP 256 wide, `--model resmlp-wide`: the same 102 tensors with a backward long against one
collective's fixed cost of a few ms on a loaded 2-core machine), runs every
planner (mgwfbp, mergecomp, strategy) beside per-tensor and single, with and without
compression (identity, sign, top-1%), and sets X per compressor so that one step's
communication is `--comm-over-backward` (default 2) times the backward pass: X is computed
from the bytes a step puts on a rank's link and the fewest CPU seconds of 20 one-thread
backward passes here before the ranks start, at the examples a rank's step holds
(`--batch-size` sets how long that backward is against communication's fixed and CPU costs:
1024 by default on shaped links, so each step is a rank's whole shard of digits; at the
all-reduce's own 32 a backward of 5-7 ms was barely two collectives' fixed cost, at 512 steps
of 512 and 206 examples alternated; the loopback default stays 32). The run then measures, per
compressor, comm_over_backward = the communication a step of the single group waits for / the
backward pass timed inside the ranks; network_bound is true only when that is at least 1 for
every compressor, and the script exits 1 (after writing the JSON) when it is not: a run that
does not bind proves nothing about overlap. Per compressor it writes planned_vs_single,
planned_groups and predicted_over_measured (the planner's predicted step time over the
measured one) for `--planner` and, under "planners", for each planner.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from allreduce_runs import machine, run_configs, show, summarise
from results import save
from shaped_hub import NamespacesUnavailable, ShapedHub, run_ranks

from gossipcomp.allreduce.launch import Session, spawn
from gossipcomp.allreduce.settings import parse_gather_pieces
from gossipcomp.allreduce.train import MODELS, AllreduceConfig, shard_sizes
from gossipcomp.compress import parse_spec

COMPRESSORS = ("sign", "topk:ratio=0.01")
SHAPED_COMPRESSORS = ("identity", "sign", "topk:ratio=0.01")
GROUPINGS = ("per-tensor", "single", "planned")
PLANNERS = ("mgwfbp", "mergecomp", "strategy")
TCP_EFFICIENCY = 0.9  # goodput over the tbf rate: headers, acks, slow start after idle
BACKWARD_REPEATS = 20
# shaped links: every step a rank's whole shard (digits: 718-719 examples each of 2 ranks), a
# backward of about 55 ms, the same length every step (at 512 steps of 512 and 206 examples
# alternated, and overlap's gain sat within their spread: docs/benchmarks.md)
SHAPED_BATCH_SIZE = 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", choices=("loopback", "shaped"), default="loopback")
    parser.add_argument("--nproc", type=int, help="ranks (default 4 on loopback, 2 shaped)")
    parser.add_argument(
        "--model",
        choices=("resmlp", "resmlp-wide"),
        help="102 tensors, 64 wide (default on loopback) or 256 wide (default shaped)",
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--batch-size",
        type=int,
        help="samples a rank's step trains on: the backward's length against a collective's "
        f"fixed cost (default {SHAPED_BATCH_SIZE} shaped, {AllreduceConfig.batch_size} on loopback)",
    )
    parser.add_argument(
        "--calibration-steps",
        type=int,
        default=AllreduceConfig.calibration_steps,
        help="steps under each probe plan before planning (calibrate.py), counted in --steps",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--planner", default="mergecomp", help="the planner of the headline")
    parser.add_argument(
        "--compressors", help="comma-separated specs (default sign,topk; shaped: identity too)"
    )
    parser.add_argument(
        "--comm-over-backward",
        type=float,
        default=2.0,
        help="shaped: the communication a step should take, in backward passes (1 to 3)",
    )
    parser.add_argument("--mbit", type=float, help="shaped: one rate for every compressor")
    parser.add_argument(
        "--gather-pieces",
        default=AllreduceConfig.gather_pieces,
        help="all_gathers (top-k's) whole, in pieces of this many KiB, or auto (timed: pieces.py)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    shaped = args.links == "shaped"
    nproc = args.nproc or (2 if shaped else 4)
    if args.batch_size is None:
        args.batch_size = SHAPED_BATCH_SIZE if shaped else AllreduceConfig.batch_size
    args.model = args.model or ("resmlp-wide" if shaped else "resmlp")
    default = SHAPED_COMPRESSORS if shaped else COMPRESSORS
    compressors = tuple(args.compressors.split(",")) if args.compressors else default
    if not 2 <= nproc <= 16 or args.steps < 6 or args.repeats < 1:
        parser.error("expected --nproc in 2..16, --steps >= 6 and --repeats >= 1")
    if not 1 <= args.batch_size <= 1024:
        parser.error(f"--batch-size: expected 1 to 1024, got {args.batch_size}")
    if not 2 <= args.calibration_steps <= 20 or args.steps <= 2 * args.calibration_steps + 1:
        parser.error(
            f"--calibration-steps {args.calibration_steps}: expected 2 to 20, and --steps above "
            "twice it plus one (the probes' steps count among --steps)"
        )
    if not 0.5 <= args.comm_over_backward <= 10:
        parser.error(f"--comm-over-backward: expected 0.5 to 10, got {args.comm_over_backward}")
    if shaped and args.planner not in PLANNERS:
        parser.error(f"--planner: expected one of {', '.join(PLANNERS)} with --links shaped")
    try:
        parse_gather_pieces(args.gather_pieces)
    except ValueError as error:
        parser.error(f"--gather-pieces: {error}")
    for spec in compressors:
        try:
            parse_spec(spec)
        except ValueError as error:
            parser.error(f"--compressors: {error}")
    if not shaped:
        return _loopback(args, nproc, compressors)
    try:
        return _shaped(args, nproc, compressors)
    except ShapedUnavailable as error:
        print(f"allreduce_merge.py --links shaped: {error}", file=sys.stderr)
        return 2


def _configs(
    compressors: tuple[str, ...], planners: dict[str, str], args: argparse.Namespace
) -> dict[str, AllreduceConfig]:
    """One configuration per compressor and grouping (grouping name -> planner)."""
    base = AllreduceConfig(
        sync="merged",
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        momentum=0.0,
        calibration_steps=args.calibration_steps,
        gather_pieces=args.gather_pieces,
    )
    return {
        f"{spec} {grouping}": replace(base, compressor=spec, planner=planner)
        for spec in compressors
        for grouping, planner in planners.items()
    }


def _run_fields(args: argparse.Namespace, nproc: int) -> dict[str, Any]:
    """What a result records of the run, on loopback as on shaped links."""
    return {
        "nproc": nproc,
        "steps": args.steps,
        "calibration_steps": args.calibration_steps,
        "gather_pieces": args.gather_pieces,
        "repeats": args.repeats,
        "planner": args.planner,
        "model": args.model,
        "batch_size": args.batch_size,
        "tensors": len(list(MODELS[args.model](0).parameters())),
    }


def _loopback(args: argparse.Namespace, nproc: int, compressors: tuple[str, ...]) -> int:
    groupings = {"per-tensor": "per-tensor", "single": "single", "planned": args.planner}
    configs = _configs(compressors, groupings, args)
    ranks = spawn(run_configs, nproc, (configs, args.repeats), timeout_s=60, deadline_s=3600)
    table = summarise(ranks, configs)
    ratios = {}
    for spec in compressors:
        planned = table[f"{spec} planned"]["step_ms"]
        ratios[spec] = {
            "merged_speedup": table[f"{spec} per-tensor"]["step_ms"] / planned,
            "planned_vs_single": table[f"{spec} single"]["step_ms"] / planned,
        }
    result = {
        "links": "loopback",
        **_run_fields(args, nproc),
        "methods": table,
        "ratios": ratios,
        "merged_speedup": min(r["merged_speedup"] for r in ratios.values()),
        "planned_vs_single": min(r["planned_vs_single"] for r in ratios.values()),
        "machine": machine(),
    }
    console = show(f"merged compressed all-reduce, resmlp, {nproc} gloo ranks", table, groups=True)
    for spec, r in ratios.items():
        console.print(
            f"{spec}: merged_speedup {r['merged_speedup']:.2f}, "
            f"planned_vs_single {r['planned_vs_single']:.2f}"
        )
    save(args.json, result)
    return 0


class ShapedUnavailable(RuntimeError):
    """Shaped links cannot be built here (not root, no iproute2/tc, or refused)."""


def backward_seconds(
    model_name: str,
    batch_size: int,
    seed: int = 0,
    repeats: int = BACKWARD_REPEATS,
    *,
    fastest: bool = False,
) -> float:
    """Median seconds of the model's backward pass on a digits-sized batch, one thread as in a
    rank (after two untimed passes); `fastest`: the least CPU seconds of this process instead,
    what sets the links. On a machine shared with other work wall time follows the load of the
    moment: a link set from a loaded wall time (116 ms for a backward of 13 ms of CPU) ran at
    1/9 of the planned rate, communication 7-19 backward passes instead of 2."""
    model = MODELS[model_name](seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 64, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    runs = []
    clock = time.process_time if fastest else time.perf_counter
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats + 2):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            start = clock()
            loss.backward()
            runs.append(clock() - start)
    finally:
        torch.set_num_threads(threads)
    return min(runs[2:]) if fastest else statistics.median(runs[2:])


def rank_batch(config: AllreduceConfig, nproc: int) -> int:
    """Examples in a rank's step: the batch size, or the smallest rank's whole shard where the
    batch is larger (BatchStream cuts each epoch of a shard into batches)."""
    return min(config.batch_size, *shard_sizes(config, nproc))


def link_bytes_per_step(spec: str, numel: int, nproc: int) -> float:
    """Bytes one rank sends a step for one group of `numel` elements under `spec` (ring
    all-reduce: 2 (N - 1) / N of the payload; all-gather: N - 1 times it)."""
    compressor = parse_spec(spec)
    payload = compressor.wire_bytes(numel)
    return payload * (2 * (nproc - 1) / nproc if compressor.summable else nproc - 1)


def rate_mbit(nbytes: float, backward_s: float, comm_over_backward: float) -> float:
    """The NIC rate at which `nbytes` take `comm_over_backward` backward passes to send."""
    return 8 * nbytes / (comm_over_backward * backward_s) / 1e6 / TCP_EFFICIENCY


def _shaped_worker(
    session: Session, configs: dict[str, AllreduceConfig], repeats: int
) -> dict[str, Any]:
    """This rank's backward time (on as many examples as a step of the configurations holds),
    then every configuration `repeats` times."""
    first = next(iter(configs.values()))
    batch = rank_batch(first, session.world)
    backward_s = backward_seconds(first.model, batch, seed=session.rank)
    rows = run_configs(session, configs, repeats)
    return {"backward_ms": 1e3 * backward_s, "rows": rows}


def _shaped(args: argparse.Namespace, nproc: int, compressors: tuple[str, ...]) -> int:
    numel = sum(p.numel() for p in MODELS[args.model](0).parameters())
    groupings = {"per-tensor": "per-tensor", "single": "single", **{p: p for p in PLANNERS}}
    base = next(iter(_configs(compressors[:1], {"single": "single"}, args).values()))
    backward_s = backward_seconds(args.model, rank_batch(base, nproc), fastest=True)
    rates = {
        spec: args.mbit
        or rate_mbit(link_bytes_per_step(spec, numel, nproc), backward_s, args.comm_over_backward)
        for spec in compressors
    }
    shown = ", ".join(f"{spec} {mbit:.2f}" for spec, mbit in rates.items())
    print(f"backward {1e3 * backward_s:.2f} ms: links at {shown} Mbit/s", file=sys.stderr)
    table: dict[str, dict[str, Any]] = {}
    per_compressor: dict[str, dict[str, Any]] = {}
    try:
        with ShapedHub(nproc, rates[compressors[0]]) as hub:
            for spec in compressors:
                hub.set_rate(rates[spec])
                configs = _configs((spec,), groupings, args)
                ranks = run_ranks(
                    hub, _shaped_worker, (configs, args.repeats), timeout_s=120, deadline_s=3600
                )
                rows = summarise([r["rows"] for r in ranks], configs)
                table.update(rows)
                backward_ms = statistics.median(r["backward_ms"] for r in ranks)
                per_compressor[spec] = _figures(spec, rows, backward_ms, rates[spec], args.planner)
                per_compressor[spec]["qdisc"] = hub.qdisc(0)
            prefix = hub.prefix
    except NamespacesUnavailable as error:
        raise ShapedUnavailable(f"network namespaces are not available: {error}") from None
    bound = all(c["network_bound"] for c in per_compressor.values())
    result = {
        "links": "shaped",
        **_run_fields(args, nproc),
        "target_comm_over_backward": args.comm_over_backward,
        "launcher_backward_ms": 1e3 * backward_s,
        "namespace_prefix": prefix,
        "network_bound": bound,
        "comm_over_backward": min(c["comm_over_backward"] for c in per_compressor.values()),
        "compressors": per_compressor,
        "methods": table,
        "merged_speedup": min(c["merged_speedup"] for c in per_compressor.values()),
        "planned_vs_single": min(c["planned_vs_single"] for c in per_compressor.values()),
        "machine": machine(),
    }
    console = show(
        f"merged all-reduce, resmlp, {nproc} gloo ranks on shaped NICs",
        table,
        groups=True,
        timing=True,
    )
    for spec, c in per_compressor.items():
        console.print(
            f"{spec} at {c['mbit']:.2f} Mbit/s: comm/backward {c['comm_over_backward']:.2f}, "
            f"{args.planner}: {c['planned_groups']} groups, planned_vs_single "
            f"{c['planned_vs_single']:.2f}, predicted/measured {c['predicted_over_measured']:.2f}"
            f", in-step alpha {c['alpha_ms']:.2f} ms, contention {c['contention']:.2f}"
            f", all_gather pieces {c['gather_piece_bytes']}"
        )
    save(args.json, result)
    if not bound:
        loose = [s for s, c in per_compressor.items() if not c["network_bound"]]
        print(
            f"NOT network-bound: communication under the backward pass for {', '.join(loose)}; "
            "these figures say nothing about overlap (slow the links: --comm-over-backward)",
            file=sys.stderr,
        )
        return 1
    return 0


def _figures(
    spec: str, rows: dict[str, dict[str, Any]], backward_ms: float, mbit: float, headline: str
) -> dict[str, Any]:
    """One compressor's figures from its rows (names "SPEC GROUPING")."""
    single = rows[f"{spec} single"]
    ratio = single["comm_ms"] / backward_ms
    planners = {}
    for planner in PLANNERS:
        row = rows[f"{spec} {planner}"]
        planners[planner] = {
            "groups": row["groups"],
            "step_ms": row["step_ms"],
            "predicted_ms": row["predicted_ms"],
            "alpha_ms": row["alpha_ms"],
            "contention": row["contention"],
            "vs_single": single["step_ms"] / row["step_ms"],
            "predicted_over_measured": row["predicted_ms"] / row["step_ms"],
        }
    head = planners[headline]
    return {
        "mbit": mbit,
        "backward_ms": backward_ms,
        "single_comm_ms": single["comm_ms"],
        "comm_over_backward": ratio,
        "network_bound": ratio >= 1.0,
        "merged_speedup": rows[f"{spec} per-tensor"]["step_ms"] / head["step_ms"],
        "planned_vs_single": head["vs_single"],
        "planned_groups": head["groups"],
        # the all_gather pieces each repeat of the headline planner took (0: whole; pieces.py)
        "gather_piece_bytes": rows[f"{spec} {headline}"]["gather_piece_bytes"],
        "predicted_over_measured": head["predicted_over_measured"],
        "alpha_ms": head["alpha_ms"],
        "contention": head["contention"],
        "best_planned_vs_single": max(p["vs_single"] for p in planners.values()),
        "planners": planners,
    }


if __name__ == "__main__":
    sys.exit(main())
