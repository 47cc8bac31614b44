"""`gossipcomp simulate`: the main job trains digits to the accuracy D-PSGD is known to reach."""

from __future__ import annotations

import json

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


def test_simulate_ring8_iid_reaches_095_and_reports_exact_bytes(tmp_path):
    path = tmp_path / "report.json"
    assert main(["simulate", "--report", str(path), "--quiet"]) == 0
    report = json.loads(path.read_text())
    assert REQUIRED <= set(report)
    assert report["algorithm"] == "dpsgd" and report["topology"] == "ring8"
    assert report["rounds"] == 600 and len(report["per_peer"]) == 8
    assert report["final_test_accuracy"] >= 0.95, report["final_test_accuracy"]
    assert report["min_test_accuracy"] >= 0.93
    assert report["average_model_test_accuracy"] >= 0.95
    assert 0 <= report["consensus_distance"] < 0.05
    # every byte counted is a serialised byte: rebuild each envelope that crossed each link
    payload = tuple(encode_raw(n, p) for n, p in build_mlp(0).named_parameters())
    expected = sum(
        2 * envelope_wire_bytes(Envelope(sender, r, "model", payload))
        for sender in range(8)
        for r in range(600)
    )
    assert report["bytes_sent_total"] == expected
    assert report["bytes_sent_total"] == sum(p["bytes_sent"] for p in report["per_peer"])
    rounds = [h["round"] for h in report["history"]]
    assert rounds == list(range(50, 601, 50))
    assert report["history"][-1]["mean_test_accuracy"] == report["final_test_accuracy"]
