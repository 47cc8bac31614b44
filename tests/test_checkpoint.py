"""Checkpoint files: exact round trips, atomic writes, retention, and corrupt-file fallback."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipcomp.inputs import atomic_files
from gossipcomp.workload import checkpoint
from gossipcomp.workload.checkpoint import CheckpointError, CheckpointStore, LoadedCheckpoint


def assert_identical(a: Any, b: Any) -> None:
    """Same structure and types; tensors equal bit for bit (dtype, shape and bytes)."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*as_bytes)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_identical(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_identical(x, y)
    else:
        assert a == b


def small_state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "step": int(value)}


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_round_trip_of_training_state_is_bitwise_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(2):  # populate the momentum buffers
        optimizer.zero_grad()
        model(torch.randn(8, 5)).square().mean().backward()
        optimizer.step()
    generator = torch.Generator().manual_seed(7)
    torch.rand(3, generator=generator)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(),
        "extra": {
            "lr": 0.1,
            "name": "ring8",
            "flags": [True, False, None],
            "pair": (1, 2.5),
            "edges": {3: [torch.arange(3, dtype=torch.int64)], (1, 0): torch.tensor(float("nan"))},
            "big": 2**62,
            "inf": float("-inf"),
            "half": torch.randn(2, 2).to(torch.bfloat16),
        },
    }
    store = CheckpointStore(tmp_path / "a" / "b", rank=2)  # parents created
    path = store.save(12, state)
    assert path.name == "rank2-round000000012.ckpt"

    loaded = store.load_latest()
    assert loaded == LoadedCheckpoint(path=path, round=12, state=loaded.state)
    assert_identical(loaded.state, state)
    assert loaded.state["model"]._metadata == state["model"]._metadata  # module versions

    # the restored state behaves identically: one more step, and the next random draws
    model2 = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    model2.load_state_dict(loaded.state["model"])
    optimizer2.load_state_dict(loaded.state["optimizer"])
    batch = torch.randn(8, 5)
    for m, opt in ((model, optimizer), (model2, optimizer2)):
        opt.zero_grad()
        m(batch).square().mean().backward()
        opt.step()
    assert_identical(model2.state_dict(), model.state_dict())
    generator2 = torch.Generator()
    generator2.set_state(loaded.state["generator"])
    assert torch.equal(torch.rand(5, generator=generator2), torch.rand(5, generator=generator))


@pytest.mark.parametrize("keep", [1, 3])
def test_retention_keeps_exactly_the_newest(tmp_path: Path, keep: int) -> None:
    store = CheckpointStore(tmp_path, rank=0, keep=keep)
    for round in range(6):
        store.save(round, small_state(round))
    assert [p.name for p in store.paths()] == [
        f"rank0-round{r:09d}.ckpt" for r in range(5, 5 - keep, -1)
    ]
    assert sorted(tmp_path.iterdir()) == sorted(store.paths())  # nothing else left behind


