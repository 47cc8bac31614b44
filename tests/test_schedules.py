"""Versioned schedules at the peers: staged, switched at the same round, refused when wrong.

Several peers over real gRPC (and the in-memory hub for the quick cases) switch tensor groups
mid-run; every exchange is checked to happen under one epoch at both ends, the network average
is kept across switches (Choco with a symmetric W), and a schedule that does not fit is refused
with the peer's schedule, expectations and model unchanged.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_network, gossip_round, in_memory_trainers, run_in_threads, stacked
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.experiment import PeerTrainer, TrainConfig
from gossipcomp.gossip import DPSGD, Choco
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import Schedule, ScheduleBook, ScheduleRefused
from gossipcomp.topology import build_topology, load_topology
from gossipcomp.transport.memory import InMemoryHub
from gossipcomp.workload.models import build_mlp

RING4 = build_topology("ring", n=4)


def _models(n: int) -> list[nn.Module]:
    models = []
    for rank in range(n):
        torch.manual_seed(7 + rank)
        models.append(nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3)))
    return models


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _single(names: list[str], epoch: int, at: int, compressor: str = "sign") -> Schedule:
    return Schedule(epoch, at, (TensorGroup(tuple(names), compressor),), planner="single")


def _pairs(names: list[str], epoch: int, at: int) -> Schedule:
    """Weights merged with the next layer's bias, in an order that is not the model's."""
    return Schedule(
        epoch,
        at,
        (
            TensorGroup((names[2], names[1]), "sign"),
            TensorGroup((names[0], names[3]), "topk:ratio=0.5"),
        ),
        planner="hand",
    )


def _choco() -> Choco:
    return Choco(parse_spec("sign"), consensus_step=0.4)


def test_every_exchange_of_a_run_with_several_switches_is_under_one_epoch():
    """ring4 over gRPC, schedules switching at rounds 3, 6 and 9: no exchange fails or
    mismatches, every peer switched at the same rounds, the envelopes carry one wire tensor per
    group of the schedule in force, and the network average stays where it was."""
    models = _models(4)
    peers = build_network(RING4, models, _choco, transport="grpc")
    try:
        names = _names(models[0])
        schedules = [
            _single(names, 1, 3),
            _pairs(names, 2, 6),
            Schedule(3, 9, planner="per-tensor"),
        ]
        for peer in peers:
            for schedule in schedules:
                peer.apply(schedule)
        before = [x.sum(0) for x in stacked(peers)]
        sent_per_round: list[int] = []
        for _ in range(12):
            total_before = sum(p.stats.bytes_sent_total for p in peers)
            gossip_round(peers)
            sent_per_round.append(sum(p.stats.bytes_sent_total for p in peers) - total_before)
        for peer in peers:
            stats = peer.stats
            assert stats.mismatched_epoch_exchanges == 0
            assert stats.failed_exchanges == {}
            assert [(s.epoch, s.effective_round) for s in stats.schedule_epochs] == [
                (0, 0),
                (1, 3),
                (2, 6),
                (3, 9),
            ]
        after = [x.sum(0) for x in stacked(peers)]
        for a, b in zip(before, after, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        # one merged sign buffer is smaller on the wire than four separate ones
        assert sent_per_round[3] < sent_per_round[0]
        # back to one group per parameter: the same bytes as round 1, plus the epoch field
        # (a tag and a one-byte varint) in each of the 8 envelopes of a ring4 round
        assert sent_per_round[9] == sent_per_round[1] + 2 * 8
    finally:
        for peer in peers:
            peer.close()


def test_a_peer_switching_a_round_early_fails_those_exchanges_and_they_are_counted(caplog):
    """Peer 0 puts epoch 1 in force at round 2, its neighbours at round 3: at round 2 the
    envelopes between them are sent under different epochs, so those exchanges fail (nothing
    is used under two epochs), are counted, and are named in the link log."""
    models = _models(4)
    # 2 s: under a loaded CI machine, 0.5 s let the rounds time out before any epoch mismatch
    peers = build_network(RING4, models, _choco, round_timeout=2.0)
    try:
        names = _names(models[0])
        peers[0].apply(_single(names, 1, 2))
        for peer in peers[1:]:
            peer.apply(_single(names, 1, 3))
        for _ in range(3):
            gossip_round(peers)
        assert sum(p.stats.mismatched_epoch_exchanges for p in peers) > 0
        assert set(peers[0].stats.failed_exchanges) == {1, 3}
        assert peers[2].stats.failed_exchanges == {}  # not a neighbour of peer 0
        assert peers[2].stats.mismatched_epoch_exchanges == 0
        assert "schedule epoch" in caplog.text or "schedule_epoch" in caplog.text
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda n: Schedule(1, 5, (TensorGroup(tuple(n[:3]), "sign"),)), "in no group|leaves out"),
        (
            lambda n: Schedule(1, 5, (TensorGroup(tuple(n), "sign"), TensorGroup((n[0],), "sign"))),
            "more than once",
        ),
        (lambda n: Schedule(1, 5, (TensorGroup((*n, "ghost.weight"), "sign"),)), "unknown"),
        (lambda n: Schedule(1, 5, (TensorGroup(tuple(n), "zip:level=9"),)), "compressor"),
        (lambda n: Schedule(0, 5), "expected an epoch after 0"),
        (lambda n: Schedule(1, 2), "in the past"),
    ],
)
def test_a_schedule_that_does_not_fit_is_refused_and_nothing_changes(change, message):
    models = _models(4)
    peers = build_network(RING4, models, _choco)
    try:
        for _ in range(3):
            gossip_round(peers)
        peer = peers[1]
        inbox_before = dict(peer.transport.inbox._specs)
        with pytest.raises(ScheduleRefused, match=message):
            peer.apply(change(_names(models[0])))
        assert peer.schedules.newest.epoch == 0
        assert peer.transport.schedule_epoch == 0
        assert peer.transport.inbox._specs == inbox_before
        gossip_round(peers)  # and it trains on under the current schedule
        assert all(p.stats.failed_exchanges == {} for p in peers)
    finally:
        for peer in peers:
            peer.close()


def test_groups_for_an_algorithm_that_sends_no_compressed_groups_are_refused():
    models = _models(4)
    peers = build_network(RING4, models, DPSGD)
    try:
        with pytest.raises(ScheduleRefused, match="sends no compressed groups"):
            peers[0].apply(_single(_names(models[0]), 1, 5))
        peers[0].apply(Schedule(1, 5))  # an epoch without groups is fine
        assert peers[0].schedules.newest.epoch == 1
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.parametrize(
    "field,value",
    [("epoch", -1), ("epoch", 2**31), ("effective_round", 2**53), ("epoch", True), ("planner", "")],
)
def test_schedule_fields_out_of_range_are_refused_naming_them(field, value):
    values = {"epoch": 1, "effective_round": 5, "planner": "single", field: value}
    with pytest.raises(ScheduleRefused, match=field):
        Schedule(**values)


def test_a_malformed_schedule_dict_is_refused_and_a_good_one_round_trips():
    good = _pairs(["a", "b", "c", "d"], 4, 40)
    assert Schedule.from_dict(good.to_dict()) == good
    for bad in (
        [],
        {**good.to_dict(), "extra": 1},
        {**good.to_dict(), "groups": [{"names": "a", "compressor": "sign"}]},
        {**good.to_dict(), "groups": [{"names": [1], "compressor": "sign"}]},
        {**good.to_dict(), "epoch": "4"},
    ):
        with pytest.raises(ScheduleRefused):
            Schedule.from_dict(bad)


def test_the_book_goes_to_the_latest_due_schedule_and_bounds_what_waits():
    book = ScheduleBook(["a", "b"])
    for epoch in range(1, 5):
        book.stage(Schedule(epoch, 10 * epoch), round=0)
    with pytest.raises(ScheduleRefused, match="already wait"):
        book.stage(Schedule(5, 50), round=0)
    assert book.epoch_at(25) == 2
    assert book.due(9) is None
    jumped = book.due(35)  # a peer that jumped over rounds 10, 20 and 30
    assert jumped is not None and jumped.epoch == 3
    assert [s.epoch for s in book.staged] == [4]
    restored = ScheduleBook(["a", "b"])
    restored.load_state_dict(book.state_dict(), round=35)
    assert restored.current == book.current and restored.staged == book.staged
    state = book.state_dict()
    state["staged"] = [Schedule(2, 5).to_dict()]  # goes back in epoch and round
    with pytest.raises(ScheduleRefused, match="does not follow"):
        ScheduleBook(["a", "b"]).load_state_dict(state, round=35)


def _trainers(rounds: int, directory, schedule: Schedule | None) -> list[PeerTrainer]:
    config = TrainConfig(algorithm="choco", compressor="ef+sign", rounds=rounds, eval_every=0)
    trainers = in_memory_trainers(
        load_topology("topologies/ring4.yaml"), config, InMemoryHub(), directory, 10
    )
    if schedule is not None:
        for trainer in trainers:
            trainer.peer.apply(schedule)
    return trainers


def _run(trainers: list[PeerTrainer]) -> None:
    for trainer in trainers:
        trainer.peer.start(5, {})
    run_in_threads([trainer.run for trainer in trainers])


def test_a_network_restored_under_a_schedule_continues_bit_for_bit(tmp_path):
    """ef+sign Choco on ring4 with one merged group from round 5: 30 rounds straight, against
    20 rounds, checkpoints, every peer rebuilt from its files (the schedule comes back from
    them) and 10 more. Models, public copies and error memories agree bit for bit."""
    names = [name for name, _ in build_mlp(0).named_parameters()]
    schedule = _single(names, 1, 5, compressor="ef+sign")
    straight = _trainers(30, None, schedule)
    _run(straight)
    _run(_trainers(20, tmp_path, schedule))
    resumed = _trainers(30, tmp_path, None)
    for trainer in resumed:
        assert trainer.restore() == 20
        assert trainer.peer.schedules.current == schedule
    _run(resumed)
    for a, b in zip(straight, resumed, strict=True):
        assert a.peer.stats.mismatched_epoch_exchanges == b.peer.stats.mismatched_epoch_exchanges
        mine, theirs = a.peer.state_dict(), b.peer.state_dict()
        for x, y in zip(mine["model"].values(), theirs["model"].values(), strict=True):
            assert torch.equal(x, y)
        for key in ("public", "feedback"):
            first, second = mine["algorithm"][key], theirs["algorithm"][key]
            items = first.items() if isinstance(first, dict) else enumerate(first)
            assert len(first) > 0
            for k, x in items:
                assert torch.equal(x, second[k])


def test_powergossip_merged_into_one_wire_tensor_gives_the_same_models_bit_for_bit():
    """PowerGossip's groups only change how its payload is packed: ring4 with every parameter
    in one wire tensor from round 2 ends bit-for-bit where per-tensor packing ends, on fewer
    bytes (fewer tensor headers)."""
    from gossipcomp.gossip import PowerGossip

    runs = []
    for merged in (False, True):
        models = _models(4)
        peers = build_network(RING4, models, lambda: PowerGossip(rank=2, consensus_step=1.0))
        try:
            if merged:
                for peer in peers:
                    peer.apply(_single(_names(models[0]), 1, 2, compressor="identity"))
            for _ in range(6):
                gossip_round(peers)
            assert all(p.stats.failed_exchanges == {} for p in peers)
            runs.append((stacked(peers), sum(p.stats.bytes_sent_total for p in peers)))
        finally:
            for peer in peers:
                peer.close()
    (plain, plain_bytes), (merged_models, merged_bytes) = runs
    for a, b in zip(plain, merged_models, strict=True):
        assert torch.equal(a, b)
    assert merged_bytes < plain_bytes
