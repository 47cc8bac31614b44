"""Live membership with real processes: `gossipcomp coordinator` and two `gossipcomp peer`
processes on a live ring of capacity 3; a third rank starts once they run, is admitted, and all
three finish their rounds on one model (the README's live join)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from helpers import benchmark, peer_command

ROUNDS = 600  # about 8 s a member on a quiet machine, the joiner in after 5


def test_a_third_peer_process_joins_a_running_live_network(tmp_path):
    faults = benchmark("faults")  # its free loopback ports serve the tests too
    coordinator_port, *ports = faults.free_ports(4)
    peers = "\n".join(f"  {r}: 127.0.0.1:{port}" for r, port in enumerate(ports))
    topology = tmp_path / "live.yaml"
    topology.write_text(f"kind: ring\nn: 3\nmembers: [0, 1]\npeers:\n{peers}\n")
    address = f"127.0.0.1:{coordinator_port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "500"}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "gossipcomp", "coordinator", "--topology", str(topology)]
        + ["--address", address, "--report-every", "2", "--member-timeout", "60"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    # the members must still be running when the joiner is let in: 200 rounds took them 4.6 s
    # on a quiet machine, done before the joiner (started 3 s in) was admitted, and a joiner
    # admitted into a finished network waits for partners that are gone
    flags = ["--algorithm", "dpsgd", "--rounds", str(ROUNDS), "--eval-every", "0"]
    flags += ["--coordinator", address, "--report-every", "2"]

    def peer(rank: int) -> subprocess.Popen[str]:
        report = tmp_path / f"peer{rank}.json"
        return subprocess.Popen(
            [*peer_command(topology, report, "--rank", str(rank)), *flags],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )

    processes = [peer(0), peer(1)]
    try:
        time.sleep(3)  # the two members start (a joiner is never an initial member anyway)
        assert all(p.poll() is None for p in processes), "a member stopped before the join"
        processes.append(peer(2))
        for process in processes:
            _, stderr = process.communicate(timeout=400)
            assert process.returncode == 0, stderr[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        coordinator.terminate()
        _, coordinator_log = coordinator.communicate(timeout=30)
    assert "admitted: [2]" in " ".join(coordinator_log.split())
    reports = [json.loads((tmp_path / f"peer{r}.json").read_text()) for r in range(3)]
    assert all(r["gossip_rounds"] == ROUNDS for r in reports)
    joiner = reports[2]
    assert joiner["bytes_sent_total"] > 0 and joiner["final_test_accuracy"] > 0.8
    # member 0 holds the joiner's admission (taken late where it passed the admission's round
    # before the schedule came, as in tests/test_torchrun_membership.py)
    joined = {s["epoch"] for s in joiner["schedule_epochs"]} - {0}
    held = {s["epoch"] for s in reports[0]["schedule_epochs"]}
    assert joined and min(joined) in held, (joined, held)
    norms = [r["average_model_norm"] for r in reports]
    assert max(norms) - min(norms) < 1e-3 * max(norms)  # one network average
