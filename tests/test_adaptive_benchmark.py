"""benchmarks/adaptive.py in a tiny configuration, end to end (the real script in a subprocess),
and its analysis on hand-made inputs.

The throttled runs (links limited inside `gossipcomp simulate`) work anywhere; the shaped run
(real peer processes in network namespaces, benchmarks/shaped_links.py) where namespaces can be
built. The figures mean nothing at this size; the checks are on what holds at any size: the
rates move along the ring at the change rounds, every field docs/benchmarks.md quotes is
there, ratios are the quotients of the times they come from, a run whose communication does
not dominate its compute is refused, and the two ends of every link switched levels together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import needs_namespaces

from gossipcomp.topology.files import load_topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import adaptive  # noqa: E402
import shaped_links  # noqa: E402

FIELDS = {
    "time_to_target", "round_reached_target", "first_crossing_seconds", "time_to_choco_target",
    "final_accuracy", "min_final_accuracy",
    "round_seconds", "compute_seconds_per_round", "communication_seconds_per_round",
    "comm_over_compute", "phase_round_seconds", "bytes_sent_total", "bytes_per_round", "history",
    "change_seconds", "failed_exchanges", "settled_communication_seconds",
}  # fmt: skip
ADAPTIVE_FIELDS = {
    "link_levels", "peer_levels", "final_levels", "level_changes_one_end_only", "reactions",
    "settled_phases", "round_time_vs_published_budget",
}  # fmt: skip
FIGURES = ("adaptive_vs_best_fixed", "adaptive_vs_dpsgd", "round_time_vs_budget")


def _run(tmp_path: Path, *arguments: str, timeout: float, status: int = 0) -> dict[str, Any]:
    out = tmp_path / "adaptive.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "adaptive.py"), "--json", str(out),
         *arguments],
        cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == status, (
        f"adaptive.py exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    report = json.loads(out.read_text())
    report["_stderr"] = done.stderr
    return report


def _first_reaching(history: list[list[float]], target: float, window: int) -> list[float] | None:
    """The first evaluation whose mean accuracy with the `window` - 1 before it reaches `target`."""
    means = [sum(p[1] for p in history[i - window + 1 : i + 1]) / window
             for i in range(window - 1, len(history))]  # fmt: skip
    return next((history[i + window - 1] for i, m in enumerate(means) if m >= target), None)


def _check_run(result: dict[str, Any], rounds: int, changes: list[int], target: float) -> None:
    assert FIELDS <= set(result)
    history = result["history"]
    assert history[-1][0] == rounds and [p[0] for p in history] == sorted(p[0] for p in history)
    seconds = [p[2] for p in history]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert result["round_seconds"] == pytest.approx(seconds[-1] / rounds)
    comm = result["round_seconds"] - result["compute_seconds_per_round"]
    assert result["communication_seconds_per_round"] == pytest.approx(comm)
    assert result["comm_over_compute"] == pytest.approx(comm / result["compute_seconds_per_round"])
    assert 0 <= result["final_accuracy"] <= 1 and result["bytes_sent_total"] > 0
    assert result["change_seconds"] == [next(s for r, _, s in history if r >= c) for c in changes]
    window, choco_target = adaptive.Workload.target_window, adaptive.Workload.choco_target
    reached = _first_reaching(history, target, window)
    if reached is None:
        assert result["time_to_target"] is None and result["round_reached_target"] is None
    else:
        assert (result["round_reached_target"], result["time_to_target"]) == tuple(reached[::2])
    crossing = _first_reaching(history, target, 1)
    assert result["first_crossing_seconds"] == (crossing[2] if crossing else None)
    choco = _first_reaching(history, choco_target, window)
    assert result["time_to_choco_target"] == (choco[2] if choco else None)


def test_time_to_target_is_when_the_mean_of_the_last_evaluations_reaches_it() -> None:
    """One lucky evaluation over the target is a first crossing, not the time to target: that
    waits until the mean of `window` evaluations reaches it (run 10: rank 2 touched 0.94 at
    round 100, then read 0.924-0.931)."""
    points = [(2, 0.90, 1.0), (4, 0.95, 2.0), (6, 0.91, 3.0), (8, 0.94, 4.0), (10, 0.98, 5.0)]
    assert adaptive.reached_target(points, 0.94, 1) == (4, 2.0)
    assert adaptive.reached_target(points, 0.94, 3) == (10, 5.0)  # (0.91 + 0.94 + 0.98) / 3
    assert adaptive.reached_target(points, 0.933, 3) == (8, 4.0)  # (0.95 + 0.91 + 0.94) / 3
    assert adaptive.reached_target(points, 0.95, 3) is None
    assert adaptive.reached_target(points[:2], 0.9, 3) is None  # fewer evaluations than the window


def test_targets_and_their_window_out_of_range_are_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--json", str(tmp_path / "x.json")]
    parsed = adaptive.parse_args([*base, "--choco-target", "0.8", "--target-window", "1"])
    assert adaptive.workload_of(parsed).choco_target == 0.8
    assert adaptive.workload_of(parsed).target_window == 1
    with pytest.raises(SystemExit):
        adaptive.parse_args([*base, "--choco-target", "1.5", "--target-window", "0"])
    error = capsys.readouterr().err
    assert "--choco-target: expected an accuracy in (0, 1], got 1.5" in error
    assert "--target-window: expected 1 to 50 evaluations, got 0" in error


def test_a_hold_reaches_the_workload_and_is_refused_where_nothing_would_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--hold-lowest-until` and `--no-follow-loss` go to the workload; beyond --rounds, or
    with no configuration they act on (a coordinator's hold, any adaptive configuration's
    loss), they are refused naming the flag, not ignored."""
    base = ["--json", str(tmp_path / "x.json"), "--rounds", "40"]
    parsed = adaptive.parse_args([*base, "--hold-lowest-until", "20"])
    assert adaptive.workload_of(parsed).hold_lowest_until == 20
    assert adaptive.workload_of(parsed).follow_loss  # the default
    unfollowed = adaptive.parse_args([*base, "--no-follow-loss"])
    assert not adaptive.workload_of(unfollowed).follow_loss
    alone = adaptive.parse_args([*base, "--no-follow-loss", "--configs", "no-coordinator"])
    assert not adaptive.workload_of(alone).follow_loss  # levels set by the peers follow it too
    for extra, said in (
        (["--hold-lowest-until", "41"], "--hold-lowest-until: expected 0 to --rounds (40), got 41"),
        (
            ["--hold-lowest-until", "5", "--configs", "fixed", "no-coordinator"],
            "--hold-lowest-until: expected a configuration with a coordinator",
        ),
        (
            ["--no-follow-loss", "--configs", "dpsgd", "fixed"],
            "--no-follow-loss: expected an adaptive configuration",
        ),
    ):
        with pytest.raises(SystemExit):
            adaptive.parse_args([*base, *extra])
        assert said in capsys.readouterr().err


