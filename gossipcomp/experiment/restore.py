"""The checks a checkpoint passes before a restored peer takes any of it over.

A checkpoint file is hostile until checked: each part (configuration, model, optimizer state,
batch order, accuracy history) is checked against this run's own, and a bad part is reported as
a CheckpointError naming the file and the part, so the store tries an older file instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from gossipcomp.experiment.config import TrainConfig
from gossipcomp.experiment.outcome import Evaluation
from gossipcomp.gossip.state import tensor_mismatch
from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.transport.codec import all_finite
from gossipcomp.workload.checkpoint import CheckpointError

MAX_RUN_SECONDS = 10 * 365 * 86400.0  # a history entry claiming a run longer is no run's


@contextmanager
def _part(path: Path, field: str) -> Iterator[None]:
    """Report a ValueError, TypeError or KeyError raised while checking `field` of the
    checkpoint at `path` as a CheckpointError naming both, so load_latest skips the file."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(path, f"{field}: {error}") from error


def _require_keys(value: Any, required: Set[str], optional: Set[str] = frozenset()) -> None:
    """Raise ValueError unless `value` is a dict holding `required` and only `optional` more."""
    if not isinstance(value, dict) or not required <= set(value) <= required | optional:
        found = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
        expected = sorted(required) + [f"{k} (optional)" for k in sorted(optional)]
        raise ValueError(f"expected keys {expected}, got {quoted(found)}")


def _saved_config(value: Any) -> dict[str, Any]:
    """A checkpoint's configuration as a full, valid TrainConfig's settings.

    Anything TrainConfig would refuse (another type, unknown keys, bad values) cannot have
    been written by a run, so it is a bad file (ValueError), not another configuration.
    """
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        found = sorted(map(repr, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"expected a dict of settings by name, got {quoted(found)}")
    unknown = sorted(value.keys() - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown settings {quoted(unknown)}")
    return TrainConfig(**value).to_dict()


def _check_optimizer_state(
    saved: Any, scratch: torch.optim.Optimizer, model: torch.nn.Module
) -> None:
    """Raise ValueError unless `saved` is the state of `scratch` (this run's SGD) after some
    steps: its parameter groups with the same settings, and per parameter at most a finite
    momentum buffer of the parameter's shape and dtype. torch.optim checks the groups' sizes
    only; a buffer of another shape would fail mid-training, and one of another dtype would be
    converted (allocated afresh) before any check."""
    _require_keys(saved, {"state", "param_groups"})
    groups, expected = saved["param_groups"], scratch.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(expected):
        raise ValueError(f"param_groups: expected {len(expected)} groups, got {quoted(groups)}")
    for index, (group, fresh) in enumerate(zip(groups, expected, strict=True)):
        # an older torch may have saved fewer settings; it fills in the defaults
        _require_keys(group, {"params"}, set(fresh) - {"params"})
        for key, value in group.items():
            if not _plain_equal(value, fresh[key]):
                raise ValueError(
                    f"param_groups[{index}][{key!r}]: expected {fresh[key]!r}, got {quoted(value)}"
                )
    params = list(model.parameters())
    per_param = saved["state"]
    if not isinstance(per_param, dict) or not all(
        type(k) is int and 0 <= k < len(params) for k in per_param
    ):
        found = sorted(map(repr, per_param)) if isinstance(per_param, dict) else per_param
        raise ValueError(
            f"state: expected parameter indices 0 to {len(params) - 1}, got {quoted(found)}"
        )
    for index, entry in per_param.items():
        _require_keys(entry, set(), {"momentum_buffer"})
        buffer, param = entry.get("momentum_buffer"), params[index]
        if buffer is None:
            continue
        found = tensor_mismatch(param, buffer)
        if found is not None:
            raise ValueError(
                f"state[{index}] momentum_buffer: expected {tuple(param.shape)} {param.dtype}, "
                f"got {quoted(found)}"
            )
        if not all_finite(buffer):
            raise ValueError(f"state[{index}] momentum_buffer holds NaN/Inf")


def _plain_equal(value: Any, expected: Any) -> bool:
    """Whether `value` equals an optimizer setting `expected` (a scalar or a list of them) with
    the same types throughout; never compares a tensor, whose truth value would raise."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(value) == len(expected) and all(
            _plain_equal(a, b) for a, b in zip(value, expected, strict=True)
        )
    return bool(value == expected)


def _check_stream_order(saved: Any, num_examples: int) -> None:
    """What BatchStream.load_state_dict leaves unchecked: the order is one permutation of this
    peer's examples (another index would fail, or read past them, mid-training) and the
    counters are plain integers, not bools."""
    _require_keys(saved, {"generator", "order", "cursor", "epoch"})
    order = saved["order"]
    if isinstance(order, torch.Tensor) and order.dtype == torch.int64 and order.numel():
        permutation = order.ndim == 1 and order.numel() == num_examples
        if not permutation or not torch.equal(order.sort().values, torch.arange(num_examples)):
            raise ValueError(f"order: expected a permutation of {num_examples} example indices")
    for key in ("cursor", "epoch"):
        if isinstance(saved[key], bool):
            raise ValueError(f"{key}: expected an integer, got {saved[key]!r}")


def _history(saved: Any, round: int, config: TrainConfig) -> list[Evaluation]:
    """The saved accuracy history, checked: evaluations at local steps and gossip rounds up to
    the checkpoint's (gossip `round`), with an accuracy in [0, 1] and a byte count >= 0. An
    older checkpoint's entries lack the gossip round: with one local step a round, it is the
    step."""
    if not isinstance(saved, list):
        raise ValueError(f"expected a list, got {type(saved).__name__}")
    history = []
    for index, entry in enumerate(saved):
        optional = {"gossip_round", "seconds", "test_loss"}
        _require_keys(entry, {"round", "test_accuracy", "bytes_sent"}, optional)
        at, accuracy, sent = entry["round"], entry["test_accuracy"], entry["bytes_sent"]
        gossip_round, seconds = entry.get("gossip_round", at), entry.get("seconds", 0.0)
        loss = entry.get("test_loss")
        try:
            checked_number("seconds", seconds, 0.0, MAX_RUN_SECONDS)
            if loss is not None:  # None: an older checkpoint's entry
                checked_number("test_loss", loss, 0.0, math.inf, closed_high=False)
            checked_integer("round", at, 0, config.steps_at(round))
            checked_integer("gossip_round", gossip_round, 0, round)
            checked_number("test_accuracy", accuracy, 0.0, 1.0)
            checked_integer("bytes_sent", sent, 0)
        except ValueError as error:
            raise ValueError(f"[{index}] {error}") from None
        loss = None if loss is None else float(loss)
        history.append(Evaluation(at, float(accuracy), sent, gossip_round, float(seconds), loss))
    return history


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint must agree on; the run's length, evaluation interval,
    timeout and bound on failed rounds may change between a run and its restart. A setting
    missing from an older checkpoint ran with its default."""
    full = {**TrainConfig().to_dict(), **config}
    free = ("rounds", "eval_every", "round_timeout", "max_failed_rounds")
    return {k: v for k, v in full.items() if k not in free}
