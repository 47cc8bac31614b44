"""What the command lines (`gossipcomp ...` and `python -m gossipcomp.allreduce`) share.

The argument types: each turns a flag's text into a checked number, or raises
ArgumentTypeError naming the flag's meaning, what was expected and (shortened) what was given,
so every command line words its errors alike. The parser and help formatter both use, the
one-line error they write, and the flags several commands take (the optimizer and data split of
a training run, its report), declared here once with what each command sets apart: its
defaults, limits and words.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from gossipcomp.inputs.text import quoted


def integer(what: str, low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper limit when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be an integer, got {quoted(text)}"
            ) from None
        if value < low or (high is not None and value > high):
            expected = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{what} must be {expected}, got {value}")
        return value

    return parse


def accepted(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type: the text itself, once `check` accepts it (its ValueError, which names
    what is wrong, becomes the usage error)."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return parse


def number(
    what: str,
    low: float,
    high: float = math.inf,
    *,
    low_closed: bool = False,
    high_closed: bool = True,
) -> Callable[[str], float]:
    """An argparse type: a finite number between `low` and `high`, each end excluded or
    included as told. NaN and infinities are refused: float() accepts them, and a NaN round
    deadline failed every exchange while an infinite one crashed."""
    if math.isfinite(high):
        expected = f"in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
    else:
        expected = f"{'>=' if low_closed else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # refused below, with the same message
        above = value >= low if low_closed else value > low
        below = value <= high if high_closed else value < high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(
                f"{what} must be a finite number {expected}, got {quoted(text)}"
            )
        return value

    return parse


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (the flag, what is wrong, what was expected) and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' where there is a value to show; None and flags say it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        flag = action.nargs == 0  # takes no value (store_true/false): its help says what it does
        if flag or action.default is None or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def write_error(prog: str, message: object) -> None:
    """One line on stderr, as argparse writes its own errors."""
    text = " ".join(str(message).split())  # a message with line breaks still takes one line
    sys.stderr.write(f"{prog}: error: {text}\n")


@dataclass(frozen=True)
class Setting:
    """One command's default, upper limit (None: none) and help of a flag others take too."""

    default: object
    high: float | None = None
    help: str | None = None


@dataclass(frozen=True)
class OptimizerFlags:
    """What a training command sets for the shared flags --lr, --momentum, --batch-size,
    --partition and --seed; `momentum_below_high`: --momentum must stay below its limit."""

    lr: Setting
    momentum: Setting
    batch_size: Setting
    partition: Setting
    seed: Setting
    momentum_below_high: bool = False


def add_optimizer_flags(group: argparse._ActionsContainer, flags: OptimizerFlags) -> None:
    """--lr, --momentum, --batch-size, --partition and --seed, in that order."""
    lr, momentum, batch, seed = flags.lr, flags.momentum, flags.batch_size, flags.seed
    group.add_argument(
        "--lr",
        type=number("learning rate", 0.0, math.inf if lr.high is None else lr.high),
        default=lr.default,
        help=lr.help,
    )
    momentum_type = number(
        "momentum",
        0.0,
        math.inf if momentum.high is None else momentum.high,
        low_closed=True,
        high_closed=not flags.momentum_below_high,
    )
    group.add_argument(
        "--momentum", type=momentum_type, default=momentum.default, help=momentum.help
    )
    batch_type = integer("batch size", 1, None if batch.high is None else int(batch.high))
    group.add_argument("--batch-size", type=batch_type, default=batch.default, help=batch.help)
    partition = flags.partition
    group.add_argument("--partition", default=partition.default, help=partition.help)
    seed_type = integer("seed", 0, None if seed.high is None else int(seed.high))
    group.add_argument("--seed", type=seed_type, default=seed.default, help=seed.help)


def add_report_flags(parser: argparse.ArgumentParser, report_help: str, quiet_help: str) -> None:
    """--report FILE (the JSON report) and --quiet, which every training command takes."""
    parser.add_argument("--report", type=Path, help=report_help)
    parser.add_argument("--quiet", action="store_true", help=quiet_help)
