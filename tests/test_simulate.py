"""`gossipcomp simulate`: the main job trains digits to the accuracy each algorithm is known to reach."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import benchmark, peer_command

from gossipcomp.cli import main
from gossipcomp.transport.base import Envelope
from gossipcomp.transport.codec import encode_raw
from gossipcomp.transport.wire import envelope_wire_bytes
from gossipcomp.workload.models import build_mlp

REQUIRED = {
    "algorithm",
    "topology",
    "rounds",
    "final_test_accuracy",
    "min_test_accuracy",
    "consensus_distance",
    "bytes_sent_total",
    "wall_seconds",
    "per_peer",
}


def _simulate(tmp_path, *argv: str) -> dict:
    path = tmp_path / "report.json"
    assert main(["simulate", "--report", str(path), "--quiet", *argv]) == 0
    return json.loads(path.read_text())


def test_default_demo_reaches_095_on_ring8_iid(tmp_path):
    report = _simulate(tmp_path)
    assert REQUIRED <= set(report)
    assert report["algorithm"] == "powergossip" and report["topology"] == "ring8"
    assert report["rounds"] == 600 and len(report["per_peer"]) == 8
    assert report["final_test_accuracy"] >= 0.95, report["final_test_accuracy"]
    assert report["min_test_accuracy"] >= 0.93
    assert report["average_model_test_accuracy"] >= 0.95
    assert 0 <= report["consensus_distance"] < 0.005 * report["average_model_norm"] ** 2
    assert report["bytes_sent_total"] == sum(p["bytes_sent"] for p in report["per_peer"])
    rounds = [h["round"] for h in report["history"]]
    assert rounds == list(range(50, 601, 50))
    assert report["history"][-1]["mean_test_accuracy"] == report["final_test_accuracy"]


def test_dpsgd_trains_and_reports_exact_serialised_bytes(tmp_path):
    report = _simulate(tmp_path, "--algorithm", "dpsgd", "--rounds", "300")
    assert report["final_test_accuracy"] >= 0.93, report["final_test_accuracy"]
    # every byte counted is a serialised byte: rebuild each envelope that crossed each link
    payload = tuple(encode_raw(n, p) for n, p in build_mlp(0).named_parameters())
    expected = sum(
        2 * envelope_wire_bytes(Envelope(sender, r, "model", payload))
        for sender in range(8)
        for r in range(300)
    )
    assert report["bytes_sent_total"] == expected


@pytest.mark.parametrize(
    "argv",
    [
        ("--algorithm", "choco", "--compressor", "sign"),
        ("--algorithm", "choco", "--compressor", "topk:ratio=0.01"),
        ("--algorithm", "def", "--compressor", "sign"),
        ("--algorithm", "def", "--compressor", "topk:ratio=0.01"),
        ("--algorithm", "powergossip", "--rank", "2", "--partition", "dirichlet:1.0"),
    ],
    ids=lambda argv: " ".join(argv[1::2]),
)
def test_every_algorithm_trains_digits_to_093(tmp_path, argv):
    report = _simulate(tmp_path, *argv, "--rounds", "300")
    assert report["final_test_accuracy"] >= 0.93, report["final_test_accuracy"]
    dense = 300 * 8 * 2 * 85002 * 4  # what exact gossip would have sent
    assert report["bytes_sent_total"] < dense / 10


def test_diverging_run_fails_with_a_clear_error(tmp_path, capsys):
    path = tmp_path / "report.json"
    argv = ["simulate", "--quiet", "--algorithm", "dpsgd", "--lr", "1e6", "--rounds", "50"]
    assert main([*argv, "--report", str(path)]) == 1
    err = capsys.readouterr().err
    assert "NaN/Inf" in err and "diverged" in err
    assert not path.exists()


def test_peers_launched_with_one_command_line_write_their_own_files(tmp_path):
    """As torchrun launches them: the same argv, the rank from RANK, `{rank}` in the paths."""
    topology = benchmark("faults").ring_file(tmp_path, 3)
    argv = [
        *peer_command(topology, tmp_path / "reports" / "peer{rank}.json"),
        "--rounds",
        "20",
        "--checkpoint-dir",
        str(tmp_path / "checkpoints-{rank}"),
        "--checkpoint-every",
        "10",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(argv, env={**env, "RANK": str(r)}, stderr=subprocess.PIPE)
        for r in range(3)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()
    for rank in range(3):
        report = json.loads((tmp_path / "reports" / f"peer{rank}.json").read_text())
        assert [p["rank"] for p in report["per_peer"]] == [rank]
        assert any((tmp_path / f"checkpoints-{rank}").iterdir())
    assert not (tmp_path / "checkpoints-{rank}").exists()


@pytest.mark.parametrize("flag", ["--report", "--checkpoint-dir"])
def test_rank_field_is_refused_by_simulate(tmp_path, capsys, flag):
    path = str(tmp_path / "out{rank}")
    assert main(["simulate", "--quiet", "--rounds", "1", flag, path]) == 2
    err = capsys.readouterr().err
    assert flag in err and "{rank}" in err and "expected a path without" in err
    assert not list(tmp_path.iterdir())  # nothing made
