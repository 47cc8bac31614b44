"""all_gather in pieces (gossipcomp/allreduce/pieces.py), on real gloo ranks: pieces deliver
exactly what whole all_gathers do, the choice between them is the same on every rank and costs
no counted traffic, on a slow NIC small pieces run near their wire time, a run trains the same
model whichever way its all_gathers go, and a bad --gather-pieces is refused naming what was
expected."""

from __future__ import annotations

import pytest
import torch
from helpers import benchmark, needs_namespaces

import gossipcomp.allreduce.pieces as pieces_module
from gossipcomp.allreduce import Communicator, spawn
from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.pieces import (
    PIECE_CANDIDATES,
    GatherChoice,
    choose_gather_pieces,
    faster_pieces,
    set_gather_pieces,
)
from gossipcomp.allreduce.settings import parse_gather_pieces
from gossipcomp.allreduce.train import AllreduceConfig, RankResult, train_rank
from gossipcomp.compress import parse_spec


def _payloads(rank: int) -> list[torch.Tensor]:
    """Each rank's own tensors: odd sizes, three dtypes, one not contiguous."""
    generator = torch.Generator().manual_seed(rank)
    return [
        torch.randn(10_007, generator=generator),
        torch.randint(0, 256, (50_001,), dtype=torch.uint8, generator=generator),
        torch.randint(-(2**40), 2**40, (300, 700), dtype=torch.int64, generator=generator).t(),
        torch.randn(3, generator=generator),  # smaller than a piece: one all_gather
    ]


def _gather_worker(session: Session) -> dict[str, object]:
    comm = Communicator()
    whole = [comm.all_gather(t) for t in _payloads(session.rank)]
    counted_whole = comm.traffic.copy()
    comm.traffic = type(counted_whole)()
    comm.gather_piece_bytes = 4096
    pieces = [comm.all_gather(t) for t in _payloads(session.rank)]
    comm.close()
    return {"whole": whole, "pieces": pieces, "traffic": (counted_whole, comm.traffic)}


def test_pieces_deliver_every_rank_s_tensor_exactly_as_a_whole_all_gather_does() -> None:
    ranks = spawn(_gather_worker, 2, timeout_s=30, deadline_s=120)
    for rank in ranks:
        for whole, pieces, sent in zip(
            rank["whole"], rank["pieces"], zip(_payloads(0), _payloads(1), strict=True), strict=True
        ):
            for got_whole, got_pieces, original in zip(whole, pieces, sent, strict=True):
                assert got_pieces.shape == original.shape and got_pieces.dtype == original.dtype
                assert torch.equal(got_pieces, original)
                assert torch.equal(got_whole, original)
        counted_whole, counted_pieces = rank["traffic"]
        assert counted_pieces == counted_whole  # the same bytes, one collective each


def _choose_worker(session: Session, nbytes: int) -> tuple[GatherChoice, int | None, object]:
    comm = Communicator()
    counted = comm.traffic  # what a caller holds on to keeps counting the run's traffic only
    choice = choose_gather_pieces(comm, nbytes)
    comm.close()
    assert comm.traffic is counted
    return choice, comm.gather_piece_bytes, comm.traffic


def _setting_worker(session: Session) -> dict[str, int | None]:
    comm = Communicator()
    fp16, topk = parse_spec("fp16"), parse_spec("topk:ratio=0.01")
    cases = {
        "16 KiB, nothing all-gathered": ("16", [fp16]),
        "16 KiB, one spec of the plan all-gathers": ("16", [fp16, topk]),
        "auto, nothing all-gathered": ("auto", [fp16]),
        "whole": ("whole", [topk]),
    }
    out = {name: set_gather_pieces(comm, *case, numel=1 << 20) for name, case in cases.items()}
    comm.close()
    assert comm.traffic.collectives == 0  # no probe ran
    return out


def test_a_setting_applies_only_where_a_compressor_of_the_run_all_gathers() -> None:
    for out in spawn(_setting_worker, 2, timeout_s=30, deadline_s=120):
        assert out == {
            "16 KiB, nothing all-gathered": None,
            "16 KiB, one spec of the plan all-gathers": 16 << 10,
            "auto, nothing all-gathered": None,
            "whole": None,
        }


def test_every_rank_takes_the_same_measured_choice_and_the_probe_counts_no_traffic() -> None:
    nbytes = 200_000
    ranks = spawn(_choose_worker, 2, (nbytes,), timeout_s=30, deadline_s=120)
    (first, set_first, traffic), (second, set_second, _) = ranks
    assert first == second  # the slowest rank's means: one choice everywhere
    assert set(first.seconds) == {0, *PIECE_CANDIDATES}
    assert first.rounds == pieces_module.DEFAULT_REPEATS  # on loopback, well within the time budget
    assert all(s > 0 for s in first.seconds.values())
    assert first.piece_bytes == faster_pieces(first.seconds) == set_first == set_second
    assert traffic.payload_bytes == 0 and traffic.collectives == 0


def _hurried_worker(session: Session) -> GatherChoice:
    pieces_module.PROBE_BUDGET_S = 0.0  # every round past the minimum is over the budget
    comm = Communicator()
    choice = choose_gather_pieces(comm, 200_000)
    comm.close()
    return choice


