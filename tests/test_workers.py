"""simulate --workers: the peers spread over worker processes give exactly the same run.

Training is deterministic given the seed (and one intra-op thread, as the command line and the
workers use), and gossip is synchronous, so a network whose peers
live in two processes (talking gRPC on loopback across them) must end bit for bit where the same
network in one process does: same accuracy, same consensus distance, same bytes on every link.
Errors in a worker reach the caller; settings that cannot be spread are refused up front.
"""

from __future__ import annotations

import pytest

from gossipcomp.coordinator import Coordinator
from gossipcomp.experiment import TrainConfig, TrainingDiverged
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.experiment.simulation.workers import _blocks
from gossipcomp.topology import build_topology
from gossipcomp.transport.throttled import LinkRates

RING4 = build_topology("ring", n=4)


def test_blocks_cover_the_ranks_once_in_contiguous_nearly_equal_parts():
    assert _blocks(8, 2) == [range(0, 4), range(4, 8)]
    assert _blocks(5, 3) == [range(0, 2), range(2, 3), range(3, 5)]
    for n, workers in ((16, 3), (7, 7), (64, 5)):
        blocks = _blocks(n, workers)
        assert [r for block in blocks for r in block] == list(range(n))
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


@pytest.mark.parametrize("algorithm", ["powergossip", "choco"])
def test_peers_in_two_worker_processes_end_exactly_where_one_process_does(algorithm, one_thread):
    config = TrainConfig(algorithm=algorithm, rounds=12, eval_every=6, compressor="sign")
    alone = run_simulation(config, RING4)
    spread = run_simulation(config, RING4, workers=2)
    assert spread.final_test_accuracy == alone.final_test_accuracy
    assert spread.consensus_distance == alone.consensus_distance
    assert spread.average_model_norm == alone.average_model_norm
    assert [p.bytes_sent for p in spread.per_peer] == [p.bytes_sent for p in alone.per_peer]
    assert [p.rank for p in spread.per_peer] == [0, 1, 2, 3]
    assert [h.mean_test_accuracy for h in spread.history] == [
        h.mean_test_accuracy for h in alone.history
    ]


def test_workers_with_a_coordinator_and_throttled_links_adapt_levels():
    config = TrainConfig(algorithm="powergossip", rounds=24, eval_every=0)
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.05)
    report = run_simulation(
        config,
        RING4,
        workers=2,
        coordinator=coordinator,
        report_every=1,
        link_rates=LinkRates(50),
    )
    assert report.mismatched_epoch_exchanges == 0
    assert report.link_levels  # the coordinator in this process set levels in the workers
    assert all(p.failed_exchanges == 0 for p in report.per_peer)


def test_an_error_in_a_worker_reaches_the_caller():
    config = TrainConfig(algorithm="dpsgd", rounds=30, lr=1e6, eval_every=0)
    with pytest.raises(TrainingDiverged):
        run_simulation(config, RING4, workers=2)


@pytest.mark.parametrize(
    ("workers", "authenticate", "message"),
    [
        (5, False, "at most one per peer"),
        (0, False, r"^workers: expected an integer in \[1, \d+\], got 0$"),
        (2.0, False, r"^workers: expected an integer in \[1, \d+\], got 2.0$"),
        (2, True, "authenticate"),
    ],
)
def test_workers_that_cannot_be_used_are_refused(workers, authenticate, message):
    with pytest.raises(ValueError, match=message):
        run_simulation(
            TrainConfig(rounds=2),
            RING4,
            workers=workers,
            tls=authenticate,
            authenticate=authenticate,
        )
