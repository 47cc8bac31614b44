"""What `simulate` and `peer` do alike around training: the checks before it (each names the
flag at fault), the progress bar during it, and the summary, report and plot after it."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gossipcomp.cli import training_flags
from gossipcomp.cli.common import check_outputs, check_plot_path, resolve_topology
from gossipcomp.experiment import TrainConfig, build_config_model, load_data
from gossipcomp.gossip.powergossip import largest_useful_rank
from gossipcomp.inputs.text import quoted
from gossipcomp.peer import LEVELS_LOGGER
from gossipcomp.topology import Topology

if TYPE_CHECKING:  # annotations only: the run imports them where it needs them
    from gossipcomp.experiment.report import Report
    from gossipcomp.experiment.simulation import CheckpointPolicy


class Prepared(NamedTuple):
    """A training run, checked: what to train, over which topology, with which checkpoints."""

    config: TrainConfig
    topology: Topology
    checkpoints: CheckpointPolicy | None


def prepare(
    args: argparse.Namespace,
    peer_rank: Callable[[argparse.Namespace, Topology], int] | None,
    low_rank_flag: str,
) -> tuple[Prepared, int | None]:
    """Every check of `simulate` and `peer` before training, in the order a mistake is named
    (`peer_rank`: this peer's rank, None for simulate); then one intra-op thread."""
    config = training_flags.config(args)
    topology = resolve_topology(args.topology)
    rank = peer_rank(args, topology) if peer_rank is not None else None
    fill_rank_in_paths(args, rank)
    checkpoints = training_flags.checkpoints(args)
    _check_low_rank(config, low_rank_flag)
    if getattr(args, "plot", None) is not None:
        check_plot_path(args.plot, "--plot")
    check_outputs(args)  # last: it makes directories, which no other mistake should leave
    torch.set_num_threads(1)  # many small peers share the cores; intra-op threads only contend
    return Prepared(config, topology, checkpoints), rank


RANK_FIELD = "{rank}"  # in --report and --checkpoint-dir of `peer`: replaced by the peer's rank


def fill_rank_in_paths(args: argparse.Namespace, rank: int | None) -> None:
    """Replace `{rank}` in --report and --checkpoint-dir by this peer's rank, so that peers
    launched with one command line (torchrun) write their own files (a --report without it
    gets the rank before its suffix under a launcher of several ranks). `simulate` writes one
    report for every peer and keeps checkpoints per peer already: `{rank}` there is refused."""
    _report_of_this_rank(args, rank)
    for name, flag in (("report", "--report"), ("checkpoint_dir", "--checkpoint-dir")):
        path: Path | None = getattr(args, name)
        if path is None or RANK_FIELD not in str(path):
            continue
        if rank is None:
            raise ValueError(
                f"{flag} {quoted(str(path))}: {RANK_FIELD} names one peer's file, and simulate "
                "runs every peer in one process (one report, checkpoints already per peer); "
                f"expected a path without {RANK_FIELD}"
            )
        setattr(args, name, Path(str(path).replace(RANK_FIELD, str(rank))))


def _report_of_this_rank(args: argparse.Namespace, rank: int | None) -> None:
    """A launcher (torchrun, srun) gives every peer one command line, its rank in RANK (or
    SLURM_PROCID) and the job's size in WORLD_SIZE (or SLURM_NTASKS): a --report without
    {rank} would be written by every peer in turn, keeping only the last. So each peer of such
    a launch writes its own: the rank goes before the suffix (report.json -> report.rank3.json)."""
    path: Path | None = args.report
    if rank is None or args.rank is not None or path is None or RANK_FIELD in str(path):
        return
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", ""))
    if world.isdigit() and len(world) <= 9 and int(world) > 1:
        args.report = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _check_low_rank(config: TrainConfig, flag: str) -> None:
    """Refuse a PowerGossip rank above what any matrix of the model can use. Each matrix caps
    the rank at its short side, where one power step already averages it exactly, so a larger
    rank changes nothing and is a typing mistake (--rank 100000 ran as 256)."""
    if config.algorithm_name != "powergossip":
        return
    limit = largest_useful_rank(build_config_model(config, load_data(config)).parameters())
    rank = config.algorithm_options()["rank"]
    if rank > limit:
        raise ValueError(
            f"{flag} {rank}: no weight matrix of the model can use a rank above {limit} "
            f"(its longest short side; at that rank a power step averages the matrix exactly); "
            f"expected 1 to {limit}"
        )


class ProgressDisplay:
    """A rich progress bar over rounds x peers, or nothing when quiet."""

    def __init__(self, console: Console, total: int, label: str, quiet: bool) -> None:
        self._progress = (
            None
            if quiet
            else Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
        )
        self._task = self._progress.add_task(label, total=total) if self._progress else None

    def __enter__(self) -> ProgressDisplay:
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress:
            self._progress.stop()

    def advance(self, rank: int, round: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)


def train_and_finish(
    args: argparse.Namespace,
    console: Console,
    checked: Prepared,
    train: Callable[..., Report],
    total: int,
    label: str,
) -> int:
    """Run `train` (run_peer or run_simulation with its own options bound) on the checked
    configuration and topology with its checkpoints and --report-every, a progress bar over
    `total` rounds, then `finish`."""
    if not args.quiet:
        logging.getLogger(LEVELS_LOGGER).setLevel(logging.INFO)  # link level changes are news
    with ProgressDisplay(console, total, label, args.quiet) as bar:
        report = train(
            checked.config,
            checked.topology,
            progress=bar.advance,
            checkpoints=checked.checkpoints,
            report_every=args.report_every,
        )
    finish(report, args, console)
    return 0


def finish(report: Report, args: argparse.Namespace, console: Console) -> None:
    """The summary table, the JSON report and the plot the flags ask for."""
    if not args.quiet:
        console.print(report.summary_table())
    if args.report:
        report.write_json(args.report)
        if not args.quiet:
            console.print(f"report written to {args.report}")
    if getattr(args, "plot", None) is not None:
        from gossipcomp.experiment.plot import curve_of, plot_curves  # matplotlib: only to draw

        plot_curves([curve_of(report)], args.plot)
        if not args.quiet:
            console.print(f"plot written to {args.plot}")
