"""benchmarks/adaptive.py in a tiny configuration, end to end (the real script in a subprocess).

The throttled run (links limited inside `gossipcomp simulate`) works anywhere; the shaped run
(real peer processes in network namespaces, benchmarks/shaped_links.py) where namespaces can be
built. The figures mean nothing at this size; the checks are on what holds at any size: every
field docs/benchmarks.md quotes is there, ratios are the quotients of the times they come from,
the link really changed mid-run, and the two ends of every link switched levels together.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
import shaped_links  # noqa: E402

FIELDS = {
    "time_to_090", "round_reached_090", "final_accuracy", "min_final_accuracy", "round_seconds",
    "round_seconds_before_change", "round_seconds_after_change", "compute_seconds_per_round",
    "bytes_sent_total", "bytes_per_round", "history", "change_seconds", "failed_exchanges",
}  # fmt: skip
ADAPTIVE_FIELDS = {
    "link_levels", "final_levels", "level_changes_one_end_only", "budget_seconds",
    "budget_source", "communication_seconds_per_round_after_change", "round_time_vs_budget",
}  # fmt: skip


def _run(tmp_path: Path, *arguments: str, timeout: float) -> dict[str, Any]:
    out = tmp_path / "adaptive.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "adaptive.py"), "--json", str(out),
         *arguments],
        cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"adaptive.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return json.loads(out.read_text())


def _check_configuration(result: dict[str, Any], rounds: int, change_round: int) -> None:
    assert FIELDS <= set(result)
    history = result["history"]
    assert history[-1][0] == rounds and [p[0] for p in history] == sorted(p[0] for p in history)
    seconds = [p[2] for p in history]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert result["round_seconds"] == pytest.approx(seconds[-1] / rounds)
    assert 0 <= result["final_accuracy"] <= 1 and result["bytes_sent_total"] > 0
    assert result["change_seconds"] == next(s for r, _, s in history if r >= change_round)
    if result["time_to_090"] is None:
        assert all(p[1] < 0.9 for p in history)
    else:
        first = next(p for p in history if p[1] >= 0.9)
        assert (result["round_reached_090"], result["time_to_090"]) == (first[0], first[2])


def _check_ratios(report: dict[str, Any]) -> None:
    by_name = {r["name"]: r for r in report["configurations"]}
    adaptive, dpsgd = by_name["adaptive"], by_name["dpsgd"]
    fixed = [r for r in report["configurations"] if r["rank"] is not None and r["time_to_090"]]
    if fixed and adaptive["time_to_090"] is not None:
        best = min(fixed, key=lambda r: r["time_to_090"])
        assert report["best_fixed"] == best["name"]
        assert report["adaptive_vs_best_fixed"] == pytest.approx(
            adaptive["time_to_090"] / best["time_to_090"]
        )
    if dpsgd["time_to_090"] and adaptive["time_to_090"] is not None:
        assert report["adaptive_vs_dpsgd"] == pytest.approx(
            adaptive["time_to_090"] / dpsgd["time_to_090"]
        )
    assert ADAPTIVE_FIELDS <= set(adaptive)
    assert adaptive["level_changes_one_end_only"] == 0
    assert report["round_time_vs_budget"] == adaptive["round_time_vs_budget"]
    comm = adaptive["round_seconds_after_change"] - adaptive["compute_seconds_per_round"]
    assert adaptive["round_time_vs_budget"] == pytest.approx(comm / adaptive["budget_seconds"])
    for key in ("adaptive_vs_best_fixed", "adaptive_vs_dpsgd", "round_time_vs_budget"):
        assert report["goals"][key]["met"] in (True, False, None)


def test_throttled_comparison_runs_end_to_end(tmp_path: Path) -> None:
    # links 10x faster than the real benchmark's, so D-PSGD's rounds take milliseconds
    report = _run(tmp_path, "--links", "throttled", "--peers", "3", "--rounds", "45",
                  "--model", "mlp", "--partition", "iid", "--ranks", "1", "4", "--eval-every",
                  "3", "--settle-rounds", "6", "--mbit", "1000", "--slow-mbit", "100",
                  "--plot", str(tmp_path / "adaptive.png"), timeout=240)  # fmt: skip
    assert report["links"] == "throttled" and report["skipped"] == {}
    assert report["workload"]["change_round"] == 15
    names = [r["name"] for r in report["configurations"]]
    assert names == ["dpsgd", "rank=1", "rank=4", "adaptive"]
    for result in report["configurations"]:
        _check_configuration(result, 45, 15)
        assert result["failed_exchanges"] == 0  # slow links are slow, never down
    by_name = {r["name"]: r for r in report["configurations"]}
    # D-PSGD sends the whole model every round: more bytes than any compressed run, and its
    # rounds slow down when the link drops (the others' payloads fit the slow link)
    assert by_name["dpsgd"]["bytes_sent_total"] > 5 * by_name["rank=4"]["bytes_sent_total"]
    dpsgd = by_name["dpsgd"]
    assert dpsgd["round_seconds_after_change"] > dpsgd["round_seconds_before_change"]
    assert by_name["dpsgd"]["time_to_090"] is not None  # 45 rounds of iid digits suffice
    _check_ratios(report)
    assert (tmp_path / "adaptive.png").stat().st_size > 10_000


def _namespaces_unavailable() -> str | None:
    try:
        shaped_links.check_available()
    except shaped_links.NamespacesUnavailable as why:
        return str(why)
    return None


UNAVAILABLE = _namespaces_unavailable()


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces: {UNAVAILABLE}")
def test_shaped_run_changes_the_link_mid_run_and_leaves_no_namespace(tmp_path: Path) -> None:
    report = _run(tmp_path, "--peers", "3", "--rounds", "6", "--model", "mlp", "--configs",
                  "fixed", "--ranks", "1", "--eval-every", "2", "--settle-rounds", "0",
                  timeout=240)  # fmt: skip
    (result,) = report["configurations"]
    _check_configuration(result, 6, 2)
    events = result["link_events_seconds"]
    assert 0 < events["drop"] < events["restore"]  # dropped at round 2, restored after round 6
    assert ["rate 10Mbit" in shown for shown in result["qdisc_after_change"]] == [True]
    assert not any(n.startswith(shaped_links.PREFIX) for n in shaped_links.stale_namespaces())
