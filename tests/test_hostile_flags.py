"""Hostile or mistyped command lines: every one ends in one line on stderr naming the flag or path
and what was expected, with status 2 (cannot run as given) or 1 (training failed), never a
traceback, and before any training when the mistake is visible before it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from gossipcomp import cli
from gossipcomp.experiment import simulation
from gossipcomp.experiment.report import PeerReport, Report


def _gossipcomp(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gossipcomp", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _assert_one_line_error(stderr: str, *fragments: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def _assert_ends_in_one_line_error(stderr: str, *fragments: str) -> None:
    """For failures during training: log records may come first (on a loaded machine a slow
    neighbour is reported down), but the error itself is one line, the last, with no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert errors == [lines[-1]], stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIMULATE = ["simulate", "--topology", "ring4", "--quiet"]
PEER = ["peer", "--topology", "ring4", "--rank", "0", "--quiet"]


@pytest.mark.parametrize(
    "argv, flag, expected",
    [
        (["--round-timeout", "nan"], "--round-timeout", "(0, 86400]"),
        (["--round-timeout", "inf"], "--round-timeout", "(0, 86400]"),
        (["--round-timeout", "0"], "--round-timeout", "(0, 86400]"),
        (["--round-timeout", "1e6"], "--round-timeout", "(0, 86400]"),
        (["--lr", "nan"], "--lr", "finite number in (0,"),
        (["--lr", "1e308"], "--lr", "finite number in (0,"),
        (["--lr", "-0.1"], "--lr", "finite number in (0,"),
        (["--momentum", "1"], "--momentum", "[0, 1)"),
        (["--momentum=-inf"], "--momentum", "[0, 1)"),
        (["--consensus-step", "nan"], "--consensus-step", "(0, 2)"),
        (["--consensus-step", "2"], "--consensus-step", "(0, 2)"),
        (["--zeta", "0"], "--zeta", "(0, 1]"),
        (["--gamma", "inf"], "--gamma", "(0, 1]"),
        (["--attack-scale", "nan"], "--attack-scale", "> 0"),
        (["--clip", "nan"], "--clip", "finite number in (0, inf)"),
        (["--clip", "-1"], "--clip", "finite number in (0, inf)"),
        (["--rounds", "0"], "--rounds", "rounds must be >= 1"),
        (["--rounds", "1.5"], "--rounds", "must be an integer"),
        (["--batch-size", "0"], "--batch-size", ">= 1"),
        (["--eval-every", "-1"], "--eval-every", ">= 0"),
        (["--checkpoint-every", "0"], "--checkpoint-every", ">= 1"),
        (["--checkpoint-keep", "0"], "--checkpoint-keep", ">= 1"),
        (["--gossip-steps", "0"], "--gossip-steps", "in [1, 100]"),
        (["--power-steps", "1000000000"], "--power-steps", "in [1, 100]"),
        (["--rank", "0"], "--rank", ">= 1"),
        (["--seed", "-1"], "--seed", "in [0, 4294967295]"),
        (["--seed", str(2**32)], "--seed", "in [0, 4294967295]"),
        (["--byzantine", "-1"], "--byzantine", ">= 0"),
        (["--schedule", "fastest"], "--schedule", "known: mergecomp, mgwfbp, per-tensor"),
        (["--model", "gpt"], "--model", "invalid choice"),
        (
            ["--algorithm", "gossip"],
            "--algorithm",
            "known: choco, choco-edge, def, dpsgd, powergossip",
        ),
        (["--algorithm", "powergossip:colour=red"], "--algorithm", "its options: rank, steps"),
    ],
)
def test_out_of_range_flag_values_are_refused_as_parsed(argv, flag, expected, capsys):
    assert cli.main([*SIMULATE, *argv]) == 2
    _assert_one_line_error(capsys.readouterr().err, flag, expected, "gossipcomp simulate")


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--startup-timeout", "nan"], ("--startup-timeout", "(0, 86400]")),
        (["--low-rank", "0"], ("--low-rank", ">= 1")),
        (["--rank", "-1"], ("--rank", ">= 0")),
        (["--rank", "7"], ("--rank 7", "ranks 0 to 3")),
        (["--low-rank", "100000"], ("--low-rank 100000", "expected 1 to 256")),
        (["--bulk-lane-mib", "-1"], ("--bulk-lane-mib", "in [0, 1024]")),
        (["--bulk-lane-mib", "4096"], ("--bulk-lane-mib", "in [0, 1024]")),
    ],
)
def test_peer_flags_are_refused_before_any_server_starts(argv, fragments, capsys):
    assert cli.main([*PEER, *argv]) == 2
    _assert_one_line_error(capsys.readouterr().err, *fragments)


def test_groups_for_an_algorithm_without_compressed_groups_are_refused(capsys):
    assert cli.main([*SIMULATE, "--algorithm", "dpsgd", "--schedule", "single"]) == 2
    _assert_one_line_error(
        capsys.readouterr().err, "schedule 'single'", "only choco, choco-edge, def, powergossip"
    )


