"""The report of a run: JSON for machines (written atomically), a summary table for people."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from gossipcomp.experiment import PeerOutcome
from gossipcomp.inputs.atomic_files import write_atomically

MAX_EXP = math.log(1e300)  # a larger loss's perplexity is reported as inf (JSON: Infinity)


@dataclass(frozen=True)
class PeerReport:
    rank: int
    test_accuracy: float
    bytes_sent: int
    bytes_received: int
    compute_seconds: float
    comm_seconds: float
    failed_exchanges: int
    consensus_distance: float  # squared distance of this peer's model to the network average
    mismatched_epoch_exchanges: int  # exchanges refused: the ends were in other schedule epochs
    # every schedule in force during the run: {epoch, effective_round, planner, budget_s, late}
    # (late: it reached this peer after its round; in force here from effective_round, after
    # the others)
    schedule_epochs: list[dict[str, Any]]
    byzantine: bool = False  # this peer lied to its neighbours (a robustness experiment)
    gossip_rounds: int = 0  # gossip rounds this peer ran (its local steps: Report.rounds)
    # each change of one of its links' compression level: {round, link: [i, j], level}
    link_levels: list[dict[str, Any]] = field(default_factory=list)
    # per neighbour: median seconds of its last 16 sends there (a round's transfer on that link)
    send_seconds: dict[int, float] = field(default_factory=dict)
    # each change of the level it broadcasts at (choco, def under --adaptive): {round, level}
    peer_levels: list[dict[str, Any]] = field(default_factory=list)
    # mean cross-entropy on the test set, nats a prediction (a language model's validation
    # loss, a character each); None where it was not measured (all-reduce mode)
    test_loss: float | None = None


@dataclass(frozen=True)
class HistoryPoint:
    round: int  # local steps every peer had done
    mean_test_accuracy: float
    min_test_accuracy: float
    bytes_sent_total: int
    gossip_round: int = 0  # gossip rounds the furthest peer had run by then
    max_test_accuracy: float = 0.0  # with min: the per-peer spread
    wall_seconds: float = 0.0  # seconds into the run of the slowest peer
    mean_test_loss: float | None = None  # None: some peer's entry had no loss (older run)


@dataclass(frozen=True)
class Report:
    """Fields every run reports; `per_peer` holds one entry per peer this process ran."""

    mode: str  # "simulate" or "peer"
    algorithm: str
    topology: str
    rounds: int  # local steps each peer took
    final_test_accuracy: float  # mean over the peers reported
    min_test_accuracy: float
    consensus_distance: float  # mean over peers of ||x_i - mean x||^2
    average_model_test_accuracy: float  # test accuracy of the network-average model
    average_model_norm: float  # L2 norm of the network-average model's parameters
    bytes_sent_total: int  # serialised bytes, all links of the peers reported
    wall_seconds: float
    per_peer: list[PeerReport]
    history: list[HistoryPoint] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    local_steps: int = 1  # local steps between gossip rounds
    gossip_rounds: int = 0  # gossip rounds the peers ran (the most of any reported peer)
    # mean and min over the reported peers that did not lie, derived from per_peer so that they
    # are never None while an honest peer is reported (None only for a report of liars alone: a
    # Byzantine `peer` process); the same as final/min_test_accuracy when no peer is Byzantine
    honest_test_accuracy: float | None = field(init=False)
    honest_min_test_accuracy: float | None = field(init=False)
    # exchanges refused, over all peers, because the two ends were in different schedule
    # epochs (0 when every peer switched schedules at the same round)
    mismatched_epoch_exchanges: int = field(init=False)
    # the schedules in force during the run, as the first peer reported saw them
    schedule_epochs: list[dict[str, Any]] = field(init=False)
    # every change of a reported link's compression level (--adaptive), in round order:
    # {round, link: [i, j], level}, the level in force on that link from that round on
    link_levels: list[dict[str, Any]] = field(init=False)
    # test loss (mean cross-entropy, nats a prediction) of the reported peers (mean) and of
    # the network-average model, and their perplexities exp(loss) (a language model's
    # figures); None where not measured
    final_test_loss: float | None = None
    average_model_test_loss: float | None = None
    final_test_perplexity: float | None = field(init=False)
    average_model_test_perplexity: float | None = field(init=False)

    def __post_init__(self) -> None:
        mean, minimum = honest_accuracy(self.per_peer)
        object.__setattr__(self, "honest_test_accuracy", mean)
        object.__setattr__(self, "honest_min_test_accuracy", minimum)
        mismatched = sum(p.mismatched_epoch_exchanges for p in self.per_peer)
        object.__setattr__(self, "mismatched_epoch_exchanges", mismatched)
        epochs = self.per_peer[0].schedule_epochs if self.per_peer else []
        object.__setattr__(self, "schedule_epochs", epochs)
        changes = {(c["round"], tuple(c["link"])): c for p in self.per_peer for c in p.link_levels}
        object.__setattr__(self, "link_levels", [changes[k] for k in sorted(changes)])
        object.__setattr__(self, "final_test_perplexity", perplexity(self.final_test_loss))
        average = perplexity(self.average_model_test_loss)
        object.__setattr__(self, "average_model_test_perplexity", average)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write the report atomically: a temporary file in the same folder, fsync, rename,
        fsync of the folder. A crash leaves the old report or the new one, never half of one."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_atomically(target, f".{target.name}.", text.encode())

    def _honest_caption(self) -> str:
        """The honest peers' accuracy when some peer lied; says so when every reported one did."""
        if not any(p.byzantine for p in self.per_peer):
            return ""
        if self.honest_test_accuracy is None or self.honest_min_test_accuracy is None:
            return "; no honest peer in this report (every peer reported lied)"
        return (
            f"; honest peers: mean {self.honest_test_accuracy:.4f}, "
            f"min {self.honest_min_test_accuracy:.4f}"
        )

    def _accuracy_caption(self) -> str:
        """Mean and min over the peers; one peer's accuracy when the report holds one."""
        if len(self.per_peer) == 1:
            return f"peer {self.per_peer[0].rank} accuracy {self.final_test_accuracy:.4f}"
        return f"mean accuracy {self.final_test_accuracy:.4f}, min {self.min_test_accuracy:.4f}"

    def _loss_caption(self) -> str:
        """The test loss and perplexity, where measured (of the peers, then the average)."""
        if self.final_test_loss is None:
            return ""
        text = (
            f", test loss {self.final_test_loss:.4f} (perplexity {self.final_test_perplexity:.2f})"
        )
        if self.average_model_test_loss is not None:
            text += f", average model's {self.average_model_test_loss:.4f}"
        return text

    def summary_table(self) -> Table:
        table = Table(
            title=f"{self.algorithm} on {self.topology}, {self.rounds} local steps, "
            f"{self.gossip_rounds} gossip rounds ({self.mode})",
            caption=(
                f"{self._accuracy_caption()}, average model "
                f"{self.average_model_test_accuracy:.4f}, consensus distance "
                f"{self.consensus_distance:.3e}, {self.bytes_sent_total / 1e6:.2f} MB sent, "
                f"{self.wall_seconds:.1f} s" + self._loss_caption() + self._honest_caption()
            ),
        )
        for column in ("peer", "test acc", "MB sent", "MB recv", "compute s", "comm s", "fails"):
            table.add_column(column, justify="right")
        for p in self.per_peer:
            table.add_row(
                f"{p.rank} (byzantine)" if p.byzantine else str(p.rank),
                f"{p.test_accuracy:.4f}",
                f"{p.bytes_sent / 1e6:.2f}",
                f"{p.bytes_received / 1e6:.2f}",
                f"{p.compute_seconds:.2f}",
                f"{p.comm_seconds:.2f}",
                str(p.failed_exchanges),
            )
        return table


