"""Local SGD: H local optimizer steps between gossip rounds, in simulate and the Peer API."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import in_memory_trainers, run_in_threads

from gossipcomp.cli import main
from gossipcomp.experiment import TrainConfig
from gossipcomp.gossip import DPSGD
from gossipcomp.peer import Peer
from gossipcomp.topology import build_topology, load_topology
from gossipcomp.transport.base import Envelope, Identity
from gossipcomp.transport.codec import encode_raw
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.wire import envelope_wire_bytes
from gossipcomp.workload.models import build_mlp, model_signature


def _simulate(tmp_path, name: str, *argv: str) -> dict:
    path = tmp_path / f"{name}.json"
    common = ["simulate", "--quiet", "--topology", "ring4", "--algorithm", "dpsgd"]
    assert main([*common, *argv, "--report", str(path)]) == 0
    return json.loads(path.read_text())


def _dpsgd_bytes_on_ring4(rounds: int) -> int:
    payload = tuple(encode_raw(n, p) for n, p in build_mlp(0).named_parameters())
    return sum(
        2 * envelope_wire_bytes(Envelope(sender, r, "model", payload))
        for sender in range(4)
        for r in range(rounds)
    )


def test_four_local_steps_send_a_quarter_of_the_bytes_over_the_same_steps(tmp_path):
    one = _simulate(tmp_path, "h1", "--rounds", "40", "--eval-every", "20")
    four = _simulate(tmp_path, "h4", "--rounds", "40", "--eval-every", "20", "--local-steps", "4")
    assert one["rounds"] == four["rounds"] == 40  # local steps, the same
    assert (one["gossip_rounds"], four["gossip_rounds"]) == (40, 10)
    assert (one["local_steps"], four["local_steps"]) == (1, 4)
    assert all(p["gossip_rounds"] == 10 for p in four["per_peer"])
    # exact gossip sends the whole model every round: a quarter of the rounds, of the bytes
    # (exactly: every envelope rebuilt; they differ only in the varint of the round number)
    assert one["bytes_sent_total"] == _dpsgd_bytes_on_ring4(40)
    assert four["bytes_sent_total"] == _dpsgd_bytes_on_ring4(10)
    assert one["bytes_sent_total"] / four["bytes_sent_total"] == pytest.approx(4, rel=1e-6)
    assert [(h["round"], h["gossip_round"]) for h in four["history"]] == [(20, 5), (40, 10)]
    assert [(h["round"], h["gossip_round"]) for h in one["history"]] == [(20, 20), (40, 40)]
    assert four["final_test_accuracy"] >= 0.5  # 40 steps of training still learn something


def test_steps_that_do_not_fill_the_last_round_still_gossip_after_it(tmp_path):
    report = _simulate(tmp_path, "h4", "--rounds", "10", "--local-steps", "4", "--eval-every", "0")
    assert report["rounds"] == 10 and report["gossip_rounds"] == 3  # 4 + 4 + 2 steps
    assert [(h["round"], h["gossip_round"]) for h in report["history"]] == [(10, 3)]


def test_config_counts_gossip_rounds_from_local_steps():
    config = TrainConfig(rounds=10, local_steps=4)
    assert config.gossip_rounds == 3
    assert [config.steps_at(r) for r in range(4)] == [0, 4, 8, 10]
    assert TrainConfig(rounds=600).gossip_rounds == 600  # one local step: a round each


def test_peer_gossips_after_every_h_local_steps(one_thread):
    topology = build_topology("ring", n=4)
    hub = InMemoryHub()
    peers = []
    for rank in range(4):
        model = build_mlp(0, hidden=(8,))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)  # peers disagree until they gossip
        transport = InMemoryTransport(
            Identity(rank, topology.hash, model_signature(model)), topology.neighbors(rank), hub
        )
        peers.append(Peer(model, topology, rank, DPSGD(), transport, local_steps=3))
    for peer in peers:
        peer.start(5, {})
    try:
        gossiped = []
        for _ in range(6):
            gossiped.append(run_in_threads([p.after_local_step for p in peers]))
        assert [g[0] for g in gossiped] == [False, False, True, False, False, True]
        assert all(p.stats.rounds == 2 and p.stats.local_steps == 6 for p in peers)
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "1000001", "many"])
def test_bad_local_steps_exit_2_naming_the_flag(value, capsys):
    assert main(["simulate", "--quiet", "--rounds", "1", "--local-steps", value]) == 2
    assert "local steps must be" in capsys.readouterr().err


@pytest.mark.parametrize("value", [0, -3, True, 2.0])
def test_bad_local_steps_in_python_raise(value):
    with pytest.raises(ValueError, match="local_steps"):
        TrainConfig(local_steps=value)
    topology = build_topology("ring", n=4)
    model = build_mlp(0, hidden=(8,))
    transport = InMemoryTransport(
        Identity(0, topology.hash, model_signature(model)), [1, 3], InMemoryHub()
    )
    with pytest.raises(ValueError, match="local_steps"):
        Peer(model, topology, 0, DPSGD(), transport, local_steps=value)
    transport.close()


def _train(trainers) -> None:
    for t in trainers:
        t.peer.start(5, {})
    run_in_threads([t.run for t in trainers])


def test_a_restored_network_with_local_steps_continues_bit_for_bit(tmp_path, one_thread):
    """40 local steps, H = 4, straight; or 20 steps, checkpoint (at gossip round 5), rebuild
    from the files and 20 more: the same models, bytes and history in local steps."""
    topology = load_topology("topologies/ring4.yaml")
    config = TrainConfig(algorithm="dpsgd", rounds=40, eval_every=20, local_steps=4)
    straight = in_memory_trainers(topology, config, InMemoryHub())
    _train(straight)
    half = dataclasses.replace(config, rounds=20)
    _train(in_memory_trainers(topology, half, InMemoryHub(), tmp_path, 5))
    resumed = in_memory_trainers(topology, config, InMemoryHub(), tmp_path, 5)
    for t in resumed:
        assert t.restore() == 5  # gossip rounds
        assert [(e.round, e.gossip_round) for e in t.history] == [(20, 5)]
    _train(resumed)
    for a, b in zip(straight, resumed, strict=True):
        assert a.peer.round == b.peer.round == 10
        for x, y in zip(a.peer.model.parameters(), b.peer.model.parameters(), strict=True):
            assert torch.equal(x, y)
        assert a.peer.stats.bytes_sent == b.peer.stats.bytes_sent
        assert [(e.round, e.gossip_round) for e in b.history] == [(20, 5), (40, 10)]
        assert [e.test_accuracy for e in a.history] == [e.test_accuracy for e in b.history]
        assert 0 < b.history[0].seconds <= b.history[1].seconds  # time goes on from the file
