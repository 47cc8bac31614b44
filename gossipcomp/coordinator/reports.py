"""A peer's report checked at the door: every field hostile until bounded.

Sizes and counts are bounded before anything is kept, numbers are range-checked (a round or
epoch that would overflow what the coordinator publishes is refused at the door), the sender
must be a peer of the topology with the same protocol and topology. What one report may claim
about the others (the model, rounds, epochs) is weighed against the others' reports in
planning.py. Errors quote what they echo shortened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from gossipcomp.compress import parse_spec
from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.levels.progress import MAX_LOSS
from gossipcomp.levels.rate import MAX_LEVEL, LevelCosts
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule import CompressorCost, TensorInfo
from gossipcomp.schedule.costs import check_sample
from gossipcomp.schedule.schedule import MAX_EPOCH, MAX_ROUND
from gossipcomp.topology import Topology
from gossipcomp.transport.base import PROTOCOL_VERSION

MAX_TENSORS = 1 << 14  # parameters of one model in a report: far above any model's count
MAX_NAME_CHARS = 1000  # characters of one parameter name
MAX_NAMES_CHARS = 1 << 20  # characters of all parameter names of one report
MAX_SIGNATURE_CHARS = 128  # a model signature (models.model_signature: 64 hex digits)
MAX_SAMPLES_PER_LINK = 64  # transfers of one link in one report
MAX_SECONDS = 86_400.0  # a measured time beyond a day is a lie or a bug
MAX_LEVELS = 64  # levels of one ladder in a report
MAX_MARGIN = 10_000  # rounds ahead a schedule may be published at most
# a reported round or epoch leaves room for what the coordinator publishes above it
MAX_REPORTED_ROUND = MAX_ROUND - 4 * MAX_MARGIN
MAX_REPORTED_EPOCH = MAX_EPOCH - (1 << 20)


class ReportRefused(ValueError):
    """A report the coordinator will not use; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MemberReport:
    """One peer's report, checked."""

    rank: int
    round: int
    epoch: int
    compute_seconds: float
    compressor: str
    compression: CompressorCost
    tensors: tuple[TensorInfo, ...]
    transfers: tuple[tuple[int, float], ...]  # (bytes, seconds) over all its links
    # neighbour -> its last sends there, (bytes, seconds until delivered), oldest first
    sends: dict[int, tuple[tuple[int, float], ...]]
    levels: LevelCosts | None  # the algorithm's ladder, None without per-link levels
    critical: bool = False  # in a critical learning phase (schedule/critical.py)
    joining: bool = False  # waits to be admitted by a schedule newer than `epoch`
    refused_epoch: int = 0  # the newest schedule it refused as unusable (0: none)
    late_epoch: int = 0  # the newest schedule that reached it after its round (0: none)
    initial_loss: float = 0.0  # its first round's training loss (0: not measured)
    loss: float = 0.0  # its recent rounds' mean training loss (0: not measured)


def _level_costs(request: cpb.PeerReport) -> LevelCosts | None:
    """The ladder a report states (None when it states none); ReportRefused when malformed."""
    if not request.level_costs:
        return None
    if len(request.level_costs) > MAX_LEVELS:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"level_costs: {len(request.level_costs)} levels, at most {MAX_LEVELS}",
        )
    costs = {}
    for entry in request.level_costs:
        level = checked_integer("level_costs level", entry.level, 0, MAX_LEVEL, _invalid)
        if level in costs:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"level_costs: level {level} listed twice"
            )
        costs[level] = checked_integer(
            "level_costs bytes_per_round", entry.bytes_per_round, 0, 1 << 40, _invalid
        )
    try:
        return LevelCosts(costs, request.exchanges_per_round)
    except ValueError as error:
        raise ReportRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


def _invalid(message: str) -> ReportRefused:
    """A field out of its range: the report is refused as INVALID_ARGUMENT."""
    return ReportRefused(grpc.StatusCode.INVALID_ARGUMENT, message)


def _samples(
    field: str, per: str, nbytes: Sequence[int], seconds: Sequence[float]
) -> tuple[tuple[int, float], ...]:
    """Check one list of (bytes, seconds) samples of a report; ReportRefused names `field`."""
    if len(nbytes) != len(seconds) or len(nbytes) > MAX_SAMPLES_PER_LINK:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: expected as many bytes as seconds, at most {MAX_SAMPLES_PER_LINK} "
            f"per {per}, got {len(nbytes)} and {len(seconds)}",
        )
    try:
        return tuple(check_sample(b, t, field) for b, t in zip(nbytes, seconds, strict=True))
    except ValueError as error:
        raise ReportRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


