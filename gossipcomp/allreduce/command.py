"""`gossipcomp allreduce`: train digits in all-reduce mode and report like `simulate`.

`gossipcomp allreduce --nproc N [--compressor SPEC] [--sync ddp-hook|merged|marsit|ssd|
diloco:steps=H,outer=(SPEC),compressor=(SPEC)] [--report PATH]` starts N local processes (gloo on CPU; the launching process hosts the
rendezvous store). Without --nproc it is one rank of a job started by torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NCCL when CUDA is available) and rank 0 writes the report.
Exit status: 0 done; 2 the command cannot run as given (one line on stderr); 1 training failed
(a rank died or stopped responding: the message names it, within about the --timeout).
The report holds every rank: only rank 0 writes it, so under torchrun ranks never overwrite one
another's, and `{rank}` in --report (the `peer` command's per-rank file) is refused.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch.distributed as dist

from gossipcomp.allreduce.flags import MAX_TIMEOUT_S
from gossipcomp.allreduce.flags import add_arguments as add_arguments  # re-exported
from gossipcomp.allreduce.launch import LaunchError, Session, init_from_env, spawn
from gossipcomp.allreduce.liveness import RankFailure
from gossipcomp.allreduce.train import AllreduceConfig, RankResult, train_rank
from gossipcomp.experiment.report import HistoryPoint, PeerReport, Report, mean_loss
from gossipcomp.inputs.arguments import write_error
from gossipcomp.inputs.text import quoted


def config_of(args: argparse.Namespace) -> AllreduceConfig:
    return AllreduceConfig(
        sync=args.sync,
        compressor=args.compressor,
        planner=args.planner,
        steps=args.steps,
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch_size,
        seed=args.seed,
        partition=args.partition,
        eval_every=args.eval_every,
        timeout_s=args.timeout,
        ssd_k=args.ssd_k,
        ssd_warmup=args.ssd_warmup,
        bucket_cap_mb=args.bucket_cap_mb,
        model=args.model,
        dataset=args.dataset,
        error_feedback=not args.no_error_feedback,
        calibration_steps=args.calibration_steps,
        gather_pieces=args.gather_pieces,
    )


def check_config(config: AllreduceConfig) -> None:
    """Refuse a compressor or planner that cannot run, before any process starts."""
    from gossipcomp.allreduce.hooks import POWERSGD, parse_hook_spec
    from gossipcomp.allreduce.reference import REFERENCES
    from gossipcomp.compress import parse_spec
    from gossipcomp.schedule import make_planner

    if config.compressor.strip().startswith("torch:"):
        if config.sync != "ddp-hook" or config.compressor.split(":rank=")[0] not in REFERENCES:
            raise ValueError(
                f"--compressor {config.compressor[:60]!r}: torch's hooks are "
                f"{', '.join(REFERENCES)} (powersgd with :rank=R), with --sync ddp-hook"
            )
        _, _, rank = config.compressor.partition(":rank=")
        if rank and not (rank.isdigit() and int(rank) >= 1):
            raise ValueError(
                f"--compressor {config.compressor[:60]!r}: rank must be an integer >= 1"
            )
        return
    name, _ = parse_hook_spec(config.compressor)
    if config.sync in ("ddp-hook", "merged"):
        if name != POWERSGD:
            parse_spec(config.compressor)
        elif config.sync == "merged":
            raise ValueError("--sync merged takes a compressor spec; powersgd is a ddp-hook")
    if config.sync == "merged" and config.planner != "threshold":
        make_planner(config.planner)


def build_report(config: AllreduceConfig, results: Sequence[RankResult], wall: float) -> Report:
    """The report of a run, with simulate's fields (peers are ranks)."""
    schedules = (
        [{"epoch": 0, "effective_round": 1, "planner": config.planner}]
        if config.sync == "merged"
        else []
    )
    per_peer = [
        PeerReport(
            rank=r.rank,
            test_accuracy=r.test_accuracy,
            bytes_sent=int(round(r.traffic.link_bytes)),
            bytes_received=int(round(r.traffic.link_bytes)),  # a ring receives what it sends
            compute_seconds=r.compute_seconds,
            comm_seconds=r.comm_seconds,
            failed_exchanges=0,
            consensus_distance=r.consensus_distance,
            mismatched_epoch_exchanges=0,  # one plan, fixed before the first step
            schedule_epochs=schedules,
            test_loss=r.test_loss,
        )
        for r in results
    ]
    history = [
        HistoryPoint(
            round=points[0][0],
            mean_test_accuracy=statistics.fmean(p[1] for p in points),
            min_test_accuracy=min(p[1] for p in points),
            max_test_accuracy=max(p[1] for p in points),
            bytes_sent_total=int(round(sum(p[2] for p in points))),
        )
        for points in zip(*(r.history for r in results), strict=True)
    ]
    accuracies = [r.test_accuracy for r in results]
    first = results[0]
    extra = {
        "nproc": len(results),
        "payload_bytes_per_step": first.traffic.payload_bytes / first.steps,
        "link_bytes_per_step": first.traffic.link_bytes / first.steps,
        "step_seconds": statistics.median(r.step_seconds for r in results),
        "groups": first.groups,
    }
    label = config.compressor if config.sync in ("ddp-hook", "merged") else config.sync
    return Report(
        mode="allreduce",
        algorithm=f"{config.sync} {label}" if label != config.sync else config.sync,
        topology=f"all-reduce over {len(results)} ranks",
        rounds=config.steps,
        final_test_accuracy=statistics.fmean(accuracies),
        min_test_accuracy=min(accuracies),
        consensus_distance=statistics.fmean(r.consensus_distance for r in results),
        average_model_test_accuracy=first.average_model_test_accuracy,
        average_model_norm=first.average_model_norm,
        bytes_sent_total=sum(p.bytes_sent for p in per_peer),
        wall_seconds=wall,
        per_peer=per_peer,
        history=history,
        config={**asdict(config), **extra},
        final_test_loss=mean_loss([r.test_loss for r in results]),
        average_model_test_loss=first.average_model_test_loss,
    )


