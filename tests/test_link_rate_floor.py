"""`simulate --link-rate 1e-300` was accepted and its rounds could never carry an envelope
(issue 23, finding 6): a rate below the floor at which the smallest round crosses a link within
--round-timeout is refused before anything runs, naming the flag and the floor."""

from __future__ import annotations

import time

import pytest

from gossipcomp.cli import MIN_ROUND_BYTES, main

ARGV = ["simulate", "--quiet", "--topology", "ring4", "--algorithm", "dpsgd", "--rounds", "2"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--link-rate", "1e-300"], "--link-rate 1e-300 Mbit/s"),
        (["--link-rate", "10", "--link-change", "0-1:1e-9@1"], "--link-change 0-1 1e-09 Mbit/s"),
    ],
    ids=["rate", "change"],
)
@pytest.mark.parametrize("timeout", [30.0, 2.0])
def test_rates_below_the_floor_are_refused_naming_flag_and_floor(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str, timeout: float
) -> None:
    start = time.perf_counter()
    assert main([*ARGV, *flags, "--round-timeout", str(timeout)]) == 2
    assert time.perf_counter() - start < 30  # refused before any peer starts
    floor = MIN_ROUND_BYTES * 8 / 1e6 / timeout
    err = " ".join(capsys.readouterr().err.split())
    assert f"{named}: below the floor of {floor:.3g} Mbit/s" in err
    assert f"within --round-timeout {timeout:g} s; expected at least {floor:.3g} Mbit/s" in err
