"""Every benchmark script runs end to end in a tiny configuration (the real script, in a
subprocess) and writes the JSON fields docs/benchmarks.md quotes, so none can rot unnoticed.

Each run takes seconds; the figures are meaningless at this size, so the checks are on what
holds at any size: the fields exist, counts and byte sizes are exact, ratios are positive and
consistent with the times they come from, and fault-free runs lose nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *arguments: str, timeout: float) -> str:
    """Run benchmarks/`script` with `arguments`; return its output, failing with it shown."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *arguments],
        cwd=ROOT,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_transport_benchmark_times_a_real_exchange_against_a_socket(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    # 8 MiB: the smallest envelope the bulk lane carries, so the default paths take it
    _run("transport.py", "--mib", "8", "--trials", "2", "--chunk-kib", "1024", "--json", str(out),
         timeout=120)  # fmt: skip
    report = _json(out)
    assert report["envelope_bytes"] == 8 << 20 and report["trials"] == 2
    assert report["default_chunk_bytes"] == 1 << 20 and len(report["load_average_1min"]) == 2
    paths = {
        "socket",
        "grpc_raw_ceiling",
        "grpc_exchange",
        "grpc_send",
        "grpc_1024KiB",
        "grpc_send_1024KiB",
        "grpc_own_reads",
    }
    assert set(report["median_seconds"]) == paths
    # every timed trial times every path once, in an order of its own
    assert len(report["trial_orders"]) == 2
    assert all(sorted(order) == sorted(paths) for order in report["trial_orders"])
    for path in paths:
        seconds = report["median_seconds"][path]
        assert seconds > 0
        assert report["throughput_gb_per_s"][path] == pytest.approx(8 * 2**20 / seconds / 1e9)
    assert report["ratio_to_socket"]["socket"] == 1.0
    # every trial of the defaults went on the lane, every trial of the stream paths did not
    assert report["on_bulk_lane"] == {"grpc_exchange": True, "grpc_send": True}
    assert report["streams_off_lane"] is True
    assert report["grpc_vs_socket_ratio"] == pytest.approx(
        report["ratio_to_socket"]["grpc_exchange"]
    )
    assert report["lane_over_stream"] == pytest.approx(
        report["ratio_to_socket"]["grpc_exchange"] / report["ratio_to_socket"]["grpc_1024KiB"]
    )
    assert report["read_chunk_gain"] == pytest.approx(
        report["ratio_to_socket"]["grpc_1024KiB"] / report["ratio_to_socket"]["grpc_own_reads"]
    )
    assert report["send_vs_socket_ratio"] == pytest.approx(report["ratio_to_socket"]["grpc_send"])
    assert report["grpc_vs_raw_grpc_ratio"] == pytest.approx(
        report["median_seconds"]["grpc_raw_ceiling"] / report["median_seconds"]["grpc_exchange"]
    )
    # each end is charged its process's CPU for every path; the socket's is the unit
    cpu_ms = report["cpu_ms_per_envelope"]
    assert set(cpu_ms) == paths and all(
        set(ends) == {"sender", "receiver"} for ends in cpu_ms.values()
    )
    assert all(ms >= 0 for ends in cpu_ms.values() for ms in ends.values())
    socket_cpu = sum(cpu_ms["socket"].values())
    assert socket_cpu > 0 and report["cpu_over_socket"]["socket"] == pytest.approx(1.0)
    for path in paths:
        assert report["cpu_over_socket"][path] == pytest.approx(
            sum(cpu_ms[path].values()) / socket_cpu
        )
        assert report["cores_busy"][path] == pytest.approx(
            sum(cpu_ms[path].values()) / 1e3 / report["median_seconds"][path]
        )
    machine = report["machine"]  # what moves the figure between machines, recorded with it
    assert set(machine) == {"transparent_hugepage", "libc", "heap_thresholds_set", "cores"}
    assert machine["cores"] == len(os.sched_getaffinity(0))


def test_compressors_benchmark_times_every_spec_against_a_copy(tmp_path: Path) -> None:
    out = tmp_path / "compressors.json"
    specs = ("identity", "topk:ratio=0.01", "sign")
    _run("compressors.py", "--numel", "4096", "--trials", "2", "--threads", "1",
         "--specs", *specs, "--json", str(out), timeout=60)  # fmt: skip
    report = _json(out)
    assert report["numel"] == 4096 and report["torch_threads"] == 1 and report["copy_seconds"] > 0
    assert [r["spec"] for r in report["results"]] == list(specs)
    for row in report["results"]:
        for what in ("roundtrip", "compress", "decompress"):
            assert row[f"{what}_ratio"] > 0 and row[f"{what}_seconds"] > 0
        assert row["compression_factor"] == pytest.approx(4 * 4096 / row["wire_bytes"])
    identity = report["results"][0]
    assert identity["wire_bytes"] == 4 * 4096 and identity["compression_factor"] == 1.0
    assert all(row["compression_factor"] > 1 for row in report["results"][1:])


def test_soak_benchmark_loses_nothing_and_keeps_the_network_sum(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    _run("soak.py", "--rounds", "12", "--warmup", "4", "--json", str(out), timeout=120)
    report = _json(out)
    assert report["peers"] == 16 and report["rounds"] == 12 and report["warmup_rounds"] == 4
    assert report["failed_exchanges"] == 0 and report["all_rounds_done"] is True
    assert report["network_sum_max_error"] < 1e-9
    assert report["ms_per_round"] == pytest.approx(1e3 * report["seconds"] / 12)
    for moment in ("after_warmup", "at_end"):
        assert set(report[moment]) == {"threads", "sockets", "rss_kib"}
    growth = (report["at_end"]["rss_kib"] - report["after_warmup"]["rss_kib"]) / report[
        "after_warmup"
    ]["rss_kib"]
    assert report["rss_growth"] == pytest.approx(growth)
    assert isinstance(report["passed"], bool)


def test_faults_benchmark_kills_a_peer_process_and_the_rest_finish(tmp_path: Path) -> None:
    """Only the kill scenario: each scenario starts four processes that import torch, which is
    most of its time (the fault-free baseline and the restart are left to the full run)."""
    out = tmp_path / "faults.json"
    _run("faults.py", "--rounds", "20", "--kill-after", "5", "--checkpoint-every", "5",
         "--scenarios", "killed", "--json", str(out), timeout=660)  # fmt: skip
    report = _json(out)
    assert report["rounds"] == 20
    (killed,) = report["results"]
    assert killed["scenario"] == "peer 2 killed" and killed["peer2_said"] == "killed"
    assert killed["wall_ratio"] is None and killed["wall_seconds"] > 0  # no baseline run
    assert set(killed["peers"]) == {"0", "1", "3"}  # peer 2 never wrote its report
    for row in killed["peers"].values():
        assert row["rounds"] == 20 and 0 <= row["test_accuracy"] <= 1
        assert row["average_model_norm"] > 0
    # its two neighbours noticed it go (at least one failed exchange each)
    assert killed["peers"]["1"]["failed_exchanges"] >= 1
    assert killed["peers"]["3"]["failed_exchanges"] >= 1


def test_byzantine_benchmark_compares_clipping_with_and_without_a_liar(tmp_path: Path) -> None:
    out = tmp_path / "byzantine.json"
    _run("byzantine.py", "--rounds", "3", "--algorithms", "dpsgd", "--attacks", "sign_flip",
         "--json", str(out), timeout=120)  # fmt: skip
    report = _json(out)
    assert report["rounds"] == 3 and report["liar"] == 3 and report["topology"] == "ring8"
    runs = report["runs"]
    cells = {(r["attack"], r["clip"]) for r in runs}
    assert cells == {(a, c) for a in (None, "sign_flip") for c in (None, "adaptive", "fixed:0.3")}
    for run in runs:
        assert run["algorithm"] == "dpsgd" and run["rounds"] == 3
        if run["diverged"] is None:
            assert 0 <= run["honest_min_accuracy"] <= run["honest_mean_accuracy"] <= 1
            assert len(run["per_peer_accuracy"]) == 8
        assert run["byzantine"] == ([3] if run["attack"] else [])
    reference = next(r for r in runs if r["attack"] is None and r["clip"] is None)
    assert reference["ratio_to_fault_free"] == 1.0
    assert reference["points_below_fault_free"] == 0.0


def test_learning_benchmark_reports_accuracy_bytes_and_renders(tmp_path: Path) -> None:
    out, picture = tmp_path / "learning.json", tmp_path / "learning.png"
    _run("learning.py", "--rounds", "4", "--partitions", "iid", "--only", "PowerGossip r1",
         "--json", str(out), "--plot", str(picture), timeout=120)  # fmt: skip
    report = _json(out)
    assert report["rounds"] == 4 and report["seed"] == 0
    labels = [run["label"] for run in report["runs"]]
    assert labels == ["D-PSGD", "PowerGossip r1"]  # D-PSGD always runs: the reference
    dpsgd, powergossip = report["runs"]
    for run in report["runs"]:
        assert run["partition"] == "iid" and 0 <= run["final_test_accuracy"] <= 1
        assert "bytes_to_0_90" in run and run["history"][-1]["round"] == 4
        assert run["history"][-1]["bytes"] == run["bytes_sent_total"]
    assert 0 < 20 * powergossip["bytes_sent_total"] < dpsgd["bytes_sent_total"]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = _run("learning.py", "--render", str(out), timeout=60)
    assert "| iid | PowerGossip r1 |" in table and "| iid | D-PSGD |" in table


def test_security_benchmark_compares_plaintext_tls_and_signed(tmp_path: Path) -> None:
    out = tmp_path / "security.json"
    _run("security.py", "--sizes-kib", "16", "--trials", "2", "--rounds", "2",
         "--round-trials", "1", "--json", str(out), timeout=120)  # fmt: skip
    report = _json(out)
    rows = {"envelope 16 KiB", "ring8 dpsgd round"}
    assert set(report["seconds"]) == rows and set(report["ratios"]) == rows
    for row in rows:
        seconds, ratios = report["seconds"][row], report["ratios"][row]
        assert set(seconds) == {"plaintext", "tls", "tls+signed"}
        assert all(s > 0 for s in seconds.values())
        assert ratios["tls_vs_plaintext"] == pytest.approx(seconds["tls"] / seconds["plaintext"])
        assert ratios["signed_vs_tls"] == pytest.approx(seconds["tls+signed"] / seconds["tls"])
        assert ratios["signed_vs_plaintext"] == pytest.approx(
            seconds["tls+signed"] / seconds["plaintext"]
        )


def test_engine_benchmark_sets_simulate_against_the_work_done_back_to_back(
    tmp_path: Path,
) -> None:
    out = tmp_path / "engine.json"
    _run("engine.py", "--peers", "4", "6", "--rounds", "5", "--warmup", "1", "--repeats", "2",
         "--json", str(out), timeout=120)  # fmt: skip
    report = _json(out)
    assert report["rounds"] == 5 and report["warmup_rounds"] == 1 and report["timed_rounds"] == 3
    cores = len(os.sched_getaffinity(0))
    assert report["cores"] == cores
    assert [row["peers"] for row in report["sizes"]] == [4, 6] and report["repeats"] == 2
    for row in report["sizes"]:
        for field in (
            "simulate_round_s",
            "simulate_cpu_round_s",
            "back_to_back_round_s",
            "back_to_back_cpu_round_s",
        ):
            assert row[field] > 0
        assert row["efficiency"] == pytest.approx(
            row["back_to_back_cpu_round_s"] / (row["simulate_round_s"] * cores)
        )
        assert row["efficiency"] == pytest.approx(row["work_fraction"] * row["core_use"])
        runs = row["runs_s"]
        assert len(runs) == 2  # medians of two are their means
        for field in ("simulate", "simulate_cpu", "report", "back_to_back", "back_to_back_cpu"):
            mean = (runs[0][field] + runs[1][field]) / 2
            assert row[f"{field}_round_s"] == pytest.approx(mean)
        assert row["report_round_s"] > 0
        assert row["simulate_per_peer_ms"] == pytest.approx(
            1e3 * row["simulate_round_s"] / row["peers"]
        )
        assert row["one_process_vs_workers"] == pytest.approx(
            row["simulate_round_s"] / row["simulate_workers_round_s"]
        )
        assert row["work_fraction"] == pytest.approx(
            row["back_to_back_cpu_round_s"] / row["simulate_cpu_round_s"]
        )
        assert row["core_use"] == pytest.approx(
            row["simulate_cpu_round_s"] / (row["simulate_round_s"] * cores)
        )
        assert row["back_to_back_per_peer_ms"] == pytest.approx(
            1e3 * row["back_to_back_cpu_round_s"] / row["peers"]
        )
    assert report["efficiency"] == {str(r["peers"]): r["efficiency"] for r in report["sizes"]}
    small, large = report["sizes"]
    assert report["per_peer_round_growth"] == pytest.approx(
        large["simulate_per_peer_ms"] / small["simulate_per_peer_ms"]
    )
    assert report["one_process_vs_workers"] == {
        str(r["peers"]): r["one_process_vs_workers"] for r in report["sizes"]
    }