def test_past_its_time_budget_the_probe_stops_at_the_same_round_on_every_rank() -> None:
    ranks = spawn(_hurried_worker, 2, timeout_s=30, deadline_s=120)
    assert [choice.rounds for choice in ranks] == [pieces_module.MIN_REPEATS] * 2
    assert ranks[0] == ranks[1]


def test_a_payload_no_larger_than_every_piece_is_not_probed() -> None:
    ranks = spawn(_choose_worker, 2, (min(PIECE_CANDIDATES),), timeout_s=30, deadline_s=120)
    assert [r[0] for r in ranks] == [GatherChoice(None, {})] * 2


@needs_namespaces()
def test_on_a_slow_nic_small_pieces_run_near_their_wire_time_and_the_fastest_is_taken() -> None:
    """2 ranks behind 14.7 Mbit/s NICs (benchmarks/shaped_hub.py), top-1%'s payload of the
    256-wide residual MLP (128,888 bytes, 70 ms of wire). A whole all_gather there takes about
    1.04x or 1.55x its wire time, call by call, so which wins a probe varies; 8 KiB pieces
    took 1.1-1.25x every time (docs/benchmarks.md). Every option takes at least its wire time,
    8 KiB pieces at most 1.35x, and the choice is the option of the least mean."""
    shaped_hub = benchmark("shaped_hub")
    nbytes, mbit = 128_888, 14.7
    with shaped_hub.ShapedHub(2, mbit) as hub:
        ranks = shaped_hub.run_ranks(hub, _choose_worker, (nbytes,), deadline_s=120)
    (choice, _, _), (other, _, _) = ranks
    assert choice == other
    wire_s = nbytes * 8 / (mbit * 1e6)
    assert min(choice.seconds.values()) >= 0.95 * wire_s, choice
    assert choice.seconds[8 << 10] <= 1.35 * wire_s, choice
    fastest = min(choice.seconds, key=lambda option: (choice.seconds[option], option))
    assert (choice.piece_bytes or 0) == fastest, choice


def test_pieces_are_taken_only_when_they_are_faster_than_whole_all_gathers() -> None:
    whole = 0.100
    assert faster_pieces({0: whole, 16384: 0.076, 65536: 0.090}) == 16384  # the fastest
    assert faster_pieces({0: whole, 8192: 0.076, 16384: 0.076}) == 8192  # a tie: fewer bytes
    assert faster_pieces({0: whole, 16384: whole}) is None  # a tie with whole: whole
    assert faster_pieces({0: whole, 16384: 0.2, 65536: 0.2}) is None  # a fast link
    assert faster_pieces({0: whole}) is None
    with pytest.raises(ValueError, match="whole all_gathers"):
        faster_pieces({16384: 0.1})


def _train_worker(session: Session, configs: list[AllreduceConfig]) -> list[RankResult]:
    return [train_rank(session, config) for config in configs]


def test_a_run_trains_the_same_model_whether_its_all_gathers_go_whole_or_in_pieces() -> None:
    """merged top-10% with error feedback, 30 steps: 1 KiB pieces against whole all_gathers
    give the same model bit for bit (pieces change how bytes travel, not which)."""
    base = {"sync": "merged", "compressor": "topk:ratio=0.1", "planner": "threshold", "steps": 30}
    configs = [
        AllreduceConfig(**base, gather_pieces="whole"),
        AllreduceConfig(**base, gather_pieces="1"),
    ]
    ranks = spawn(_train_worker, 2, (configs,), timeout_s=30, deadline_s=150)
    for whole, pieces in ranks:
        assert (whole.gather_piece_bytes, pieces.gather_piece_bytes) == (0, 1024)
        assert pieces.average_model_norm == whole.average_model_norm
        assert pieces.consensus_distance == whole.consensus_distance
        assert pieces.test_accuracy == whole.test_accuracy
        assert pieces.traffic == whole.traffic


@pytest.mark.parametrize(
    ("text", "expected"), [("auto", None), ("whole", 0), ("16", 16 << 10), (" 64 ", 64 << 10)]
)
def test_gather_pieces_parse(text: str, expected: int | None) -> None:
    assert parse_gather_pieces(text) == expected


@pytest.mark.parametrize(
    "text", ["0", "-16", "16k", "1.5", "", "x" * 10_000, str(1 << 21), "\uff11\uff16"]
)
def test_a_bad_gather_pieces_is_refused_naming_what_was_expected(text: str) -> None:
    with pytest.raises(ValueError, match="expected auto, whole, or the KiB of a piece") as error:
        AllreduceConfig(gather_pieces=text)
    assert len(str(error.value)) < 200  # the input is not echoed in full


def test_pieces_asked_for_where_nothing_all_gathers_are_ignored_with_a_warning(caplog) -> None:
    """An explicit piece size with summable compressors only (fp16: all_reduce) cannot apply:
    the run says so instead of ignoring it silently; whole or auto say nothing."""
    communicator = Communicator.__new__(Communicator)
    communicator.world, communicator.gather_piece_bytes = 2, None
    fp16 = [parse_spec("fp16")]
    with caplog.at_level("WARNING", logger="gossipcomp.allreduce.pieces"):
        assert set_gather_pieces(communicator, "16", fp16, 1000) is None
        assert "gather_pieces 16: ignored, none of the compressors (fp16)" in caplog.text
        caplog.clear()
        for setting in ("whole", "auto"):
            assert set_gather_pieces(communicator, setting, fp16, 1000) is None
        assert caplog.text == ""