def check_report(topology: Topology, request: cpb.PeerReport) -> MemberReport:
    """The report of a peer of `topology`, checked; ReportRefused naming what is wrong."""
    if request.protocol_version != PROTOCOL_VERSION:
        raise ReportRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"protocol_version: expected {PROTOCOL_VERSION}, got {request.protocol_version}",
        )
    if request.topology_hash != topology.hash:
        raise ReportRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"topology_hash: {quoted(request.topology_hash)} is not this network's",
        )
    if not 0 <= request.sender < topology.n:
        raise ReportRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"sender: peer {request.sender} is not in the topology (0 to {topology.n - 1})",
        )
    if not 0 < len(request.model_signature) <= MAX_SIGNATURE_CHARS:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model_signature {quoted(request.model_signature)}: expected 1 to "
            f"{MAX_SIGNATURE_CHARS} characters",
        )
    if len(request.tensors) > MAX_TENSORS:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensors: {len(request.tensors)}, at most {MAX_TENSORS}",
        )
    names_chars = sum(len(tensor.name) for tensor in request.tensors)
    if names_chars > MAX_NAMES_CHARS:
        raise ReportRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensors: names of {names_chars} characters in all, at most {MAX_NAMES_CHARS}",
        )
    tensors = []
    for tensor in request.tensors:
        if not 0 < len(tensor.name) <= MAX_NAME_CHARS:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor name {quoted(tensor.name)}: expected 1 to {MAX_NAME_CHARS} characters",
            )
        numel = checked_integer(
            f"tensor {quoted(tensor.name)} numel", tensor.numel, 0, 1 << 40, _invalid
        )
        tensors.append(TensorInfo(tensor.name, numel))
    neighbours = set(topology.neighbors(request.sender))
    transfers: list[tuple[int, float]] = []
    for link in request.links:
        if link.neighbour not in neighbours:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"links: peer {link.neighbour} is not a neighbour of peer {request.sender}",
            )
        transfers.extend(_samples("links", "link", link.bytes, link.seconds))
    sends = {}
    for samples in request.sends:
        if samples.neighbour not in neighbours or samples.neighbour in sends:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"sends: peer {samples.neighbour} is not a neighbour of peer "
                f"{request.sender}, or is listed twice",
            )
        sends[samples.neighbour] = _samples("sends", "neighbour", samples.bytes, samples.seconds)
    levels = _level_costs(request)
    compressor = request.compressor
    if compressor:
        try:
            compressor = parse_spec(compressor).spec
        except (ValueError, TypeError) as error:
            raise ReportRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"compressor {quoted(compressor)}: {error}"
            ) from None
    return MemberReport(
        rank=request.sender,
        round=checked_integer("round", request.round, 0, MAX_REPORTED_ROUND, _invalid),
        epoch=checked_integer(
            "schedule_epoch", request.schedule_epoch, 0, MAX_REPORTED_EPOCH, _invalid
        ),
        compute_seconds=checked_number(
            "compute_seconds", request.compute_seconds, 0.0, MAX_SECONDS, error=_invalid
        ),
        compressor=compressor,
        compression=CompressorCost(
            checked_number(
                "compressor_fixed_seconds",
                request.compressor_fixed_seconds,
                0.0,
                MAX_SECONDS,
                error=_invalid,
            ),
            checked_number(
                "compressor_element_seconds",
                request.compressor_element_seconds,
                0.0,
                1.0,
                error=_invalid,
            ),
        ),
        tensors=tuple(tensors),
        transfers=tuple(transfers),
        sends=sends,
        levels=levels,
        critical=request.critical,
        joining=request.joining,
        refused_epoch=checked_integer(
            "refused_epoch", request.refused_epoch, 0, MAX_REPORTED_EPOCH, _invalid
        ),
        late_epoch=checked_integer(
            "late_epoch", request.late_epoch, 0, MAX_REPORTED_EPOCH, _invalid
        ),
        initial_loss=checked_number(
            "initial_loss", request.initial_loss, 0.0, MAX_LOSS, error=_invalid
        ),
        loss=checked_number("loss", request.loss, 0.0, MAX_LOSS, error=_invalid),
    )
