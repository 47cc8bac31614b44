"""The command line as a user runs it: real `gossipcomp peer` processes, topology show, errors."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import benchmark, peer_command

from gossipcomp.cli import main

ROOT = Path(__file__).resolve().parent.parent


FAULTS = benchmark("faults")  # its ring of free loopback ports serves the tests too


@pytest.mark.parametrize(
    "algorithm",
    [(), ("--algorithm", "choco", "--compressor", "sign")],
    ids=["default-powergossip", "choco-sign"],
)
def test_four_peer_processes_on_a_ring_finish_and_agree_on_the_consensus(tmp_path, algorithm):
    topology = FAULTS.ring_file(tmp_path, 4)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = []
    for rank in (3, 1, 2, 0):  # any start order: peers wait for their neighbours
        report = tmp_path / f"peer{rank}.json"
        if rank == 2:  # rank from the environment, as torchrun sets it
            command = peer_command(topology, report, "--rounds", "150", *algorithm)
            processes.append(
                subprocess.Popen(command, env={**env, "RANK": "2"}, stderr=subprocess.PIPE)
            )
        else:
            command = peer_command(
                topology, report, "--rank", str(rank), "--rounds", "150", *algorithm
            )
            processes.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE))
        time.sleep(0.3)
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()
    reports = [json.loads((tmp_path / f"peer{r}.json").read_text()) for r in range(4)]
    for r, report in enumerate(reports):
        assert report["mode"] == "peer" and report["rounds"] == 150
        assert [p["rank"] for p in report["per_peer"]] == [r]
        assert report["final_test_accuracy"] >= 0.85
        assert report["bytes_sent_total"] > 0
    # every peer's gossip estimate of the network-average model is the same model
    norms = [r["average_model_norm"] for r in reports]
    assert max(norms) - min(norms) <= 1e-4 * max(norms)
    assert len({r["average_model_test_accuracy"] for r in reports}) == 1
    mean_distance = sum(r["consensus_distance"] for r in reports) / 4
    assert mean_distance < 0.01 * norms[0] ** 2  # peers agree to 1% of the model's squared norm


def test_peer_without_neighbours_gives_up_with_a_clear_error(tmp_path):
    topology = FAULTS.ring_file(tmp_path, 3)
    result = subprocess.run(
        [*peer_command(topology, tmp_path / "r.json"), "--rank", "0", "--startup-timeout", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "not reachable within 1.5 s" in result.stderr and "peer 1 at 127.0.0.1:" in result.stderr
    assert not (tmp_path / "r.json").exists()


def test_topology_show_prints_spectral_facts(capsys):
    assert main(["topology", "show", str(ROOT / "topologies" / "ring8.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ring8" in out and "0.1953" in out and "1.308" in out


def test_shipped_topology_resolves_by_name(capsys):
    assert main(["topology", "show", "torus16"]) == 0
    assert "torus16" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "--topology", "nowhere.yaml"], "not a shipped topology"),
        (["simulate", "--partition", "sideways"], "sideways"),
        (["simulate", "--rounds", "0"], "rounds must be >= 1"),
        (["peer", "--topology", "ring4"], "no --rank given and no RANK"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_topology_file_names_file_and_problem(tmp_path, capsys):
    bad = tmp_path / "broken.yaml"
    bad.write_text("kind: ring\nn: 4\nedges: [[0, 0]]\nweights: metropolis\n")
    assert main(["topology", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "broken.yaml" in err