def test_choco_figures_are_timed_to_the_choco_target() -> None:
    """Choco's runs end below the PowerGossip target: its figures use `time_to_choco_target`,
    D-PSGD's included."""
    results = [
        _result("dpsgd", [100.0, 100.0], 50.0, time_to_choco_target=[80.0, 80.0]),
        _result("choco topk=0.02", [None, None], 9.0, ratio=0.02,
                time_to_choco_target=[20.0, 30.0]),
        _result("choco topk=0.2", [None, None], 40.0, ratio=0.2,
                time_to_choco_target=[60.0, 60.0]),
        _result("choco adaptive", [None, None], 9.0, adaptive=True,
                time_to_choco_target=[15.0, 30.0]),
    ]  # fmt: skip
    choco = adaptive.compare(results, True)["choco"]
    assert choco["best_fixed"] == "choco topk=0.02"
    assert choco["adaptive_vs_best_fixed"] == pytest.approx(22.5 / 25)
    assert choco["adaptive_vs_dpsgd"] == pytest.approx(22.5 / 80)
    assert choco["spread"]["adaptive_vs_best_fixed"] == pytest.approx([0.75, 1.0])


# the analysis, on hand-made inputs ------------------------------------------------------------
def test_the_rates_move_one_edge_on_at_each_change() -> None:
    w = adaptive.Workload(peers=4, rounds=40, rates=(2.0, 8.0, 32.0), changes=3)
    assert w.change_rounds == [10, 20, 30]
    assert w.edges == [(0, 1), (1, 2), (2, 3), (0, 3)]
    slow = [min(w.phase_rates(p), key=w.phase_rates(p).get) for p in range(4)]
    assert slow == [(0, 1), (1, 2), (2, 3), (0, 3)]  # the slow link on another edge each phase
    assert sorted(w.phase_rates(2).values()) == [2.0, 8.0, 32.0, 32.0]
    flags = adaptive.ThrottledRunner(w, 60).link_flags()
    changes = [flags[i + 1] for i, f in enumerate(flags) if f == "--link-change"]
    assert flags[:2] == ["--link-rate", "32"]
    assert changes[:2] == ["0-1:2@0", "1-2:8@0"]  # phase 0, then from the round after each
    assert {"0-1:32@11", "1-2:2@11", "2-3:8@11"} <= set(changes)
    assert {"0-1:8@31", "2-3:32@31", "0-3:2@31"} <= set(changes)
    assert changes[-2:] == ["0-1:32@40", "0-3:32@40"]  # back to the fastest for the closing