def test_save_of_an_older_round_drops_newer_files(tmp_path: Path) -> None:
    """A run restarted from round 3 supersedes rounds 4-5: load_latest must not go back to them."""
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    for round in range(6):
        store.save(round, small_state(round))
    store.save(3, small_state(33))
    assert [p.name for p in store.paths()] == ["rank0-round000000003.ckpt"]
    assert store.load_latest().state["step"] == 33


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [(corrupt_flip, "digest mismatch"), (corrupt_truncate, "truncated: expected")],
)
def test_corrupt_newest_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Any, reason: str
) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    for round in (1, 2, 3):
        store.save(round, small_state(round))
    newest = store.paths()[0]
    corrupt(newest)

    with pytest.raises(CheckpointError, match=reason) as raised:
        store.read(newest)
    assert str(newest) in str(raised.value)

    with caplog.at_level(logging.WARNING, logger="gossipcomp.workload.checkpoint"):
        loaded = store.load_latest()
    assert loaded is not None and loaded.round == 2
    assert_identical(loaded.state, small_state(2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0]


def test_all_corrupt_raises_listing_each_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    for round in (1, 2):
        store.save(round, small_state(round))
    first, second = store.paths()
    corrupt_flip(first)
    corrupt_truncate(second)
    with pytest.raises(CheckpointError) as raised:
        store.load_latest()
    message = str(raised.value)
    assert str(first) in message and "digest mismatch" in message
    assert str(second) in message and "truncated" in message


def test_no_checkpoints_gives_none(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path, rank=0).load_latest() is None


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_crash_mid_write_leaves_previous_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    store.save(1, small_state(1))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def crash(*args: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(atomic_files.os, failing, crash)
    with pytest.raises(OSError, match="disk on fire"):
        store.save(2, small_state(2))
    monkeypatch.undo()

    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no tmp, no round 2
    assert not store.path_for(2).exists()
    loaded = store.load_latest()
    assert loaded is not None and loaded.round == 1


def test_leftover_temporary_file_is_ignored_then_removed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=1)
    store.save(1, small_state(1))
    stale = tmp_path / ".rank1-round000000002-abc123.tmp"
    stale.write_bytes(store.path_for(1).read_bytes()[:50])
    other_rank = tmp_path / ".rank10-round000000002-abc123.tmp"
    other_rank.write_bytes(b"someone else's")

    assert store.paths() == [store.path_for(1)]
    assert store.load_latest().round == 1
    store.save(2, small_state(2))
    assert not stale.exists()
    assert other_rank.exists()  # another peer may be writing it right now


def test_ranks_sharing_a_directory_are_independent(tmp_path: Path) -> None:
    one = CheckpointStore(tmp_path, rank=1, keep=1)
    ten = CheckpointStore(tmp_path, rank=10, keep=1)  # "rank1" is a prefix of "rank10"
    ten.save(5, small_state(10))
    one.save(3, small_state(1))
    one.save(4, small_state(1))  # pruning rank 1 must not touch rank 10
    assert one.paths() == [one.path_for(4)]
    assert ten.paths() == [ten.path_for(5)]
    assert ten.load_latest().state["step"] == 10
    assert CheckpointStore(tmp_path, rank=2).load_latest() is None


def test_wrong_magic_is_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    path = store.path_for(1)
    buffer = path.open("wb")
    torch.save({"rank": 0, "round": 1, "state": {}}, buffer)  # a plain torch file, no header
    buffer.close()
    with pytest.raises(CheckpointError, match="not a gossipcomp checkpoint") as raised:
        store.read(path)
    assert raised.value.path == path
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        store.load_latest()


def test_file_renamed_to_another_round_is_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    store.path_for(3).write_bytes(store.save(7, small_state(7)).read_bytes())
    with pytest.raises(CheckpointError, match="round 7 in file differs from name"):
        store.read(store.path_for(3))


@pytest.mark.parametrize(("keep", "rank"), [(0, 0), (-1, 0), (3, -1)])
def test_bad_arguments_raise_value_error(tmp_path: Path, keep: int, rank: int) -> None:
    with pytest.raises(ValueError, match=str(keep) if keep < 1 else "rank"):
        CheckpointStore(tmp_path, rank=rank, keep=keep)


def test_negative_round_raises_value_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    with pytest.raises(ValueError, match="-1"):
        store.save(-1, small_state(1))
    assert list(tmp_path.iterdir()) == []


class Opaque:
    def __init__(self) -> None:
        self.value = 3


def test_arbitrary_objects_are_refused_at_save(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    with pytest.raises(TypeError, match=r"\['extra'\]\[1\].*Opaque"):
        store.save(1, {"extra": [1, Opaque()]})
    assert list(tmp_path.iterdir()) == []


def test_arbitrary_objects_are_refused_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a well-formed file (header and digest right) cannot make load run arbitrary code."""
    store = CheckpointStore(tmp_path, rank=0)
    monkeypatch.setattr(checkpoint._ValueCheck, "check", lambda self, value, where: None)
    path = store.save(1, {"extra": Opaque()})
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="cannot be loaded safely") as raised:
        store.read(path)
    assert str(path) in str(raised.value)


def test_trailing_bytes_are_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    path = store.save(1, small_state(1))
    with path.open("ab") as file:
        file.write(b"junk")
    with pytest.raises(CheckpointError, match="trailing data"):
        store.read(path)


def test_checkpoint_directory_holds_only_final_names(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    store.save(1, small_state(1))
    assert [p.name for p in tmp_path.iterdir()] == ["rank0-round000000001.ckpt"]
    assert os.stat(store.path_for(1)).st_size > 0


def nested(depth: int) -> list[Any]:
    """A list nested `depth` deep."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"w": torch.zeros(1).expand(1000)}, r"state\['w'\]: tensor of shape \(1000,\).*views 4"),
        ({"deep": nested(40)}, r"state\['deep'\]\[0\].*: nested more than 32 deep"),
    ],
)
def test_what_could_not_be_loaded_back_is_refused_at_save(
    tmp_path: Path, state: dict[str, Any], message: str
) -> None:
    """Loading refuses expanded views and deep nesting, so saving refuses them first."""
    store = CheckpointStore(tmp_path, rank=0)
    with pytest.raises(ValueError, match=message):
        store.save(1, state)
    assert list(tmp_path.iterdir()) == []