def test_a_rank_from_the_environment_outside_the_topology_is_named(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "9")
    assert cli.main(["peer", "--topology", "ring4", "--quiet"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "RANK=9", "ranks 0 to 3")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_round_timeout_that_is_not_finite_is_refused_by_the_command(value):
    # nan used to fail every exchange at once and exit 0; inf crashed in the deadline code
    result = _gossipcomp(*SIMULATE, "--rounds", "2", "--round-timeout", value)
    assert result.returncode == 2
    _assert_one_line_error(result.stderr, "--round-timeout", repr(value), "(0, 86400]")


def test_a_rank_no_matrix_can_use_is_refused_at_once():
    # it was capped to 256 and ran ten times slower than rank 1: 20 rounds took over 90 s
    result = _gossipcomp(*SIMULATE, "--rank", "100000", "--rounds", "100000", timeout=30)
    assert result.returncode == 2
    _assert_one_line_error(result.stderr, "--rank 100000", "above 256", "expected 1 to 256")


def test_diverging_training_ends_in_one_line_and_status_1():
    # --lr 1e308 overflowed with a traceback; a large finite step now stops as diverged
    result = _gossipcomp(*SIMULATE, "--lr", "1e6", "--rounds", "30", "--eval-every", "0")
    assert result.returncode == 1
    _assert_ends_in_one_line_error(result.stderr, "NaN/Inf", "diverged", "--lr")


@pytest.mark.parametrize(
    "flag, path, fragment",
    [
        ("--report", "/dev/null/r.json", "/dev/null is not a directory"),
        ("--report", "{tmp}", "is a directory; expected a file path"),
        ("--checkpoint-dir", "/dev/null/ck", "cannot make directory /dev/null/ck"),
        ("--checkpoint-dir", "{tmp}/file", "is not a directory"),
    ],
)
def test_unwritable_output_paths_fail_before_training(tmp_path, flag, path, fragment):
    (tmp_path / "file").write_text("not a directory\n")
    path = path.format(tmp=tmp_path)
    # 100000 rounds would run for hours: the refusal must come before training
    result = _gossipcomp(*SIMULATE, "--rounds", "100000", flag, path, timeout=30)
    assert result.returncode == 2
    _assert_one_line_error(result.stderr, f"{flag} {path}", fragment)


def test_every_rank_byzantine_is_refused_without_a_null_report(tmp_path):
    report = tmp_path / "r.json"
    result = _gossipcomp(*SIMULATE, "--byzantine", "0", "1", "2", "3", "--report", str(report))
    assert result.returncode == 2
    _assert_one_line_error(result.stderr, "--byzantine", "every rank")
    assert not report.exists()


def test_plaintext_peer_on_every_interface_needs_insecure(tmp_path):
    ports = [_free_port() for _ in range(3)]
    topology = tmp_path / "open3.yaml"
    peers = "\n".join(f"  {r}: 0.0.0.0:{port}" for r, port in enumerate(ports))
    topology.write_text(f"name: open3\nkind: ring\nn: 3\npeers:\n{peers}\n")
    argv = ["peer", "--topology", str(topology), "--rank", "0", "--quiet", "--rounds", "2"]
    refused = _gossipcomp(*argv, "--startup-timeout", "1")
    assert refused.returncode == 2
    _assert_one_line_error(
        refused.stderr, f"0.0.0.0:{ports[0]}", "not a loopback address", "--tls-cert", "--insecure"
    )
    # with --insecure it serves and waits for its neighbours, which never come
    accepted = _gossipcomp(*argv, "--startup-timeout", "1", "--insecure")
    assert accepted.returncode == 2
    _assert_one_line_error(accepted.stderr, "not reachable within 1 s", "peer 1 at 0.0.0.0:")


def test_missing_tls_files_are_named_before_training(tmp_path):
    missing = tmp_path / "nowhere.pem"
    tls = ["--tls-cert", str(missing), "--tls-key", str(missing), "--tls-ca", str(missing)]
    result = _gossipcomp(*PEER, "--rounds", "100000", *tls, timeout=30)
    assert result.returncode == 2
    _assert_one_line_error(result.stderr, "--tls-cert", str(missing), "no such file")


def test_internal_errors_keep_their_traceback(capsys, monkeypatch):
    def broken(*args: object, **kwargs: object) -> Report:
        raise KeyError("a bug")

    # simulate's run imports run_simulation from its package when it runs (PEP 562)
    monkeypatch.setattr(simulation, "run_simulation", broken)
    assert cli.main([*SIMULATE, "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err
    assert "internal error" in err.strip().splitlines()[-1]


def _report(byzantine: tuple[bool, ...]) -> Report:
    rows = [
        PeerReport(r, 0.5 + r / 10, 1, 1, 0.0, 0.0, 0, 0.0, 0, [], byzantine=lied)
        for r, lied in enumerate(byzantine)
    ]
    return Report("simulate", "dpsgd", "ring", 1, 0.6, 0.5, 0.0, 0.6, 1.0, 4, 1.0, rows)


def test_honest_accuracy_is_never_null_while_an_honest_peer_is_reported():
    mixed = _report((True, False, False))
    assert mixed.honest_test_accuracy == pytest.approx(0.65)
    assert mixed.honest_min_test_accuracy == pytest.approx(0.6)
    assert "honest peers: mean 0.6500" in str(mixed.summary_table().caption)
    liar = _report((True,))  # a Byzantine `peer` process reports only itself
    assert liar.honest_test_accuracy is None and liar.honest_min_test_accuracy is None
    assert "no honest peer in this report" in str(liar.summary_table().caption)


def test_a_report_that_cannot_be_written_leaves_the_old_one_whole(tmp_path):
    target = tmp_path / "r.json"
    _report((False,)).write_json(target)
    before = target.read_text()
    assert json.loads(before)["honest_test_accuracy"] == pytest.approx(0.5)
    broken = _report((False,))
    broken.config["unserialisable"] = object()  # json.dump fails part way through
    with pytest.raises(TypeError):
        broken.write_json(target)
    assert target.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left
