"""`gossipcomp plot` and `simulate --plot` write valid PNG images of the stated size."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from matplotlib.image import imread

from gossipcomp.cli import main

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
        ("not json", "not a JSON report"),
        ("[1, 2]", "expected a JSON object"),
        ('{"history": [], "per_peer": []}', "non-empty 'history'"),
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