def test_on_a_complete_graph_the_rates_move_along_every_pair(tmp_path: Path) -> None:
    w = adaptive.Workload(peers=4, rounds=40, rates=(1.0, 4.0, 64.0), changes=3, graph="complete")
    assert w.edges == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    slow = [min(w.phase_rates(p), key=w.phase_rates(p).get) for p in range(4)]
    assert slow == [(0, 1), (0, 2), (0, 3), (1, 2)]  # one slow link, on another edge each phase
    assert sorted(w.phase_rates(3).values()) == [1.0, 4.0, 64.0, 64.0, 64.0, 64.0]
    path = adaptive.write_topology(tmp_path / "t.yaml", w.graph, w.peers, None)
    topology = load_topology(path)
    assert sorted(tuple(sorted(e)) for e in topology.graph.edges) == w.edges
    flags = adaptive.ThrottledRunner(w, 60).link_flags()
    assert {"0-1:64@11", "0-2:1@11", "0-3:4@11"} <= set(flags)  # the first change
    # a rate for each of the 6 edges is accepted at 4 peers, a 7th refused; no other graph
    rates = ["--rates", "1", "2", "3", "4", "5", "6"]
    base = ["--json", str(tmp_path / "x.json"), "--graph", "complete", "--peers", "4"]
    assert adaptive.parse_args([*base, *rates]).rates == [1, 2, 3, 4, 5, 6]
    with pytest.raises(SystemExit):
        adaptive.parse_args([*base, *rates, "7"])
    with pytest.raises(ValueError, match="graph: expected one of ring, complete, got 'star'"):
        adaptive.Workload(graph="star")  # type: ignore[arg-type]


def test_reactions_count_rounds_from_each_change_to_the_level_moving() -> None:
    w = adaptive.Workload(peers=3, rounds=30, rates=(2.0, 20.0), changes=2)
    assert w.change_rounds == [10, 20]
    timeline = {"0-1": [(4, "rank=1"), (13, "rank=8")], "1-2": [(4, "rank=8"), (24, "rank=1")]}
    found = adaptive.reactions(timeline, w)
    # change 1: 0-1 goes 2 -> 20 (moved 3 rounds later), 1-2 20 -> 2 (not before round 20)
    assert found[0] == {"change_round": 10, "rounds_until_level_moved": {"0-1": 3, "1-2": None}}
    assert found[1]["rounds_until_level_moved"]["1-2"] == 4


