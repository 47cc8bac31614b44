"""The all-reduce benchmarks run end to end in a tiny configuration (the real scripts, in a
subprocess, 2 gloo ranks, a few steps) and write the JSON fields docs/benchmarks.md quotes.

The figures are meaningless at this size; the checks are on what holds at any size: the fields
exist, byte counts are exact, ratios are consistent with the times they come from."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import needs_namespaces

from gossipcomp.allreduce.pieces import PIECE_CANDIDATES
from gossipcomp.allreduce.train import AllreduceConfig
from gossipcomp.compress import parse_spec
from gossipcomp.schedule.costs import MAX_CONTENTION
from gossipcomp.workload.data import load_split
from gossipcomp.workload.models import build_resmlp

ROOT = Path(__file__).resolve().parents[1]
DIGITS_MLP_FLOATS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


def _run_status(script: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *arguments],
        cwd=ROOT,
        env=env,
        timeout=240,
        capture_output=True,
        text=True,
    )


def _run(script: str, *arguments: str) -> Any:
    done = _run_status(script, *arguments)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_allreduce_benchmark_writes_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    _run("allreduce.py", "--nproc", "2", "--steps", "8", "--repeats", "1", "--json", str(out))
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert methods["allreduce"]["payload_bytes_per_step"] == 4 * DIGITS_MLP_FLOATS
    assert (
        methods["allreduce"]["link_bytes_per_step"] == 4 * DIGITS_MLP_FLOATS
    )  # 2 ranks: 2(N-1)/N = 1
    assert methods["torch fp16"]["payload_bytes_per_step"] == 2 * DIGITS_MLP_FLOATS
    assert methods["sign"]["payload_bytes_per_step"] == 4 + (DIGITS_MLP_FLOATS + 7) // 8
    assert (
        methods["powersgd"]["payload_bytes_per_step"]
        == methods["torch powersgd"]["payload_bytes_per_step"]
    )
    ratio = methods["powersgd"]["step_ms"] / methods["torch powersgd"]["step_ms"]
    assert abs(result["powersgd_vs_torch_time"] - ratio) < 1e-9
    marsit = methods["marsit (no momentum)"]["link_bytes_per_step"]
    assert result["marsit_bytes_ratio"] == marsit / (4 * DIGITS_MLP_FLOATS)
    assert 1 / 32 <= result["marsit_bytes_ratio"] < 1 / 32 * 1.01
    for field in ("marsit_accuracy_gap", "ssd_accuracy_gap", "powersgd_accuracy"):
        assert -1.0 <= result[field] <= 1.0


def test_allreduce_merge_benchmark_writes_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "merge.json"
    arguments = ["--nproc", "2", "--steps", "8", "--calibration-steps", "2", "--repeats", "1"]
    _run("allreduce_merge.py", *arguments, "--json", str(out))
    result = json.loads(out.read_text())
    assert result["tensors"] >= 100
    methods = result["methods"]
    for spec in ("sign", "topk:ratio=0.01"):
        assert methods[f"{spec} per-tensor"]["groups"] == result["tensors"]
        assert methods[f"{spec} single"]["groups"] == 1
        planned = methods[f"{spec} planned"]["step_ms"]
        ratios = result["ratios"][spec]
        assert (
            abs(ratios["merged_speedup"] - methods[f"{spec} per-tensor"]["step_ms"] / planned)
            < 1e-9
        )
        assert (
            abs(ratios["planned_vs_single"] - methods[f"{spec} single"]["step_ms"] / planned) < 1e-9
        )
    assert result["merged_speedup"] == min(r["merged_speedup"] for r in result["ratios"].values())
    assert result["planned_vs_single"] > 0


sys.path.insert(0, str(ROOT / "benchmarks"))
import allreduce_merge  # noqa: E402
import shaped_hub  # noqa: E402
import shaped_links  # noqa: E402


@pytest.mark.parametrize("size", ["0", "5000"])
def test_allreduce_merge_refuses_a_batch_size_out_of_range(size: str, capsys) -> None:
    with pytest.raises(SystemExit):
        allreduce_merge.main(["--batch-size", size])
    assert f"--batch-size: expected 1 to 1024, got {size}" in capsys.readouterr().err


def test_a_shaped_nic_queues_what_its_host_sends_rather_than_dropping_it(monkeypatch) -> None:
    """Each tbf of the all-reduce hub holds NIC_QUEUE_BYTES, above the 4 MiB of a socket the
    kernel lets wait in a qdisc (tcp_limit_output_bytes): with tbf's 50 ms queue TCP lost about
    1% of its segments at 14.5 Mbit/s and its recoveries stalled whole steps."""
    assert shaped_hub.NIC_QUEUE_BYTES > 4 << 20
    commands: list[list[str]] = []
    monkeypatch.setattr(shaped_hub, "_command", commands.append)
    hub = shaped_hub.ShapedHub(2, 14.5)
    hub.set_rate(20.0)
    assert len(commands) == 4  # both ends of both ranks' links
    for command in commands:
        tbf = command[command.index("tbf") :]
        assert tbf[tbf.index("rate") + 1] == "20mbit"
        assert tbf[tbf.index("limit") + 1] == str(shaped_hub.NIC_QUEUE_BYTES)
        assert "latency" not in tbf
        # tbf drops a frame larger than its burst: the hub's jumbo frames must pass whole
        assert int(tbf[tbf.index("burst") + 1]) > shaped_hub.MTU_BYTES
    assert "latency" in shaped_links._tbf(20.0)  # noqa: SLF001 (gossip's links keep theirs)


def test_allreduce_merge_defaults_to_a_long_backward_on_shaped_links(monkeypatch) -> None:
    seen: dict[str, int] = {}

    def record(args: argparse.Namespace, nproc: int, compressors: tuple[str, ...]) -> int:
        seen[args.links] = args.batch_size
        return 0

    monkeypatch.setattr(allreduce_merge, "_shaped", record)
    monkeypatch.setattr(allreduce_merge, "_loopback", record)
    assert allreduce_merge.main(["--links", "shaped"]) == 0
    assert allreduce_merge.main(["--links", "loopback"]) == 0
    assert allreduce_merge.main(["--links", "shaped", "--batch-size", "48"]) == 0
    assert seen == {"shaped": 48, "loopback": AllreduceConfig.batch_size}
    seen.clear()
    allreduce_merge.main(["--links", "shaped"])
    assert seen == {"shaped": allreduce_merge.SHAPED_BATCH_SIZE} and seen["shaped"] > 32


def test_the_shaped_default_batch_is_a_ranks_whole_shard() -> None:
    train = len(load_split("digits", 0).y_train)
    whole = AllreduceConfig(sync="merged", batch_size=allreduce_merge.SHAPED_BATCH_SIZE)
    shard = allreduce_merge.rank_batch(whole, 2)
    # every step the same examples: no short last batch of an epoch to make steps uneven
    assert train // 2 <= shard < allreduce_merge.SHAPED_BATCH_SIZE
    assert allreduce_merge.rank_batch(whole, 3) == min(
        allreduce_merge.SHAPED_BATCH_SIZE, train // 3
    )
    assert allreduce_merge.rank_batch(AllreduceConfig(sync="merged", batch_size=48), 2) == 48


def test_allreduce_merge_trains_every_configuration_at_the_batch_size_asked() -> None:
    args = argparse.Namespace(
        model="resmlp", steps=10, batch_size=48, calibration_steps=2, gather_pieces="auto"
    )
    configs = allreduce_merge._configs(("sign",), {"single": "single", "m": "mergecomp"}, args)
    assert sorted(configs) == ["sign m", "sign single"]
    assert {c.batch_size for c in configs.values()} == {48}


@needs_namespaces()
def test_allreduce_merge_on_shaped_links_writes_the_network_bound_figures(tmp_path: Path) -> None:
    """2 gloo ranks behind tbf-limited NICs, sign only, a few steps: every planner's plan and
    prediction is reported, the link really limits the collective, the check is consistent."""
    out = tmp_path / "shaped.json"
    arguments = ["--links", "shaped", "--model", "resmlp", "--compressors", "sign"]
    arguments += ["--steps", "10", "--calibration-steps", "2", "--repeats", "1"]
    arguments += ["--comm-over-backward", "3", "--batch-size", "48", "--json", str(out)]
    done = _run_status("allreduce_merge.py", *arguments)
    result = json.loads(out.read_text())
    assert done.returncode == (0 if result["network_bound"] else 1), done.stderr[-2000:]
    assert result["links"] == "shaped" and result["nproc"] == 2 and result["tensors"] >= 100
    assert result["batch_size"] == 48
    methods = result["methods"]
    figures = result["compressors"]["sign"]
    assert figures["network_bound"] == (figures["comm_over_backward"] >= 1.0)
    assert result["comm_over_backward"] == figures["comm_over_backward"]
    ratio = figures["single_comm_ms"] / figures["backward_ms"]
    assert abs(figures["comm_over_backward"] - ratio) < 1e-9
    assert methods["sign per-tensor"]["groups"] == result["tensors"]
    assert methods["sign single"]["groups"] == 1
    for name, planner in figures["planners"].items():
        row = methods[f"sign {name}"]
        assert planner["groups"] == row["groups"] >= 1
        assert row["predicted_ms"] > 0  # every planner's cost model priced its plan
        assert planner["alpha_ms"] == row["alpha_ms"] >= 0  # on collectives inside steps
        assert 0 <= planner["contention"] == row["contention"] <= MAX_CONTENTION
        assert abs(planner["predicted_over_measured"] - row["predicted_ms"] / row["step_ms"]) < 1e-9
        assert abs(planner["vs_single"] - methods["sign single"]["step_ms"] / row["step_ms"]) < 1e-9
    assert figures["planned_groups"] == figures["planners"]["mergecomp"]["groups"]
    # sign all-gathers: each repeat says whether its all_gathers went whole (0) or in pieces
    pieces = methods["sign mergecomp"]["gather_piece_bytes"]
    assert figures["gather_piece_bytes"] == pieces and len(pieces) == 1
    assert all(p in (0, *PIECE_CANDIDATES) for p in pieces), pieces
    # exact bytes: one all-gather of the packed signs of every element, sent to the other rank
    numel = sum(p.numel() for p in build_resmlp(0).parameters())
    sent = parse_spec("sign").wire_bytes(numel)
    assert methods["sign single"]["link_bytes_per_step"] == sent
    # the NIC limits for real: one step's collective cannot beat the tbf rate (less the burst
    # that leaves at once, on each of the two shaped hops)
    assert figures["qdisc"].startswith("qdisc tbf") and " rate " in figures["qdisc"]
    floor_ms = 1e3 * 8 * max(0, sent - 2 * 5000) / (figures["mbit"] * 1e6)
    assert figures["single_comm_ms"] >= floor_ms
    # torn down on exit
    assert not [n for n in shaped_links.namespaces() if n.startswith(result["namespace_prefix"])]


@needs_namespaces()
def test_collective_skew_times_each_collective_against_its_wire_time(tmp_path: Path) -> None:
    """benchmarks/collective_skew.py, tiny: each kind's duration is at least the wire time, on
    the shaped NIC, of its bytes beyond the link's burst (the link limits it), and the figures
    are consistent."""
    out = tmp_path / "skew.json"
    _run("collective_skew.py", "--mbit", "20", "--kib", "32", "--steps", "3", "--gap-ms", "5",
         "--piece-kib", "8", "--json", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["kinds"]) == {"all_reduce", "all_gather", "all_gather_pieces", "exchange"}
    # after each step's pause the link's burst (a jumbo frame's) passes at line rate and the
    # rest takes the wire (bounded by the whole payload's wire time, 16 KiB with a 4 KiB burst
    # failed 3 runs in 12)
    burst = shaped_links.burst_bytes(20, shaped_hub.FRAME_BYTES)
    beyond_burst_ms = ((32 << 10) - burst) * 8 / 20e6 * 1e3
    for figures in result["kinds"].values():
        assert figures["wire_ms"] == pytest.approx((32 << 10) * 8 / 20e6 * 1e3)
        assert figures["duration_ms"] >= 0.9 * beyond_burst_ms
        assert figures["duration_over_wire"] == pytest.approx(
            figures["duration_ms"] / figures["wire_ms"]
        )
        assert figures["end_skew_abs_max_ms"] >= abs(figures["end_skew_ms"])
