"""Churn on a live network (issue 27's soak, benchmarks/churn.py, tiny): 16 peers of a live
one-peer exponential network over real gRPC with an in-process coordinator, peers killed and
joining while they train; and a peer outside a live network takes no local steps while it waits
for its admission (it used to train alone on its shard, as fast as the CPU allowed)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import benchmark

from gossipcomp.experiment import TrainConfig, build_algorithm, build_config_model, load_data
from gossipcomp.experiment.outcome import TrainingAborted
from gossipcomp.experiment.trainer import PeerTrainer
from gossipcomp.peer import Peer
from gossipcomp.topology import build_topology


def test_a_peer_waiting_for_admission_takes_no_local_steps():
    """A joiner nobody admits (no coordinator here) does no rounds and, now, no local steps:
    its model is the one it started with after a second of waiting, and it still stops when
    asked. Before, the trainer ran local steps in a loop (the model moved, a core was busy)."""
    config = TrainConfig(algorithm="dpsgd", rounds=50, round_timeout=2.0)
    data = load_data(config)
    topology = build_topology("ring", n=3, members=[0, 1])
    peer = Peer.over_grpc(
        build_config_model(config, data),
        topology,
        2,
        build_algorithm(config, topology, 2),
        bind="127.0.0.1:0",
        round_timeout=config.round_timeout,
        joining=True,
    )
    try:
        trainer = PeerTrainer(peer, data, config)
        peer.start(5.0, {2: peer.address})
        before = [p.detach().clone() for p in peer.model.parameters()]
        until = time.monotonic() + 1.0
        with pytest.raises(TrainingAborted):
            trainer.run(should_stop=lambda: time.monotonic() > until)
        assert not peer.member and peer.round == 0
        for p, q in zip(peer.model.parameters(), before, strict=True):
            assert torch.equal(p.detach(), q)
        assert not trainer.optimizer.state  # no SGD step at all (momentum buffers never made)
    finally:
        peer.close()


def test_churn_benchmark_kills_and_joins_without_stalls(tmp_path):
    """The churn soak, tiny: 16 peers; rank 0 is killed at round 30 and, once the coordinator
    has removed it, a new peer object of rank 0 joins from its checkpoint and is admitted. No
    member waits more than one round timeout (plus the static run's longest round) between two
    rounds, every peer finishes, and the churned run's accuracy is within 5 points of the
    static run's (500 rounds: both still learning; the full run's bound is 1 point). The killed
    peer object is garbage once closed: nothing keeps it, its model or its channels alive.
    (At 100 rounds a quiet machine's 0.2 s rounds ended the run before the removal and the
    admission, 6-13 s of the coordinator's time, had let rank 0 back in; the harness now leaves
    out a kill whose rounds left would not last 3 member timeouts: 470 rounds do down to 0.038 s
    a round; at 200 rounds a fast start left the kill out once, and at 300 (0.067 s) once more
    when each edge's envelopes went on one open stream and rounds took 70 ms.)"""
    churn = benchmark("churn")
    out = tmp_path / "churn.json"
    code = churn.main(
        [
            "--rounds", "500", "--churn-every", "30", "--events", "1", "--warmup", "40",
            "--report-every", "2",
            "--round-timeout", "3", "--member-timeout", "6", "--eval-every", "0",
            "--max-gap", "0.05", "--json", str(out),
            # 40 rounds in, resident memory has not settled (558-710 MB across runs on a loaded
            # machine): the tiny run checks the killed peer's objects directly instead
            "--max-rss-growth", "1.0",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert code == (0 if result["passed"] else 1)
    static, churned = result["static"], result["churned"]
    assert static["errors"] == [] and churned["errors"] == [], result["missed"]
    assert [(e["killed"], e["joined"]) for e in churned["events"]] == [(0, 0)]
    assert churned["coordinator_removals"] >= 1 and churned["coordinator_joins"] >= 1
    assert static["all_finished"] and churned["all_finished"]
    assert churned["peers_at_end"] == static["peers_at_end"] == 16
    # the killed peer object is freed (the harness used to keep every first peer alive)
    assert churned["killed_peers_retained"] == 0
    # memory is told apart: resident as is, heap in use, resident after giving back free heap
    # (glibc keeps up to 64 MiB free per arena for the transport; resident alone mixes it in)
    assert "rss_growth" in churned
    if churned["after_warmup"].get("heap_in_use_kib") is not None:  # glibc 2.33 or later
        assert {"heap_in_use_growth", "rss_trimmed_growth"} <= churned.keys()
        warm = churned["after_warmup"]
        # resident memory is read before and after the trim while 16 peers' threads run on:
        # what they allocate between the two reads can put the trimmed figure a little above
        # (216 KiB of 708 MB in one CI run), never far
        assert 0 < warm["heap_in_use_kib"] and 0 < warm["rss_trimmed_kib"]
        assert warm["rss_trimmed_kib"] <= 1.01 * warm["rss_kib"]
        assert all(e["heap_in_use_kib"] > 0 for e in churned["events"])
    limit = result["round_timeout"] + static["longest_round_seconds"]
    assert churned["longest_round_seconds"] <= limit
    assert result["accuracy_gap_points"] <= 5.0
    assert result["passed"], result["missed"]