def _result(
    name: str,
    times: list[float | None],
    comm: float,
    settled: list[list[float]] | None = None,
    time_to_choco_target: list[float | None] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    point = [[2, 0.5, 1.0]]
    choco_times = time_to_choco_target or [None] * len(times)
    repeats = [
        {"time_to_target": t, "time_to_choco_target": choco_times[i], "comm_over_compute": comm,
         "history": point,
         "settled_communication_seconds": settled[i] if settled else [comm, comm]}
        for i, t in enumerate(times)
    ]  # fmt: skip
    base = {"name": name, "rank": None, "ratio": None, "repeats": repeats}
    base.update(extra)
    base["comm_over_compute_min"] = comm
    base["time_to_target"] = None if None in times else sum(times) / len(times)  # type: ignore[arg-type]
    base["time_to_choco_target"] = (
        None if None in choco_times else sum(choco_times) / len(choco_times)  # type: ignore[arg-type]
    )
    return base


def test_figures_are_ratios_of_means_with_the_per_repeat_range() -> None:
    results = [
        _result("dpsgd", [100.0, 120.0], 50.0),
        _result("rank=4", [20.0, 60.0], 9.0, rank=4),
        _result("rank=1", [30.0, 40.0], 3.0, [[0.02, 0.04], [0.03, 0.03]], rank=1),
        _result("rank=16", [None, 50.0], 20.0, rank=16),
        _result("adaptive", [12.0, 36.0], 5.0, [[0.03, 0.04], [0.03, 0.045]], adaptive=True,
                round_time_vs_published_budget=1.9),
    ]  # fmt: skip
    bound = adaptive.bound_check(results)
    assert bound["network_bound"] and bound["comm_over_compute"] == 9.0  # rank 1 is not checked
    found = adaptive.compare(results, bound["network_bound"])
    assert found["best_fixed"] == "rank=1"  # means 35 and 40; rank 16 missed once
    assert found["adaptive_vs_best_fixed"] == pytest.approx(24 / 35)
    assert found["adaptive_vs_dpsgd"] == pytest.approx(24 / 110)
    # per repeat: 12 / min(30, 20) and 36 / min(40, 60, 50)
    assert found["spread"]["adaptive_vs_best_fixed"] == pytest.approx([0.6, 0.9])
    assert found["goals"]["adaptive_vs_best_fixed"]["met"] is True
    assert found["goals"]["adaptive_vs_dpsgd"]["met"] is False
    assert found["no_coordinator"]["adaptive_vs_best_fixed"] is None  # not run
    # round time against the lowest fixed level's (rank 1), the worst phase of each repeat:
    # max(0.03 / 0.02, 0.04 / 0.04) = 1.5 and max(1.0, 1.5) = 1.5; then 0.045 -> 1.2
    assert found["round_time_reference"] == "rank=1"
    assert found["round_time_vs_budget"] == pytest.approx(1.5)
    assert found["spread"]["round_time_vs_budget"] == pytest.approx([1.5, 1.5])
    assert found["round_time_vs_published_budget"] == 1.9  # kept, not the figure
    results[-1]["repeats"][0]["settled_communication_seconds"] = [0.024, 0.04]
    found = adaptive.compare(results, bound["network_bound"])
    assert found["spread"]["round_time_vs_budget"] == pytest.approx([1.2, 1.5])
    assert found["goals"]["round_time_vs_budget"]["met"] is False  # mean 1.35
    results[1]["comm_over_compute_min"] = 1.5  # rank 4 (the ladder's middle) bound by CPU
    refused = adaptive.bound_check(results)
    assert not refused["network_bound"] and "rank=4: 1.50" in refused["not_network_bound_because"]
    assert all(adaptive.compare(results, False)[key] is None for key in FIGURES)


def test_a_choco_run_alone_is_checked_on_its_own_ladder_and_its_figures_come_again_from_its_report(
    tmp_path: Path,
) -> None:
    """D-PSGD and Choco's fixed ratios from the ladder's middle up are what a run of Choco's
    configurations alone is checked on (it was refused for lacking a PowerGossip rank);
    `--figures-from` takes a written report's configurations and writes the check and the
    figures again without running anything."""
    results = [
        _result("dpsgd", [100.0, 120.0], 50.0, time_to_choco_target=[80.0, 90.0]),
        _result("choco topk=0.02", [None, None], 30.0, time_to_choco_target=[10.0, 12.0],
                ratio=0.02),
        _result("choco topk=0.05", [None, None], 40.0, time_to_choco_target=[20.0, 30.0],
                ratio=0.05),
        _result("choco topk=0.2", [None, None], 90.0, time_to_choco_target=[60.0, 70.0],
                ratio=0.2),
        _result("choco adaptive", [None, None], 30.0, time_to_choco_target=[9.0, 9.6],
                adaptive=True),
    ]  # fmt: skip
    bound = adaptive.bound_check(results)
    assert bound["network_bound"]
    assert set(bound["comm_over_compute_checked"]) == {"dpsgd", "choco topk=0.05", "choco topk=0.2"}
    source, target = tmp_path / "run.json", tmp_path / "figures.json"
    source.write_text(json.dumps({"configurations": results, "network_bound": False}))
    assert adaptive.main(["--figures-from", str(source), "--json", str(target)]) == 0
    report = json.loads(target.read_text())
    assert report["network_bound"] is True and report["configurations"] == results
    assert report["choco"]["adaptive_vs_best_fixed"] == pytest.approx(9.3 / 11.0)
    assert report["adaptive_vs_best_fixed"] is None  # no PowerGossip configuration
    assert report["figures_command"].endswith(f"--json {target}")
    results[2]["comm_over_compute_min"] = 1.5  # the ladder's middle bound by CPU
    source.write_text(json.dumps({"configurations": results}))
    status = adaptive.main(["--figures-from", str(source), "--json", str(target)])
    assert status == adaptive.REFUSED
    report = json.loads(target.read_text())
    assert "choco topk=0.05: 1.50" in report["not_network_bound_because"]
    assert report["choco"]["adaptive_vs_best_fixed"] is None
    # it recomputes what was run: a flag that would change a run is refused, not recorded
    with pytest.raises(SystemExit):
        adaptive.main(["--figures-from", str(source), "--json", str(target), "--choco-target=0.5"])


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "not valid JSON"),
        ('{"network_bound": true}', "KeyError: 'configurations'"),
        ('{"configurations": [{"name": "dpsgd"}]}', "KeyError"),
        ('{"configurations": 7}', "TypeError"),
        ("[" * 100_000, "nested"),  # refused by depth before parsing (no RecursionError)
        (
            '{"configurations": [{"name": "dpsgd", "rank": null, "ratio": null, "repeats": [], '
            '"comm_over_compute_min": -1' + "0" * 400 + "}]}",
            "Error",  # an integer too large to format as a float: OverflowError
        ),
    ],
)
def test_figures_from_a_report_it_did_not_write_says_so_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    """A malformed report is refused with exit status 1, naming the file and the fault in
    at most a bounded echo of the file's words; nothing is written."""
    source, target = tmp_path / "run.json", tmp_path / "figures.json"
    source.write_text(text)
    assert adaptive.main(["--figures-from", str(source), "--json", str(target)]) == 1
    err = capsys.readouterr().err
    assert f"--figures-from {source}: " in err and named in err, err
    assert len(err) < 800 and not target.exists()
    assert "Traceback" not in err
    missing = tmp_path / "absent.json"
    assert adaptive.main(["--figures-from", str(missing), "--json", str(target)]) == 1
    assert str(missing) in capsys.readouterr().err


