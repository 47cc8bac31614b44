"""`gossipcomp simulate`: the main job trains digits to the accuracy each algorithm is known to reach."""

from __future__ import annotations

import json

import pytest

from gossipcomp.cli import main
from gossipcomp.models import build_mlp
from gossipcomp.transport.base import Envelope
from gossipcomp.transport.codec import encode_raw
from gossipcomp.transport.wire import envelope_wire_bytes

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
