"""A worker process of `simulate --workers` that goes silent or ends is reported as such (a clear
error with the remedy, exit 1), never as an internal error of gossipcomp."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from gossipcomp import cli
from gossipcomp.cli import simulate as simulate_command
from gossipcomp.experiment.simulation import WorkerFailed
from gossipcomp.experiment.simulation.workers import _expect


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_silent_worker_is_named_with_the_remedy() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_sleep, args=(30.0,), name="gossipcomp-worker-0")
    process.start()
    try:
        with pytest.raises(
            WorkerFailed, match="gossipcomp-worker-0: nothing heard in 0.2 s.*--workers"
        ):
            _expect(ours, process, "addresses", 0.2)
    finally:
        process.kill()
        process.join(5)
        theirs.close()


def test_a_worker_that_ended_is_named_with_its_exit_code() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_sleep, args=(0.0,), name="gossipcomp-worker-1")
    process.start()
    theirs.close()  # the worker's end goes with it: nothing more can come
    process.join(30)
    with pytest.raises(WorkerFailed, match="gossipcomp-worker-1 ended \\(exit code 0\\)"):
        _expect(ours, process, "addresses", 5.0)


def test_the_command_reports_a_failed_worker_as_an_error_not_a_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing_run(*_args: object, **_kwargs: object) -> int:
        raise WorkerFailed("gossipcomp-worker-0: nothing heard in 120 s")

    monkeypatch.setattr(simulate_command, "run", failing_run)
    assert cli.main(["simulate", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "nothing heard in 120 s" in err and "internal error" not in err