def test_the_plot_draws_choco_levels_per_link(tmp_path: Path) -> None:
    """An adaptive Choco run's level per link (top-k ratios, not ranks) gets its own panel."""
    history = [[2, 0.5, 1.0], [4, 0.9, 2.0]]
    levels = {
        "0-1": [[3, "topk:ratio=0.005"]],
        "1-2": [[3, "topk:ratio=0.005"], [5, "topk:ratio=0.01"]],
    }
    results = [
        {"name": "choco adaptive", "family": "choco", "adaptive": True,
         "repeats": [{"history": history, "link_levels": levels}]},
        {"name": "choco topk=0.01", "family": "choco", "adaptive": False,
         "repeats": [{"history": history}]},
    ]  # fmt: skip
    w = adaptive.Workload(peers=3, rounds=8, changes=2)
    path = tmp_path / "levels.png"
    adaptive.plot(results, w, path, "")
    assert path.stat().st_size > 10_000
    from PIL import Image

    assert Image.open(path).size[1] > 500  # two panels: accuracy and the Choco run's levels


# end to end ----------------------------------------------------------------------------------
def test_throttled_network_bound_comparison_runs_end_to_end(tmp_path: Path) -> None:
    report = _run(tmp_path, "--links", "throttled", "--peers", "3", "--rounds", "12",
                  "--changes", "2", "--rates", "2", "16", "--model", "mlp", "--partition", "iid",
                  "--ranks", "4", "8", "--configs", "dpsgd", "fixed", "adaptive",
                  "no-coordinator", "--repeats", "1", "--eval-every", "2",
                  "--settle-rounds", "1", "--target", "0.5", "--plot",
                  str(tmp_path / "adaptive.png"), timeout=420)  # fmt: skip
    assert report["links"] == "throttled" and report["skipped"] == {}
    assert report["workload"]["change_rounds"] == [4, 8]
    names = [r["name"] for r in report["configurations"]]
    assert names == ["dpsgd", "rank=4", "rank=8", "adaptive", "adaptive-nc"]
    for result in report["configurations"]:
        (run,) = result["repeats"]
        _check_run(run, 12, [4, 8], 0.5)
        assert run["failed_exchanges"] == 0  # slow links are slow, never down
        assert result["time_to_target"] == run["time_to_target"]
    by_name = {r["name"]: r for r in report["configurations"]}
    assert by_name["dpsgd"]["bytes_per_round"] > 5 * by_name["rank=8"]["bytes_per_round"]
    # a link of 2 Mbit/s: D-PSGD's 336 KB, and rank 4's 20 KB, take longer than a round's compute
    assert report["network_bound"] is True
    checked = report["comm_over_compute_checked"]
    assert set(checked) == {"dpsgd", "rank=4", "rank=8"}  # D-PSGD, the ladder from its middle up
    assert report["comm_over_compute"] == min(checked.values()) >= adaptive.BOUND_FACTOR
    for scope in (
        report,
        report["no_coordinator"],
        report["choco"],
        report["choco_no_coordinator"],
    ):
        assert set(FIGURES) <= set(scope) and set(scope["goals"]) == set(FIGURES)
    leveled = by_name["adaptive"]["repeats"][0]
    assert ADAPTIVE_FIELDS <= set(leveled)
    assert leveled["level_changes_one_end_only"] == 0
    assert [r["change_round"] for r in leveled["reactions"]] == [4, 8]
    for phase, comm in zip(
        leveled["settled_phases"], leveled["settled_communication_seconds"], strict=True
    ):
        assert comm == pytest.approx(phase["round_seconds"] - leveled["compute_seconds_per_round"])
        assert phase["round_time_vs_published_budget"] == pytest.approx(
            comm / phase["budget_seconds"]
        )
    assert report["round_time_vs_published_budget"] == pytest.approx(
        max(p["round_time_vs_published_budget"] for p in leveled["settled_phases"])
    )
    # the figure: against the lowest fixed level run (rank 4 here), phase by phase
    assert report["round_time_reference"] == "rank=4"
    lowest = by_name["rank=4"]["repeats"][0]["settled_communication_seconds"]
    assert report["round_time_vs_budget"] == pytest.approx(
        max(a / b for a, b in zip(leveled["settled_communication_seconds"], lowest, strict=True))
    )
    assert (tmp_path / "adaptive.png").stat().st_size > 10_000


