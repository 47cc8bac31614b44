"""`gossipcomp plot` and `simulate --plot` write valid PNG images of the stated size."""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from pathlib import Path

import pytest
from matplotlib.image import imread

from gossipcomp.cli import main
from gossipcomp.experiment.plot import (
    BYTES_AXIS,
    MAX_POINTS_DRAWN,
    MAX_REPORT_BYTES,
    MAX_REPORTS,
    MAX_TOTAL_REPORT_BYTES,
    draw_curves,
    load_curves,
)
from gossipcomp.experiment.report import PeerReport, Report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header, after checking its signature and the header's CRC."""
    blob = path.read_bytes()
    assert blob[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", blob[8:16])
    assert kind == b"IHDR" and length == 13
    header = blob[16:29]
    (crc,) = struct.unpack(">I", blob[29:33])
    assert zlib.crc32(b"IHDR" + header) == crc
    width, height = struct.unpack(">II", header[:8])
    return width, height


@pytest.fixture(scope="module")
def two_reports(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("reports")
    paths = []
    for h in (1, 4):
        path = folder / f"h{h}.json"
        argv = ["simulate", "--quiet", "--topology", "ring4", "--algorithm", "dpsgd"]
        argv += ["--rounds", "20", "--eval-every", "5", "--local-steps", str(h)]
        assert main([*argv, "--report", str(path)]) == 0
        paths.append(path)
    return paths


def test_two_reports_make_a_png_of_the_stated_size(two_reports, tmp_path, capsys):
    out = tmp_path / "pictures" / "runs.png"
    argv = ["plot", *map(str, two_reports), "--out", str(out), "--width", "800", "--height", "600"]
    assert main(argv) == 0
    assert _png_size(out) == (800, 600)
    pixels = imread(out)  # decodes the whole image: every chunk is valid
    assert pixels.shape[:2] == (600, 800)
    assert pixels[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def test_reports_carry_what_the_plot_draws(two_reports):
    for path in two_reports:
        history = json.loads(path.read_text())["history"]
        assert [h["round"] for h in history][-1] == 20
        for h in history:
            assert h["min_test_accuracy"] <= h["mean_test_accuracy"] <= h["max_test_accuracy"]
            assert h["wall_seconds"] > 0


def test_simulate_plots_its_own_run(tmp_path):
    out = tmp_path / "run.png"
    argv = ["simulate", "--quiet", "--topology", "ring4", "--algorithm", "dpsgd"]
    assert main([*argv, "--rounds", "10", "--eval-every", "5", "--plot", str(out)]) == 0
    assert _png_size(out) == (1200, 900)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--width", "10"], "width (pixels) must be in [300, 6000], got 10"),
        (["--height", "100000"], "height (pixels) must be in [300, 6000], got 100000"),
        (["--width", "wide"], "width (pixels) must be an integer"),
    ],
)
def test_bad_sizes_exit_2(two_reports, tmp_path, capsys, extra, message):
    out = tmp_path / "x.png"
    assert main(["plot", str(two_reports[0]), "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "not valid JSON at line 1, column 1"),
        ("[1, 2]", "expected a JSON object"),
        ('{"history": [], "per_peer": []}', "non-empty 'per_peer'"),
        ('{"history": [], "per_peer": [{"rank": 0}]}', "non-empty 'history'"),
        (
            '{"history": [{"round": 1, "mean_test_accuracy": 7, "min_test_accuracy": 0,'
            ' "bytes_sent_total": 1}], "per_peer": [{"consensus_distance": 0}]}',
            "mean_test_accuracy: expected a finite number in [0, 1], got 7",
        ),
        (
            '{"history": [{"round": 1}], "per_peer": [{"consensus_distance": 0}]}',
            "missing",
        ),
    ],
)
def test_a_bad_report_exits_2_naming_the_file_and_field(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    out = tmp_path / "x.png"
    assert main(["plot", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "bad.json" in err
    assert not out.exists()


def test_out_must_be_a_png_path(two_reports, tmp_path, capsys):
    assert main(["plot", str(two_reports[0]), "--out", str(tmp_path / "x.jpg")]) == 2
    assert "expected a file name ending in .png" in capsys.readouterr().err
    argv = ["simulate", "--quiet", "--rounds", "1", "--plot", str(tmp_path)]
    assert main(argv) == 2
    assert "--plot" in capsys.readouterr().err


# ---- issue 22, finding 9: runs told apart, axes that say what they show, all-reduce reports ----


def _peer_report(source: Path, target: Path, rank: int = 0) -> Path:
    """`source` (a simulate report) as the report a `peer` process of rank `rank` writes: mode
    peer, its own row only, its own bytes."""
    report = json.loads(source.read_text())
    row = next(p for p in report["per_peer"] if p["rank"] == rank)
    share = row["bytes_sent"] / report["bytes_sent_total"]
    report.update(mode="peer", per_peer=[row], bytes_sent_total=row["bytes_sent"])
    for point in report["history"]:
        point["bytes_sent_total"] = round(point["bytes_sent_total"] * share)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report))
    return target


def _legend(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_lines_are_named_after_their_runs_and_differences(two_reports):
    """Legends were file stems: h1 and h4 read as names, not as what the runs were."""
    curves = load_curves(two_reports)
    assert [c.label for c in curves] == [
        "dpsgd on ring4 (local_steps=1)",
        "dpsgd on ring4 (local_steps=4)",
    ]
    assert _legend(draw_curves(curves)) == [f"{i + 1}. {c.label}" for i, c in enumerate(curves)]


def test_peer0_of_three_runs_reads_as_three_runs(two_reports, tmp_path):
    """`peer0` from three runs read the same; the same run under three folders keeps the folder."""
    paths = [_peer_report(two_reports[0], tmp_path / run / "peer0.json") for run in "abc"]
    labels = [c.label for c in load_curves(paths)]
    assert labels == [f"dpsgd on ring4, peer 0 [{run}/peer0.json]" for run in "abc"]


def test_label_flag_names_the_lines(two_reports, tmp_path, capsys):
    out = tmp_path / "x.png"
    argv = ["plot", *map(str, two_reports), "--out", str(out)]
    assert main([*argv, "--label", "H=1", "--label", "H=4"]) == 0
    assert [c.label for c in load_curves(two_reports, ["H=1", "H=4"])] == ["H=1", "H=4"]
    assert main([*argv, "--label", "only one"]) == 2
    assert "--label given 1 time(s) for 2 report(s)" in capsys.readouterr().err


def test_bytes_axis_is_per_peer_and_matches_the_report(two_reports, tmp_path):
    """The axis said "MB sent (all peers)" and drew one peer's bytes for a peer report; it now
    draws bytes per peer, the same for a run seen whole (simulate) or from one of its peers."""
    whole = json.loads(two_reports[0].read_text())
    peers = len(whole["per_peer"])
    assert whole["bytes_sent_total"] == sum(p["bytes_sent"] for p in whole["per_peer"])
    figure = draw_curves(load_curves([two_reports[0]]))
    axis = figure.axes[1]
    assert axis.get_xlabel() == BYTES_AXIS
    expected = [h["bytes_sent_total"] / peers / 1e6 for h in whole["history"]]
    assert list(axis.lines[0].get_xdata()) == pytest.approx(expected)
    assert expected[-1] == pytest.approx(whole["bytes_sent_total"] / peers / 1e6)
    one = load_curves([_peer_report(two_reports[0], tmp_path / "peer1.json", rank=1)])[0]
    row = whole["per_peer"][1]["bytes_sent"]
    assert one.megabytes[-1] == pytest.approx(row / 1e6)
    assert one.peers == 1 and one.megabytes[-1] == pytest.approx(expected[-1], rel=0.2)


@pytest.fixture(scope="module")
def allreduce_report(tmp_path_factory) -> Path:
    """The report of `gossipcomp allreduce` as a user runs it: 60 steps, the default
    --eval-every (a history point at step 50, then the end)."""
    path = tmp_path_factory.mktemp("allreduce") / "report.json"
    argv = ["allreduce", "--nproc", "2", "--steps", "60", "--report", str(path)]
    assert main(argv) == 0
    return path


def test_allreduce_reports_plot_with_history_time_and_spread(allreduce_report, tmp_path):
    """All-reduce reports were refused (no history without --eval-every); when they plotted,
    wall time and max accuracy were 0."""
    report = json.loads(allreduce_report.read_text())
    assert [h["round"] for h in report["history"]] == [50]
    assert report["history"][0]["max_test_accuracy"] >= report["history"][0]["mean_test_accuracy"]
    assert report["history"][0]["max_test_accuracy"] > 0
    bare = tmp_path / "no-history.json"  # as written with --eval-every 0
    bare.write_text(json.dumps({**report, "history": []}))
    long, short = load_curves([allreduce_report, bare])
    assert long.steps == [50, 60] and short.steps == [60]
    assert long.label.startswith("ddp-hook identity on all-reduce over 2 ranks")
    assert math.isnan(long.seconds[0])  # not recorded per evaluation: no point at 0 s
    assert long.seconds[-1] == pytest.approx(report["wall_seconds"]) and long.seconds[-1] > 0
    assert long.high[-1] == max(p["test_accuracy"] for p in report["per_peer"])
    assert long.mean[-1] == pytest.approx(report["final_test_accuracy"])
    out = tmp_path / "allreduce.png"
    assert main(["plot", str(allreduce_report), str(bare), "--out", str(out)]) == 0
    assert _png_size(out) == (1200, 900)


def test_one_peer_table_says_its_accuracy_not_mean_and_min(two_reports):
    """A single peer's table said "mean accuracy X, min X"."""
    whole = json.loads(two_reports[0].read_text())
    rows = [PeerReport(**p) for p in whole["per_peer"]]
    fields = {k: whole[k] for k in ("algorithm", "topology", "rounds", "wall_seconds")}
    for per_peer, says, never in (
        (rows[2:3], f"peer 2 accuracy {rows[2].test_accuracy:.4f}", "mean accuracy"),
        (rows, "mean accuracy", "peer 0 accuracy"),
    ):
        accuracies = [p.test_accuracy for p in per_peer]
        report = Report(
            mode="peer",
            final_test_accuracy=sum(accuracies) / len(accuracies),
            min_test_accuracy=min(accuracies),
            consensus_distance=0.0,
            average_model_test_accuracy=0.0,
            average_model_norm=0.0,
            bytes_sent_total=sum(p.bytes_sent for p in per_peer),
            per_peer=per_peer,
            **fields,
        )
        caption = str(report.summary_table().caption)
        assert says in caption and never not in caption
        assert (", min " in caption) == (len(per_peer) > 1)


def test_too_much_report_in_all_is_refused_before_any_is_read(tmp_path):
    """20 reports of 63 MB took over 60 s and 2.3 GB; one over the per-report limit, and reports
    over the limit together, are refused at once, naming the limit."""
    paths = []
    for index in range(MAX_REPORTS):
        path = tmp_path / f"big{index}.json"
        with path.open("wb") as file:
            file.truncate(63 * 2**20)  # sparse: costs no disk
        paths.append(path)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"over the limit of {MAX_TOTAL_REPORT_BYTES} on all"):
        load_curves(paths)
    with pytest.raises(ValueError, match=f"over the limit of {MAX_REPORT_BYTES}"):
        load_curves(paths[:1])
    assert time.perf_counter() - start < 5


def test_a_long_run_is_drawn_with_a_bounded_number_of_points(two_reports, tmp_path):
    report = json.loads(two_reports[0].read_text())
    last = report["history"][-1]
    report["history"] = [{**last, "round": r} for r in range(1, 50_001)]
    report["rounds"] = 50_000
    path = tmp_path / "long.json"
    path.write_text(json.dumps(report))
    curve = load_curves([path])[0]
    assert len(curve.steps) == 50_000
    line = draw_curves([curve]).axes[0].lines[0]
    assert len(line.get_xdata()) == MAX_POINTS_DRAWN
    assert line.get_xdata()[0] == 1 and line.get_xdata()[-1] == 50_000
