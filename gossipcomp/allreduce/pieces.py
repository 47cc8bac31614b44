"""Whole all_gathers or pieces of them: chosen by timing both on the job's own link.

Why: top-k, random-k and the other compressors whose payloads cannot be summed synchronise by
all_gather. On a slow link gloo moves one large all_gather message at about 1.5 times its wire
time and leaves the ranks about half a transfer apart, so the next step's first collective,
however small, waits that long; the same bytes as all_gathers of at most 16 KiB run at about
1.24 times their wire time and keep the ranks in step (benchmarks/collective_skew.py,
docs/benchmarks.md). On a fast link every piece pays a collective's fixed cost and gains
nothing. Which holds depends on the link and the backend, so it is measured, not assumed: every
rank times whole all_gathers of the run's payload and the same bytes in pieces of each
candidate size, interleaved, each started with the ranks in step (a one-element all_reduce
first), the first round left out; the slowest rank's mean of each counts (an all_reduce MAX,
so every rank takes the same choice and the collectives stay matched), and the option of the
least wins (whole all_gathers on a tie). The mean, not the median: a whole all_gather on the
shaped hub takes either about 1.05 or about 1.55 times its wire time, call by call (pieces of
8 KiB: 1.1-1.2 every time), and a run pays the mean.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gossipcomp.allreduce.comm import Communicator, Traffic
from gossipcomp.allreduce.settings import parse_gather_pieces
from gossipcomp.compress import Compressor
from gossipcomp.inputs.numbers import checked_integer

log = logging.getLogger(__name__)

PIECE_CANDIDATES = (8 << 10, 16 << 10, 64 << 10)  # bytes a piece may hold, tried beside whole
DEFAULT_REPEATS = 8  # timed rounds of every option, after one left out
MIN_REPEATS = 2  # timed rounds taken even past the time budget
PROBE_BUDGET_S = 5.0  # no round starts after this (on the slowest rank), past MIN_REPEATS
MAX_PROBE_BYTES = 1 << 20  # the largest payload timed (a larger one is timed at this size)


@dataclass(frozen=True)
class GatherChoice:
    """The piece size taken (None: whole all_gathers), each option's mean seconds on the
    slowest rank (key: the piece bytes, 0 for whole) and the rounds timed."""

    piece_bytes: int | None
    seconds: dict[int, float]
    rounds: int = 0


def set_gather_pieces(
    communicator: Communicator,
    setting: str,
    compressors: Sequence[Compressor],
    numel: int,
    device: torch.device | str = "cpu",
) -> int | None:
    """Set and return `communicator.gather_piece_bytes` as `setting` gives it (auto, whole, or
    the KiB of a piece: settings.parse_gather_pieces), where one of `compressors` (those the
    run may use) all-gathers and there is another rank; else whole, whatever the setting.
    For auto, timed (choose_gather_pieces) with the largest of those compressors' payloads
    of `numel` elements. Every rank must call it with the same arguments."""
    gathered = [c for c in compressors if not c.summable]
    given = parse_gather_pieces(setting)
    if communicator.world == 1 or not gathered:
        if given and not gathered:
            log.warning(
                "gather_pieces %s: ignored, none of the compressors (%s) all-gathers (their "
                "payloads are summed by all_reduce, which goes whole)",
                setting,
                ", ".join(sorted({c.name for c in compressors})) or "none",
            )
        communicator.gather_piece_bytes = None
    elif given is not None:
        communicator.gather_piece_bytes = given or None
    else:
        payload = max(c.wire_bytes(numel) for c in gathered)
        communicator.gather_piece_bytes = choose_gather_pieces(
            communicator, payload, device
        ).piece_bytes
    return communicator.gather_piece_bytes


def choose_gather_pieces(
    communicator: Communicator,
    nbytes: int,
    device: torch.device | str = "cpu",
    candidates: Sequence[int] = PIECE_CANDIDATES,
    repeats: int = DEFAULT_REPEATS,
) -> GatherChoice:
    """Time whole all_gathers of `nbytes` (at most MAX_PROBE_BYTES) against pieces of each of
    `candidates` bytes (those smaller) and set `communicator.gather_piece_bytes` to the faster
    (module docstring): `repeats` rounds, fewer (not under MIN_REPEATS) once PROBE_BUDGET_S
    has passed on the slowest rank, which every rank learns from the all_reduce that puts
    them in step, so all stop at the same round. Every rank must call it with the same
    arguments; its traffic is not counted."""
    checked_integer("all_gather probe: bytes", nbytes, 1, 1 << 40)
    checked_integer("all_gather probe: repeats", repeats, 1, 100)
    for piece in candidates:
        checked_integer("all_gather probe: piece bytes", piece, 1, 1 << 40)
    size = min(nbytes, MAX_PROBE_BYTES)
    options = [0, *sorted({p for p in candidates if p < size})]
    if len(options) == 1:
        communicator.gather_piece_bytes = None
        return GatherChoice(None, {})
    payload = torch.zeros(size, dtype=torch.uint8, device=device)
    token = torch.zeros(1, device=device)
    counted, chosen = communicator.traffic, communicator.gather_piece_bytes
    communicator.traffic = Traffic()  # the probe's bytes are not the run's
    times: dict[int, list[float]] = {option: [] for option in options}
    began = time.perf_counter()
    try:
        for repeat in range(repeats + 1):
            if repeat > MIN_REPEATS and _slowest(token, began, communicator) > PROBE_BUDGET_S:
                break  # every rank learns the same slowest time: all stop at this round
            for option in options:
                communicator.gather_piece_bytes = option or None
                # in step first: a whole all_gather leaves the ranks apart, and that wait
                # would fall on the next option timed (it is in the later rank's own time)
                _slowest(token, began, communicator)
                start = time.perf_counter()
                communicator.all_gather(payload)
                if payload.is_cuda:
                    torch.cuda.synchronize(payload.device)
                if repeat:
                    times[option].append(time.perf_counter() - start)
    finally:
        communicator.traffic, communicator.gather_piece_bytes = counted, chosen
    means = torch.tensor(
        [statistics.fmean(times[option]) for option in options],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(means, op=dist.ReduceOp.MAX, group=communicator.group)
    seconds = dict(zip(options, means.tolist(), strict=True))
    piece = faster_pieces(seconds)
    communicator.gather_piece_bytes = piece
    log.info(
        "all_gather of %d bytes, %d rounds: %s (%s)",
        size,
        len(times[0]),
        f"pieces of {piece} bytes" if piece else "whole",
        ", ".join(
            f"{f'{option} B pieces' if option else 'whole'} {1e3 * s:.1f} ms"
            for option, s in seconds.items()
        ),
    )
    return GatherChoice(piece, seconds, len(times[0]))


def _slowest(token: torch.Tensor, began: float, communicator: Communicator) -> float:
    """The most seconds any rank has spent since its `began` (an all_reduce MAX: it also
    puts the ranks in step)."""
    token.fill_(time.perf_counter() - began)
    dist.all_reduce(token, op=dist.ReduceOp.MAX, group=communicator.group)
    return float(token.item())


def faster_pieces(seconds: Mapping[int, float]) -> int | None:
    """The piece size (bytes) whose all_gathers took the least time in `seconds` (piece bytes
    -> seconds, 0 for whole ones), if less than whole all_gathers took; else None."""
    if 0 not in seconds:
        raise ValueError("all_gather timings: expected whole all_gathers' (key 0) among them")
    pieces = [option for option in seconds if option > 0]
    if not pieces:
        return None
    best = min(pieces, key=lambda option: (seconds[option], option))
    return best if seconds[best] < seconds[0] else None