def test_a_run_that_cannot_show_it_is_network_bound_is_refused(tmp_path: Path) -> None:
    # no D-PSGD in the run: the check cannot be made, so the run exits 3, its figures null (a
    # run bound by CPU takes the same path: bound_check, tested above on hand-made numbers);
    # on a complete graph of 4, so the suite runs that workload end to end too
    report = _run(tmp_path, "--links", "throttled", "--graph", "complete", "--peers", "4",
                  "--rounds", "4", "--changes", "1", "--rates", "2", "16", "--model", "mlp",
                  "--ranks", "1", "--configs", "fixed", "--repeats", "2", "--eval-every", "2",
                  timeout=300, status=adaptive.REFUSED)  # fmt: skip
    assert report["workload"]["graph"] == "complete"
    assert len(report["workload"]["phase_rates"][0]) == 6  # every pair of the 4 peers
    assert report["network_bound"] is False and "not network-bound" in report["_stderr"]
    assert "needs D-PSGD" in report["not_network_bound_because"]
    assert all(report[key] is None for key in FIGURES)
    (rank1,) = report["configurations"]
    assert len(rank1["repeats"]) == 2
    low, high = rank1["round_seconds_spread"]
    assert low <= rank1["round_seconds"] <= high
    assert rank1["round_seconds"] == pytest.approx(
        sum(r["round_seconds"] for r in rank1["repeats"]) / 2
    )


