"""The coordinator over real gRPC: plans from reports, publishes, peers switch together; it dies
and comes back; hostile reports are refused naming the field."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch
from conftest import build_network, reporting_rounds, run_in_threads
from torch import nn

from gossipcomp.compress import parse_spec
from gossipcomp.coordinator import Coordinator, CoordinatorServer
from gossipcomp.coordinator.client import CoordinatorClient
from gossipcomp.coordinator.pace import MAX_PACE, SCHEDULE_LEAD_S, RoundPace
from gossipcomp.coordinator.planning import CALM_MARGINS
from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.gossip import Choco
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import coordinator_pb2_grpc as cpb_grpc
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION
from gossipcomp.workload.models import model_signature

RING4 = build_topology("ring", n=4)


def _models(n: int) -> list[nn.Module]:
    models = []
    for rank in range(n):
        torch.manual_seed(rank)
        models.append(nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3)))
    return models


@contextmanager
def _coordinated_ring(planner: str, replan_every: int = 200) -> Iterator[tuple]:
    """ring4 Choco-sign peers over gRPC reporting every 2 rounds to a served coordinator:
    (peers, clients, coordinator, address); everything closed on exit (the test may have
    stopped the server already)."""
    models = _models(4)
    peers = build_network(
        RING4, models, lambda: Choco(parse_spec("sign"), consensus_step=0.4), "grpc"
    )
    coordinator = Coordinator(RING4, planner=planner, report_every=2, replan_every=replan_every)
    servers = [CoordinatorServer(coordinator, "127.0.0.1:0")]
    clients = [CoordinatorClient(servers[0].address, p, "sign", report_every=2) for p in peers]
    try:
        yield peers, clients, coordinator, servers
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()
        for peer in peers:
            peer.close()


def test_published_schedules_reach_every_peer_and_switch_at_one_round():
    """Four peers report every 2 rounds to a coordinator over gRPC; it plans once (merging all
    tensors), then the test publishes two more schedules mid-run: every peer holds all three,
    switched at the same rounds, and no exchange of the run failed or mismatched epochs."""
    with _coordinated_ring("single", replan_every=10**6) as (peers, clients, coordinator, _):
        reporting_rounds(peers, clients, 12)
        names = [name for name, _ in peers[0].model.named_parameters()]
        coordinator.publish(
            [TensorGroup(tuple(names[:2]), "sign"), TensorGroup(tuple(names[2:]), "fp16")], "hand"
        )
        reporting_rounds(peers, clients, 12)
        last = coordinator.publish([], "per-tensor")
        # until it is in force: its lead time is more rounds the faster rounds go (pace.py)
        reporting_rounds(peers, clients, last.effective_round - min(p.round for p in peers) + 2)
        published = [(s.epoch, s.effective_round) for s in coordinator.published]
        assert [e for e, _ in published] == [1, 2, 3]
        for peer, client in zip(peers, clients, strict=True):
            stats = peer.stats
            assert [(s.epoch, s.effective_round) for s in stats.schedule_epochs] == [
                (0, 0),
                *published,
            ]
            assert stats.mismatched_epoch_exchanges == 0
            assert stats.failed_exchanges == {}
            assert client.refused == []


def test_peers_train_on_when_the_coordinator_dies_and_a_new_one_continues_the_epochs():
    with _coordinated_ring("single") as (peers, clients, _, servers):
        reporting_rounds(peers, clients, 14)
        assert all(p.schedules.current.epoch == 1 for p in peers)
        address = servers[0].address
        servers.pop().stop()
        reporting_rounds(peers, clients, 8)  # nobody answers: training goes on
        assert all(p.stats.failed_exchanges == {} for p in peers)
        second = Coordinator(RING4, planner="per-tensor", report_every=2)
        servers.append(CoordinatorServer(second, address))
        for _ in range(60):  # the clients reconnect within seconds
            reporting_rounds(peers, clients, 4)
            if all(p.schedules.current.epoch == 2 for p in peers):
                break
        assert [s.epoch for s in second.published] == [2]  # above what the peers held
        assert all(p.schedules.current.epoch == 2 for p in peers)
        assert all(p.stats.mismatched_epoch_exchanges == 0 for p in peers)


def test_reports_go_out_on_the_process_loop_and_start_no_thread(monkeypatch):
    """Peers reporting every round for 12 rounds start no thread for their reports: each is a
    call on the process's one event loop, where their pushes run. Sent as sync gRPC futures,
    every report started a thread to poll its completion and waited for it to run: 12 a peer
    here, several milliseconds of each round on a busy machine (docs/benchmarks.md, issue
    24); sent from a thread kept per peer, each peer added a thread to the process."""
    peers = build_network(
        RING4, _models(4), lambda: Choco(parse_spec("sign"), consensus_step=0.4), "grpc"
    )
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    clients = [CoordinatorClient(server.address, p, "sign", report_every=1) for p in peers]
    started: list[tuple[str, str]] = []  # (the thread that started it, the thread started)
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append((threading.current_thread().name, thread.name))
        start(thread)

    def one(peer, client) -> None:
        threading.current_thread().name = f"trainer-{peer.rank}"
        for _ in range(12):
            peer.gossip()
            client.after_round()

    try:
        monkeypatch.setattr(threading.Thread, "start", counted)
        run_in_threads([lambda p=p, c=c: one(p, c) for p, c in zip(peers, clients, strict=True)])
        monkeypatch.undo()
        assert all(p.schedules.current.epoch == 1 for p in peers)  # the reports were answered
        # besides the four trainers the test starts, only the coordinator server's own
        # bounded pool of workers (it serves the reports): none per report, none per peer
        others = [pair for pair in started if pair[0] != "MainThread"]
        assert all(name.startswith("coordinator") for _, name in others), started
        assert not any(starter.startswith("trainer") for starter, _ in started), started
    finally:
        for client in clients:
            client.close()
        server.stop()
        for peer in peers:
            peer.close()


def _report(**fields) -> cpb.PeerReport:
    base = dict(
        protocol_version=PROTOCOL_VERSION,
        sender=1,
        topology_hash=RING4.hash,
        model_signature=model_signature(_models(1)[0]),
        round=3,
        compute_seconds=0.01,
        compressor="sign",
        tensors=[cpb.TensorSize(name="w", numel=10)],
    )
    return cpb.PeerReport(**{**base, **fields})


@pytest.mark.parametrize(
    "fields,code,fragment",
    [
        ({"sender": 9}, grpc.StatusCode.PERMISSION_DENIED, "not in the topology"),
        ({"topology_hash": "x" * 5000}, grpc.StatusCode.FAILED_PRECONDITION, "topology_hash"),
        ({"protocol_version": 7}, grpc.StatusCode.FAILED_PRECONDITION, "protocol_version"),
        ({"round": -1}, grpc.StatusCode.INVALID_ARGUMENT, "round"),
        ({"round": 2**62}, grpc.StatusCode.INVALID_ARGUMENT, "round"),
        ({"schedule_epoch": 2**40}, grpc.StatusCode.INVALID_ARGUMENT, "schedule_epoch"),
        ({"refused_epoch": -1}, grpc.StatusCode.INVALID_ARGUMENT, "refused_epoch"),
        ({"refused_epoch": 2**40}, grpc.StatusCode.INVALID_ARGUMENT, "refused_epoch"),
        ({"late_epoch": -1}, grpc.StatusCode.INVALID_ARGUMENT, "late_epoch"),
        ({"late_epoch": 2**40}, grpc.StatusCode.INVALID_ARGUMENT, "late_epoch"),
        ({"compute_seconds": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "compute_seconds"),
        ({"compressor_element_seconds": 1e300}, grpc.StatusCode.INVALID_ARGUMENT, "element"),
        (
            {"compressor_fixed_seconds": float("inf")},
            grpc.StatusCode.INVALID_ARGUMENT,
            "compressor_fixed_seconds: expected a finite number in [0, 86400], got inf",
        ),
        (
            {"level_costs": [cpb.LevelCost(level=-1, bytes_per_round=8)]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "level_costs level: expected an integer in [0, ",
        ),
        (
            {"level_costs": [cpb.LevelCost(level=1, bytes_per_round=1 << 41)]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "level_costs bytes_per_round: expected an integer in [0, ",
        ),
        ({"compressor": "zip:level=9"}, grpc.StatusCode.INVALID_ARGUMENT, "compressor"),
        ({"tensors": [cpb.TensorSize(name="", numel=1)]}, grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (
            {"tensors": [cpb.TensorSize(name="w", numel=-5)]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "numel",
        ),
        (
            {"links": [cpb.LinkSamples(neighbour=3, bytes=[1], seconds=[0.1])]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a neighbour",
        ),
        (
            {"links": [cpb.LinkSamples(neighbour=0, bytes=[1] * 65, seconds=[0.1] * 65)]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "at most 64",
        ),
        (
            {"links": [cpb.LinkSamples(neighbour=0, bytes=[1], seconds=[-1.0])]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "seconds",
        ),
    ],
)
def test_hostile_reports_are_refused_naming_the_field_and_change_nothing(fields, code, fragment):
    coordinator = Coordinator(RING4, report_every=2)
    server = CoordinatorServer(coordinator, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as channel:
            report = cpb_grpc.CoordinatorStub(channel).Report
            with pytest.raises(grpc.RpcError) as caught:
                report(_report(**fields), timeout=5)
            assert caught.value.code() == code
            assert fragment in caught.value.details()
            assert len(caught.value.details()) < 400  # echoes are shortened
            assert coordinator._members == {}
            report(_report(), timeout=5)  # and it still serves honest peers
            assert set(coordinator._members) == {1}
    finally:
        server.stop()


@pytest.mark.parametrize(
    "bounds, fragment",
    [
        ({"report_every": 0}, "report_every: expected an integer in [1, 1000000], got 0"),
        ({"report_every": True}, "report_every: expected an integer in [1, 1000000], got True"),
        ({"replan_every": 2.5}, "replan_every: expected an integer in [1, 1000000], got 2.5"),
        ({"round_budget": 0.0}, "round_budget: expected a finite number in (0, "),
        ({"round_budget": float("nan")}, "round_budget: expected a finite number in (0, "),
    ],
)
def test_a_coordinator_refuses_out_of_range_bounds_naming_them(bounds, fragment):
    with pytest.raises(ValueError) as refused:
        Coordinator(RING4, **bounds)
    assert str(refused.value).startswith(fragment)


@pytest.mark.parametrize("report_every", [0, True, 1.5, 10**6 + 1])
def test_a_client_refuses_a_report_interval_out_of_range(report_every):
    models = _models(2)
    peers = build_network(build_topology("ring", n=2), models, lambda: Choco(parse_spec("sign")))
    try:
        with pytest.raises(ValueError, match=r"^report_every: expected an integer in \[1, "):
            CoordinatorClient("127.0.0.1:1", peers[0], "sign", report_every=report_every)
    finally:
        for peer in peers:
            peer.close()


def test_a_report_from_another_model_is_refused_once_a_majority_knows_the_model():
    coordinator = Coordinator(RING4)
    coordinator.receive(_report(sender=2, model_signature="another"))  # one word decides nothing
    for sender in (0, 1, 3):
        coordinator.receive(_report(sender=sender))
    with pytest.raises(ValueError, match="model_signature: 'another' is not the model"):
        coordinator.receive(_report(sender=2, model_signature="another"))


def test_simulate_with_a_coordinator_plans_merged_groups_and_reaches_accuracy():
    """ring4 Choco sign on digits with an in-process coordinator (over TLS): the coordinator's
    plan merges groups, every peer switches at the same round with no mismatched exchange, and
    training reaches the accuracy of a run without it."""
    config = TrainConfig(algorithm="choco", compressor="sign", rounds=120, eval_every=0)
    coordinator = Coordinator(RING4, planner="mergecomp", report_every=5)
    report = run_simulation(config, RING4, coordinator=coordinator, report_every=5, tls=True)
    assert [s["epoch"] for s in report.schedule_epochs] == [0, 1]
    assert report.schedule_epochs[1]["planner"] == "mergecomp"
    assert len(coordinator.published[0].groups) < 6  # merged: the MLP has 6 tensors
    assert report.mismatched_epoch_exchanges == 0
    assert report.final_test_accuracy > 0.85


def test_peer_processes_join_a_coordinator_process_and_switch_together(tmp_path):
    """`gossipcomp coordinator` and four `gossipcomp peer --coordinator` processes on a 4-ring:
    every peer reports the same schedules (the coordinator's merged plan from the same round)
    and no exchange under two epochs."""
    import json
    import os
    import subprocess
    import sys

    from helpers import benchmark, peer_command

    faults = benchmark("faults")  # its ring of free loopback ports serves the tests too
    topology = faults.ring_file(tmp_path, 4)
    address = f"127.0.0.1:{faults.free_ports(1)[0]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "500"}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "gossipcomp", "coordinator", "--topology", str(topology)]
        + ["--address", address, "--report-every", "5", "--planner", "single"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    flags = ["--algorithm", "choco", "--compressor", "sign", "--rounds", "150"]
    flags += ["--eval-every", "0", "--coordinator", address, "--report-every", "5"]
    peers = [
        subprocess.Popen(
            [*peer_command(topology, tmp_path / f"peer{r}.json", "--rank", str(r)), *flags],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    try:
        for process in peers:
            _, stderr = process.communicate(timeout=240)
            assert process.returncode == 0, stderr
    finally:
        coordinator.terminate()
        coordinator.communicate(timeout=30)
    reports = [json.loads((tmp_path / f"peer{r}.json").read_text()) for r in range(4)]
    epochs = [r["schedule_epochs"] for r in reports]
    assert all(e == epochs[0] for e in epochs), epochs
    assert [s["epoch"] for s in epochs[0]] == [0, 1]
    assert epochs[0][1]["planner"] == "single"
    assert all(r["mismatched_epoch_exchanges"] == 0 for r in reports)
    assert all(r["final_test_accuracy"] > 0.8 for r in reports)


def test_a_schedule_the_peers_cannot_use_is_refused_by_each_and_they_keep_theirs():
    with _coordinated_ring("single", replan_every=10**6) as (peers, clients, coordinator, _):
        reporting_rounds(peers, clients, 12)
        coordinator.publish([TensorGroup(("ghost.weight",), "sign")], "hostile")
        reporting_rounds(peers, clients, 8)
        assert coordinator.published[-1].epoch == 2  # not taken for missed: not published again
        for peer, client in zip(peers, clients, strict=True):
            assert peer.schedules.newest.epoch == 1  # the coordinator's first, good plan
            assert len(client.refused) == 1 and "unknown" in client.refused[0]  # said once
            assert peer.stats.failed_exchanges == {}


def test_a_schedule_a_peer_refused_as_unusable_is_not_taken_for_missed() -> None:
    """A peer past a schedule's round that refused it as unusable (its report's refused_epoch)
    did not miss it: the coordinator does not raise its margin (CI, stop 39: every peer refused
    a ghost-tensor plan twice). A peer that merely lacks it at that round missed it: the
    margin doubles, and nothing is published again (the peer takes it late, client.py)."""
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    clock = [0.0]
    coordinator._rounds._clock = lambda: clock[0]  # noqa: SLF001 (time allows any claim)

    def report(rank: int, round: int, epoch: int, refused: int) -> None:
        clock[0] += 1000.0
        coordinator.receive(
            _report(sender=rank, round=round, schedule_epoch=epoch, refused_epoch=refused)
        )

    for rank in range(4):
        report(rank, 5, 0, 0)
    ghost = coordinator.publish([TensorGroup(("ghost.weight",), "sign")], "hostile")
    margin, past = coordinator.margin, ghost.effective_round + 1
    for rank in range(4):
        report(rank, past, ghost.epoch - 1, ghost.epoch)
    assert coordinator.published[-1] == ghost and coordinator.margin == margin
    report(2, past + 1, ghost.epoch - 1, 0)
    assert coordinator.published[-1] == ghost  # missed, and not published again
    assert coordinator.margin == 2 * margin
    report(3, past + 2, ghost.epoch - 1, 0)  # one epoch's misses raise the margin once
    assert coordinator.margin == 2 * margin


def test_a_late_epoch_raises_the_margin_once_and_only_for_an_epoch_published() -> None:
    """A member that took a schedule late says so in its report's late_epoch (it holds it
    already, so its epoch and round show no miss): the margin doubles, once per epoch. An
    epoch this coordinator never published (a liar's, or one from before a restart) and a
    peer awaiting admission move nothing."""
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    clock = [0.0]
    coordinator._rounds._clock = lambda: clock[0]  # noqa: SLF001 (time allows any claim)

    def report(rank: int, round: int, late: int, **fields: object) -> None:
        clock[0] += 1000.0
        held = coordinator.published[-1].epoch if coordinator.published else 0
        coordinator.receive(
            _report(sender=rank, round=round, schedule_epoch=held, late_epoch=late, **fields)
        )

    for rank in range(4):
        report(rank, 5, 0)
    first = coordinator.published[-1]
    margin = coordinator.margin
    report(0, first.effective_round + 1, 7)  # never published
    report(1, first.effective_round + 1, first.epoch, joining=True)
    assert coordinator.margin == margin
    report(2, first.effective_round + 1, first.epoch)
    assert coordinator.margin == 2 * margin and coordinator.published[-1] == first
    report(3, first.effective_round + 2, first.epoch)  # the same epoch, again
    assert coordinator.margin == 2 * margin
    second = coordinator.publish([TensorGroup(("w",), "sign")], "single")
    report(3, second.effective_round, second.epoch)
    assert coordinator.margin == 4 * margin


def test_a_margin_raised_by_a_missed_schedule_halves_back_after_calm_rounds() -> None:
    """A peer that passes a schedule's round without it doubles the margin for the schedules
    that follow; once CALM_MARGINS x margin rounds pass with none missed, the margin halves,
    and never below its base; a miss after a halving doubles the calm. Before, one late reply
    slowed every later change."""
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    clock = [0.0]
    coordinator._rounds._clock = lambda: clock[0]  # noqa: SLF001 (time allows any claim)

    def report(rank: int, round: int, epoch: int | None = None) -> None:
        clock[0] += 1000.0
        held = coordinator.published[-1].epoch if epoch is None else epoch
        coordinator.receive(_report(sender=rank, round=round, schedule_epoch=held))

    for rank in range(4):
        report(rank, 5, 0)
    first = coordinator.published[-1]
    base = coordinator.base_margin
    assert (first.epoch, coordinator.margin, base) == (1, 3, 3)
    report(1, first.effective_round + 1, 0)  # peer 1 passed it without it
    assert coordinator.margin == 2 * base
    assert coordinator.published[-1] == first  # peer 1 takes it late: nothing comes again
    raised_at = coordinator._lead  # noqa: SLF001
    round = first.effective_round + 1
    while coordinator.margin > base:
        round += 5
        for rank in range(4):
            report(rank, round)
        assert round <= raised_at + CALM_MARGINS * 2 * base + 5  # not later than due
    assert coordinator._lead - raised_at >= CALM_MARGINS * 2 * base  # noqa: SLF001 (nor sooner)
    for _ in range(3 * CALM_MARGINS):  # and never below the base
        round += 5
        for rank in range(4):
            report(rank, round)
    assert coordinator.margin == base
    # a miss after that halving: the halved margin was too short, so the calm doubles
    second = coordinator.publish([TensorGroup(("w",), "sign")], "single")
    round = second.effective_round
    report(2, round, second.epoch - 1)
    assert coordinator.margin == 2 * base
    raised_at = coordinator._lead  # noqa: SLF001
    while coordinator.margin > base:
        round += 5
        for rank in range(4):
            report(rank, round)
        assert round <= raised_at + 2 * CALM_MARGINS * 2 * base + 5
    assert coordinator._lead - raised_at >= 2 * CALM_MARGINS * 2 * base  # noqa: SLF001


def test_a_schedule_is_given_the_members_rounds_of_its_lead_time_where_rounds_are_fast():
    """Members at 250 rounds a second: a schedule takes effect at least the rounds that
    SCHEDULE_LEAD_S take at that pace past the furthest round, not the 3 rounds of the base
    margin (12 ms of rounds, which a busy coordinator's reply outran: members missed the
    admission of a joiner). One member claiming a faster pace moves nothing; before any pace
    is measured the wider margin of start-up is all there is."""
    coordinator = Coordinator(RING4, planner="single", report_every=1)
    clock = [0.0]
    coordinator._rounds._clock = lambda: clock[0]  # noqa: SLF001

    def report(rank: int, round: int, epoch: int = 0) -> None:
        coordinator.receive(_report(sender=rank, round=round, schedule_epoch=epoch))

    for rank in range(4):
        report(rank, 10)
    (first,) = coordinator.published
    # no pace measured yet: the margin of start-up, wider than the base
    assert first.effective_round == 10 + coordinator.unpaced_margin > 10 + coordinator.base_margin
    clock[0] = 0.2
    for rank in range(4):  # rank 0 claims 400 rounds a second, the others 250
        report(rank, 60 if rank else 90, first.epoch)
    pace = coordinator._pace.rounds_per_second(range(4), 2)  # noqa: SLF001
    assert pace == pytest.approx(250.0)
    schedule = coordinator.publish([], "single")
    lead = math.ceil(250.0 * SCHEDULE_LEAD_S)
    assert lead > coordinator.margin
    assert list(coordinator.published) == [first, schedule]  # nothing else published
    assert schedule.effective_round == coordinator._lead + lead  # noqa: SLF001


def test_rounds_of_55_ms_keep_the_base_margin_so_adaptive_levels_react_no_later():
    """The lead time adds rounds only where rounds are fast: at 55 ms a round (the shaped
    adaptive benchmark's rounds take 0.13-0.2 s) it is within the base margin of report_every 1
    (3 rounds).
    A sample ends without a pace at a claim that was cut (a liar's, a joiner catching up),
    and no pace counts above what the bound on claimed rounds believes."""
    pace = RoundPace()
    for rank in range(2):
        pace.heard(rank, 100, 0.0)
        pace.heard(rank, 104, 0.06)  # too short a sample: nothing measured yet
    assert pace.rounds_per_second(range(2), 2) is None and pace.lead_rounds(range(2), 2) == 0
    for rank in range(2):
        pace.heard(rank, 110, 0.55)  # 10 rounds in 0.55 s
    assert pace.rounds_per_second(range(2), 2) == pytest.approx(10 / 0.55)
    assert pace.lead_rounds(range(2), 2) <= Coordinator(RING4, report_every=1).base_margin
    assert pace.rounds_per_second(range(2), 3) is None  # fewer measured than the quorum
    pace.heard(0, 10**6, 0.6, cut=True)  # a claim cut to what time allows: no pace from it
    assert pace.rounds_per_second([0], 1) == pytest.approx(10 / 0.55)
    pace.heard(0, 10**6 + 10**5, 0.8)  # 500,000 rounds a second: no more than claims allow
    assert pace.rounds_per_second([0], 1) == MAX_PACE
    assert pace.lead_rounds([0], 1) == math.ceil(MAX_PACE * SCHEDULE_LEAD_S)