def perplexity(loss: float | None) -> float | None:
    """exp(loss), the perplexity of a mean cross-entropy in nats (inf where it overflows)."""
    if loss is None:
        return None
    return math.exp(loss) if loss < MAX_EXP else math.inf


def mean_loss(losses: Sequence[float | None]) -> float | None:
    """The mean of `losses`, None if any is None (not measured everywhere) or there are none."""
    known = [loss for loss in losses if loss is not None]
    if not known or len(known) != len(losses):
        return None
    return sum(known) / len(known)


def flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """All parameters as one float64 vector."""
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params])


def peer_reports(
    outcomes: Sequence[PeerOutcome], distances: Sequence[float], byzantine: Collection[int] = ()
) -> list[PeerReport]:
    """One row per peer; `byzantine`: the ranks that lied."""
    return [
        PeerReport(
            rank=o.rank,
            test_accuracy=o.test_accuracy,
            bytes_sent=o.stats.bytes_sent_total,
            bytes_received=sum(o.stats.bytes_received.values()),
            compute_seconds=o.stats.compute_seconds,
            comm_seconds=o.stats.comm_seconds,
            failed_exchanges=sum(o.stats.failed_exchanges.values()),
            consensus_distance=d,
            mismatched_epoch_exchanges=o.stats.mismatched_epoch_exchanges,
            schedule_epochs=[
                {
                    "epoch": s.epoch,
                    "effective_round": s.effective_round,
                    "planner": s.planner,
                    "budget_s": s.budget_s,
                    "late": s.epoch in o.stats.late_epochs,
                }
                for s in o.stats.schedule_epochs
            ],
            byzantine=o.rank in byzantine,
            gossip_rounds=o.stats.rounds,
            link_levels=[dict(c) for c in o.stats.link_levels],
            send_seconds=dict(o.stats.send_seconds),
            peer_levels=[dict(c) for c in o.stats.peer_levels],
            test_loss=o.test_loss,
        )
        for o, d in zip(outcomes, distances, strict=True)
    ]


def honest_accuracy(per_peer: Sequence[PeerReport]) -> tuple[float | None, float | None]:
    """Mean and min test accuracy of the peers that did not lie (None, None when all lied)."""
    honest = [p.test_accuracy for p in per_peer if not p.byzantine]
    if not honest:
        return None, None
    return sum(honest) / len(honest), min(honest)


def merge_history(outcomes: Sequence[PeerOutcome]) -> list[HistoryPoint]:
    """Network-wide accuracy and bytes at each checkpoint round all peers recorded."""
    by_round: dict[int, list[tuple[float, int, int, float, float | None]]] = {}
    for outcome in outcomes:
        for point in outcome.history:
            row = (
                point.test_accuracy,
                point.bytes_sent,
                point.gossip_round,
                point.seconds,
                point.test_loss,
            )
            by_round.setdefault(point.round, []).append(row)
    return [
        HistoryPoint(
            round=r,
            mean_test_accuracy=sum(row[0] for row in rows) / len(rows),
            min_test_accuracy=min(row[0] for row in rows),
            bytes_sent_total=sum(row[1] for row in rows),
            gossip_round=max(row[2] for row in rows),
            max_test_accuracy=max(row[0] for row in rows),
            wall_seconds=max(row[3] for row in rows),
            mean_test_loss=mean_loss([row[4] for row in rows]),
        )
        for r, rows in sorted(by_round.items())
        if len(rows) == len(outcomes)
    ]