def _torchrun_rank(config: AllreduceConfig) -> tuple[Session, list[RankResult]]:
    session = init_from_env(config.timeout_s)
    try:
        with session.guard():
            result = train_rank(session, config)
            gathered: list[object] = [None] * session.world
            dist.all_gather_object(gathered, result)
    except BaseException:
        session.close()
        raise
    return session, [r for r in gathered if isinstance(r, RankResult)]


def run(args: argparse.Namespace) -> int:
    """Run the command; the exit status (module docstring)."""
    prog = "gossipcomp allreduce"
    try:
        config = config_of(args)
        check_config(config)
        if args.report is not None and args.report.is_dir():
            raise ValueError(f"--report {args.report}: is a directory; expected a file path")
        if args.report is not None and "{rank}" in str(args.report):
            raise ValueError(
                f"--report {quoted(str(args.report))}: all-reduce writes one report holding "
                "every rank (rank 0 writes it); expected a path without {rank}"
            )
    except ValueError as error:
        write_error(prog, error)
        return 2
    start = time.perf_counter()
    session = None
    try:
        if args.nproc is not None:
            results = spawn(
                train_rank,
                args.nproc,
                (config,),
                timeout_s=config.timeout_s,
                deadline_s=MAX_TIMEOUT_S * 24,
            )
        else:
            session, results = _torchrun_rank(config)
    except ValueError as error:
        write_error(prog, error)
        return 2
    except (LaunchError, RankFailure) as error:
        write_error(prog, error)
        return 1
    try:
        if session is not None and session.rank != 0:
            return 0
        report = build_report(config, results, time.perf_counter() - start)
        if not args.quiet:
            from rich.console import Console

            Console(stderr=True).print(report.summary_table())
        if args.report is not None:
            report.write_json(args.report)
    finally:
        if session is not None:
            session.close()
    return 0