@needs_namespaces()
def test_shaped_run_moves_the_slow_link_and_leaves_no_namespace(tmp_path: Path) -> None:
    report = _run(tmp_path, "--peers", "3", "--rounds", "6", "--changes", "2", "--rates", "1",
                  "4", "--model", "mlp", "--configs", "fixed", "--ranks", "2", "--repeats", "1",
                  "--eval-every", "2", "--settle-rounds", "0", timeout=240,
                  status=adaptive.REFUSED)  # fmt: skip
    # no D-PSGD in the run: the check cannot be made, so it is refused, figures null
    assert "needs D-PSGD" in report["_stderr"]
    (result,) = report["configurations"]
    (run,) = result["repeats"]
    _check_run(run, 6, [2, 4], adaptive.Workload().target)
    events = run["link_events_seconds"]
    assert [name for name, _ in events] == ["change 1", "change 2", "restore"]
    assert 0 < events[0][1] < events[1][1] < events[2][1]
    # change 1: 0-1 1 -> 4, 1-2 4 -> 1; change 2: 1-2 1 -> 4, 0-2 4 -> 1 (2 edges each)
    shown = run["qdisc_after_changes"]
    assert len(shown) == 4 and "rate 1Mbit" in shown[1] and shown[1].startswith("1-2:")
    assert result["comm_over_compute"] > adaptive.BOUND_FACTOR  # 11 KB a round over 1 Mbit/s
    assert not any(n.startswith(shaped_links.PREFIX) for n in shaped_links.stale_namespaces())


def test_reactions_of_broadcast_levels_come_from_either_end_of_an_edge() -> None:
    """Choco without a coordinator has no link levels, only each peer's own: an edge's level
    moved when either end's did (before this, every reaction read "did not move")."""
    w = adaptive.Workload(peers=4, rounds=120, rates=(1.0, 4.0, 64.0), changes=3)
    peer_levels = {"0": [(8, "topk:ratio=0.02")], "2": [(8, "topk:ratio=0.02"), (40, "x")]}
    timeline = adaptive.sender_timeline(peer_levels, w.edges)
    assert timeline["1-2"] == [(8, "2:topk:ratio=0.02"), (40, "2:x")]
    assert timeline["0-1"] == [(8, "0:topk:ratio=0.02")]
    first = adaptive.reactions(timeline, w)[0]
    assert first["change_round"] == 30
    # after round 30 the rates moved on every edge but the last; only peer 2 changed (round 40)
    assert first["rounds_until_level_moved"] == {"0-1": None, "1-2": 10, "2-3": 10}


@pytest.mark.parametrize("algorithm", ["choco", "choco-edge"])
def test_choco_without_a_coordinator_runs_end_to_end_and_reports_its_levels(
    tmp_path: Path, algorithm: str
) -> None:
    """The tiny configuration of `choco adaptive-nc`: with one public copy per peer (the
    default), peers that set their own broadcast level report it (`peer_levels`); with one per
    edge (`choco-edge`),
    each edge's lower end its link's (`link_levels`); the reactions are read from them.
    Without D-PSGD the run is refused as not shown network-bound (status 3), the
    configurations still written."""
    report = _run(tmp_path, "--links", "throttled", "--peers", "3", "--rounds", "12",
                  "--changes", "2", "--rates", "2", "16", "--partition", "iid",
                  "--configs", "choco-fixed", "choco-no-coordinator", "--choco-ratios", "0.02",
                  "--choco-adaptive-algorithm", algorithm, "--repeats", "1", "--eval-every",
                  "2", "--settle-rounds", "1", timeout=300, status=adaptive.REFUSED)  # fmt: skip
    names = [r["name"] for r in report["configurations"]]
    assert names == ["choco topk=0.02", "choco adaptive-nc"]
    (run,) = report["configurations"][1]["repeats"]
    _check_run(run, 12, [4, 8], report["workload"]["target"])
    assert run["failed_exchanges"] == 0
    assert report["configurations"][1]["algorithm_flags"][:2] == ["--algorithm", algorithm]
    if algorithm == "choco":
        assert set(run["peer_levels"]) <= {"0", "1", "2"} and run["link_levels"] == {}
    else:
        assert set(run["link_levels"]) <= {"0-1", "1-2", "0-2"} and run["peer_levels"] == {}
        assert run["level_changes_one_end_only"] == 0
    assert [r["change_round"] for r in run["reactions"]] == [4, 8]
    assert report["choco_no_coordinator"]["round_time_vs_budget"] is None  # refused: not shown
