"""Hostile checkpoint files: each carries a correct digest (whoever wrote it could compute one),
so only the checks after the digest stand between it and the peer. Every one must be skipped
with a warning naming the file and the field, and the previous checkpoint used; nothing may hang
the peer or make it read or expand more than its model can need."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import math
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import in_memory_trainers, run_in_threads

from gossipcomp.experiment import PeerTrainer, TrainConfig, build_algorithm
from gossipcomp.gossip import DPSGD
from gossipcomp.peer import Peer
from gossipcomp.topology import load_topology
from gossipcomp.transport.base import Identity
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.workload import checkpoint
from gossipcomp.workload.checkpoint import MAGIC, VERSION, CheckpointError, CheckpointStore
from gossipcomp.workload.models import build_model, model_signature

RING4 = load_topology("topologies/ring4.yaml")
CONFIG = TrainConfig(algorithm="dpsgd", rounds=4, eval_every=2)
OLDER, NEWEST = 2, 4  # the rounds checkpointed by `trained`
KINDS = {"fifo": "a FIFO", "symlink": "a symbolic link", "directory": "a directory"}


@pytest.fixture
def trained(tmp_path: Path, one_thread: None) -> Path:
    """A directory holding every ring4 peer's checkpoints of rounds 2 and 4."""
    trainers = in_memory_trainers(RING4, CONFIG, InMemoryHub(), tmp_path, every=2)
    for t in trainers:
        t.peer.start(5, {})
    run_in_threads([t.run for t in trainers])
    return tmp_path


def fresh_trainer(directory: Path, config: TrainConfig = CONFIG) -> PeerTrainer:
    """Rank 0 of a new run that restores from `directory`."""
    return in_memory_trainers(RING4, config, InMemoryHub(), directory, every=2)[0]


def write_with_digest(path: Path, payload: bytes, length: int | None = None) -> None:
    """Write a checkpoint file whose header's digest matches `payload` (and whose header's
    length field says `length`, by default the truth)."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    announced = b"%d" % (len(payload) if length is None else length)
    path.write_bytes(b" ".join([MAGIC, VERSION, announced, digest]) + b"\n" + payload)


def payload_of(path: Path) -> bytes:
    data = path.read_bytes()
    return data[data.index(b"\n") + 1 :]


def tamper(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Let `change` edit the file's saved state in place, then write it back, digest and all."""
    record = torch.load(io.BytesIO(payload_of(path)), weights_only=True)
    change(record["state"])
    buffer = io.BytesIO()
    torch.save(record, buffer)
    write_with_digest(path, buffer.getvalue())


def restore_skipping_one(
    directory: Path, caplog: pytest.LogCaptureFixture, field: str
) -> PeerTrainer:
    """Restore rank 0 from `directory`: the newest file must be skipped with one warning naming
    it and `field`, and the older one restored."""
    trainer = fresh_trainer(directory)
    with caplog.at_level(logging.WARNING, logger="gossipcomp.workload.checkpoint"):
        assert trainer.restore() == OLDER
    assert trainer.peer.round == OLDER
    assert [h.round for h in trainer.history] == [OLDER]
    assert all(h.test_loss is not None for h in trainer.history)  # the loss is restored too
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "gossipcomp.checkpoint" and r.levelno == logging.WARNING
    ]
    newest = CheckpointStore(directory, 0).path_for(NEWEST)
    assert len(warnings) == 1, warnings
    assert str(newest) in warnings[0] and field in warnings[0], warnings[0]
    return trainer


def test_a_huge_header_length_is_refused_before_any_read(
    trained: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 1: a length field of 10^15 made the reader allocate 10^15 bytes (MemoryError)."""
    newest = CheckpointStore(trained, 0).path_for(NEWEST)
    write_with_digest(newest, payload_of(newest), length=10**15)
    restore_skipping_one(trained, caplog, "header payload length: 1000000000000000 bytes")
    with pytest.raises(CheckpointError, match="truncated: expected 1000000000000000 bytes"):
        CheckpointStore(trained, 0).read(newest)  # no bound given: the file's size still holds


def test_a_file_bigger_than_the_model_allows_is_refused_before_any_read(
    trained: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A (sparse) file longer than any checkpoint of this model, its header telling the truth,
    is refused on its size alone: nothing of it is read, so not even its digest is checked."""
    newest = CheckpointStore(trained, 0).path_for(NEWEST)
    length = fresh_trainer(trained).max_checkpoint_payload() + 1000  # beyond any header too
    write_with_digest(newest, b"", length=length)
    with newest.open("r+b") as file:
        file.truncate(file.seek(0, os.SEEK_END) + length)
    restore_skipping_one(trained, caplog, "file size")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda state: state.update(config=[1, 2]), "config: expected a dict"),  # finding 2
        (lambda state: state["config"].update(lr="fast"), "config: lr: expected a finite number"),
        (lambda state: state["config"].update(speed=3), "config: unknown settings"),
        (lambda state: state.pop("stream"), "state: expected keys"),
        (lambda state: state["peer"].update(round=3), "peer.round: expected 4"),
        (
            lambda state: state["peer"]["model"]["0.bias"].fill_(math.nan),
            "peer: peer checkpoint: model tensor '0.bias' holds NaN/Inf",
        ),
        (
            lambda state: state["peer"]["model"].update({"0.bias": torch.zeros(3)}),
            "peer: peer checkpoint model",
        ),
        (lambda state: state["peer"].update(down=[[1]]), "peer: unhashable"),
        (
            lambda state: state["optimizer"]["state"][0].update(momentum_buffer=torch.zeros(3)),
            "optimizer: state[0] momentum_buffer: expected (256, 64)",
        ),
        (
            lambda state: state["optimizer"]["param_groups"][0].update(lr=100.0),
            "optimizer: param_groups[0]['lr']: expected 0.1, got 100.0",
        ),
        (
            lambda state: state["stream"]["order"].fill_(10**9),
            "stream: order: expected a permutation",
        ),
        (lambda state: state["stream"].update(cursor=True), "stream: cursor: expected an integer"),
        (
            lambda state: state["history"][0].update(round="2"),
            "history: [0] round: expected an integer",
        ),
        (lambda state: state["history"].append([]), "history: expected keys"),
        (
            lambda state: state["history"][0].update(test_accuracy=math.inf),
            "history: [0] test_accuracy: expected a finite number in [0, 1], got inf",
        ),
        (
            lambda state: state["history"][0].update(test_loss=-1.0),
            "history: [0] test_loss: expected a finite number in [0, inf), got -1.0",
        ),
        (
            lambda state: state["history"][0].update(test_loss=math.nan),
            "history: [0] test_loss: expected a finite number in [0, inf), got nan",
        ),
        (
            lambda state: state["history"][0].update(test_loss="2.5"),
            "history: [0] test_loss: expected a finite number",
        ),
        (
            lambda state: state["losses"].update(initial=math.nan),
            "losses: initial: expected a finite number",
        ),
        (
            lambda state: state["losses"].update(rounds=[1.0] * 11),
            "losses: rounds: expected a list of at most 10 losses",
        ),
    ],
)
def test_a_bad_part_of_the_newest_checkpoint_falls_back_to_the_previous(
    trained: Path, caplog: pytest.LogCaptureFixture, change: Any, field: str
) -> None:
    """Every part of the state is checked before use; a bad one skips the file, naming it."""
    tamper(CheckpointStore(trained, 0).path_for(NEWEST), change)
    restore_skipping_one(trained, caplog, field)


def test_a_checkpoint_of_another_configuration_still_stops_the_restore(trained: Path) -> None:
    """Not a damaged file but a peer started with other settings: falling back to an older file
    would hide the mistake, so the restore stops, naming the setting and changing nothing."""
    tamper(CheckpointStore(trained, 0).path_for(NEWEST), lambda s: s["config"].update(lr=0.05))
    trainer = fresh_trainer(trained)
    with pytest.raises(ValueError, match=r"another configuration.*lr \(saved 0.05, now 0.1\)"):
        trainer.restore()
    assert trainer.peer.round == 0 and trainer.history == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_only_regular_files_are_opened(
    trained: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """Finding 3: a FIFO named like the newest checkpoint blocked the peer in open(). A link is
    refused too, not followed (here to a valid file: it might as well be /dev/zero)."""
    store = CheckpointStore(trained, 0)
    newest = store.path_for(NEWEST)
    valid = trained / "elsewhere.ckpt"
    newest.rename(valid)
    if kind == "fifo":
        os.mkfifo(newest)
    elif kind == "symlink":
        newest.symlink_to(valid)
    else:
        newest.mkdir()
    try:  # in a thread, so that a restore blocked in open() fails the test instead of hanging
        run_in_threads([lambda: restore_skipping_one(trained, caplog, KINDS[kind])], timeout=30)
    finally:
        if kind == "fifo":  # let a reader blocked in open() go (no reader: ENXIO)
            with contextlib.suppress(OSError):
                os.close(os.open(newest, os.O_WRONLY | os.O_NONBLOCK))


def _rezip(
    payload: bytes, change: Callable[[zipfile.ZipFile, zipfile.ZipInfo, bytes], None]
) -> bytes:
    """A copy of the zip archive in `payload` whose entries are written by `change`."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(payload)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            change(target, info, source.read(info))
    return out.getvalue()


def test_a_compressed_entry_is_refused_before_torch_load_expands_it(
    trained: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 4: torch.load inflates deflated zip entries, so 100 kB of file became 64 MiB of
    tensor. torch.save never compresses: a compressed entry is refused before torch.load runs."""
    store = CheckpointStore(trained, 0)
    newest = store.path_for(NEWEST)

    def inflate(state: dict[str, Any]) -> None:
        state["peer"]["model"]["0.weight"] = torch.zeros(16 * 2**20)  # 64 MiB, 200x the model

    tamper(newest, inflate)

    def deflate_big(target: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> None:
        method = zipfile.ZIP_DEFLATED if len(data) > 2**20 else zipfile.ZIP_STORED
        target.writestr(info.filename, data, compress_type=method)

    compressed = _rezip(payload_of(newest), deflate_big)
    assert len(compressed) < 2**20
    write_with_digest(newest, compressed)

    loads: list[int] = []
    real_load = torch.load

    def counting_load(file: Any, **kwargs: Any) -> Any:
        loads.append(len(file.getbuffer()))
        return real_load(file, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "load", counting_load)
    restore_skipping_one(trained, caplog, "data/0': compressed (method 8")
    assert loads == [len(payload_of(store.path_for(OLDER)))]  # the older file only


def test_an_archive_torch_save_would_not_write_is_refused(tmp_path: Path) -> None:
    """Not a zip, or an entry named twice (torch's reader and Python's could take different
    ones): refused before torch.load reads the archive."""
    store = CheckpointStore(tmp_path, rank=0)
    path = store.save(1, {"w": torch.zeros(4)})
    payload = payload_of(path)
    write_with_digest(path, b"\x80\x02}q\x00." + payload)  # a bare pickle in front
    with pytest.raises(CheckpointError, match="payload: not a zip archive"):
        store.read(path)

    def twice(target: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> None:
        target.writestr(info, data)
        if info.filename.endswith("/data/0"):
            target.writestr(info, bytes(len(data)))

    with pytest.warns(UserWarning, match="Duplicate name"):
        write_with_digest(path, _rezip(payload, twice))
    with pytest.raises(CheckpointError, match=r"data/0': appears twice"):
        store.read(path)


def test_an_expanded_view_is_refused_before_any_use(
    trained: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor can be saved as a view of 4 bytes with stride 0 and a shape of 2^40 elements:
    loading costs nothing, the first copy or dtype conversion 4 TiB. Refused on load."""
    tamper(
        CheckpointStore(trained, 0).path_for(NEWEST),
        lambda s: s["peer"]["model"].update({"0.weight": torch.zeros(1).expand(2**40)}),
    )
    restore_skipping_one(trained, caplog, "(4398046511104 bytes) views 4 bytes of storage")


def test_a_structure_shared_many_times_over_is_refused(
    trained: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pickle can hold one list 10^9 times in a few kB (each use is a memo reference); a walk
    over it, or an error message quoting it, would never end. At most as many values as the
    file has bytes are looked at."""
    wide = [[[0] * 1000] * 1000] * 1000
    tamper(CheckpointStore(trained, 0).path_for(NEWEST), lambda s: s.update(history=wide))
    restore_skipping_one(trained, caplog, "more values than the file has bytes")


def test_too_deep_a_nesting_is_refused(trained: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nesting bounds the walk's recursion (the unpickler itself nests without recursing)."""
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    tamper(CheckpointStore(trained, 0).path_for(NEWEST), lambda s: s.update(history=deep))
    restore_skipping_one(trained, caplog, "nested more than 32 deep")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", math.nan),
        ("lr", math.inf),
        ("lr", -0.1),
        ("lr", 0.0),
        ("lr", 1e308),
        ("momentum", 1.0),
        ("momentum", -0.5),
        ("momentum", math.nan),
        ("round_timeout", math.nan),
        ("round_timeout", math.inf),
        ("round_timeout", 0.0),
        ("round_timeout", 86401.0),
        ("consensus_step", math.nan),
        ("consensus_step", -1.0),
        ("consensus_step", math.inf),
        ("zeta", math.nan),
        ("gamma", math.inf),
        ("gamma", 0.0),
        ("seed", -1),
        ("seed", 2**32),
        ("rank", 0),
        ("gossip_steps", 0),
        ("gossip_steps", 101),
        ("rounds", 0),
        ("rounds", True),
        ("rounds", 2.5),
        ("batch_size", 0),
        ("eval_every", -1),
    ],
)
def test_bad_settings_are_refused_naming_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as raised:
        TrainConfig(**{field: value})
    message = str(raised.value)
    assert message.startswith(f"{field}: expected") and message.endswith(f"got {value!r}")


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_bad_attack_scale_is_refused(value: float) -> None:
    expected = rf"attack scale: expected a finite number in \(0, inf\), got {value}$"
    with pytest.raises(ValueError, match=expected):
        TrainConfig(attack_scale=value)


def test_settings_at_their_limits_are_accepted() -> None:
    config = TrainConfig(
        lr=1e6, momentum=0.0, round_timeout=86400.0, seed=2**32 - 1, gossip_steps=100, zeta=1.0
    )
    assert config.lr == 1e6 and config.round_timeout == 86400.0


def test_every_rank_byzantine_is_refused() -> None:
    """With every peer lying there is no honest accuracy to report (it came out as null)."""
    config = TrainConfig(byzantine=(3, 1, 0, 2))
    with pytest.raises(ValueError, match="no honest peer left to measure: --byzantine lists"):
        build_algorithm(config, RING4, 0)
    build_algorithm(TrainConfig(byzantine=(0, 1, 2)), RING4, 3)  # one honest peer is enough


class _MaskedMlp(torch.nn.Module):
    """A registered MLP beside a persistent causal mask of -inf (a constant buffer, not
    gossiped, legitimately not finite) and a head tied to a layer of the body (a tensor with
    two names in the state dict)."""

    def __init__(self, name: str, seed: int) -> None:
        super().__init__()
        self.body = build_model(name, seed)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))
        self.tied = self.body[0]  # the same Linear: its weight is body.0.weight and tied.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _masked_trainers(directory: Path, make_model: Any = _MaskedMlp) -> list[PeerTrainer]:
    return in_memory_trainers(
        RING4, CONFIG, InMemoryHub(), directory, every=2, make_model=make_model
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            lambda model: model["body.0.bias"].fill_(math.nan),
            "model tensor 'body.0.bias' holds NaN/Inf",
        ),
        (  # the second name of a tied tensor loads last: it would overwrite the first
            lambda model: model["tied.weight"].fill_(math.nan),
            "model tensor 'tied.weight' holds NaN/Inf",
        ),
        (
            lambda model: model["mask"].fill_(0.0),
            "constant buffer 'mask' differs from this model's",
        ),
    ],
)
def test_a_trainer_restores_a_constant_minus_infinity_mask_and_refuses_nan_under_any_name(
    tmp_path: Path, one_thread: None, caplog: pytest.LogCaptureFixture, change: Any, field: str
) -> None:
    """A trainer's checkpoint of a model with a constant -inf mask restores (the trainer once
    refused any non-finite tensor of the saved model, so such a model could never resume),
    and the restored peer starts; a NaN under either name of a tied tensor, or a changed
    constant, is refused at restore, naming it, and the previous checkpoint is used."""
    trainers = _masked_trainers(tmp_path)
    assert "mask" not in {name for name, _ in trainers[0].peer.gossiped}
    for t in trainers:
        t.peer.start(5, {})
    run_in_threads([t.run for t in trainers])
    fresh = _masked_trainers(tmp_path)[0]
    assert fresh.restore() == NEWEST
    assert torch.equal(fresh.peer.model.mask, trainers[0].peer.model.mask)
    fresh.peer.start(5, {})  # the guard's own checks at start pass too
    fresh.peer.close()
    tamper(
        CheckpointStore(tmp_path, 0).path_for(NEWEST),
        lambda state: change(state["peer"]["model"]),
    )
    with caplog.at_level(logging.WARNING):
        assert _masked_trainers(tmp_path)[0].restore() == OLDER
    assert any(field in r.getMessage() for r in caplog.records), caplog.text


def _unguarded_peer(model: torch.nn.Module) -> Peer:
    """Rank 0 of RING4 over an in-memory hub, its buffers neither gossiped nor constant."""
    identity = Identity(0, RING4.hash, model_signature(model, False))
    transport = InMemoryTransport(identity, RING4.neighbors(0), InMemoryHub())
    return Peer(model, RING4, 0, DPSGD(), transport, gossip_buffers=False, ready=False)


@pytest.mark.parametrize(
    ("model", "found"),
    [
        ([1, 2], "list"),
        ({"body.0.weight": torch.zeros(1), 7: torch.zeros(1)}, "['7', 'body.0.weight']"),
        ({f"x{i}": 0 for i in range(10_000)}, "characters)"),  # cut, not echoed whole
    ],
)
def test_a_checkpoint_model_of_the_wrong_kind_is_refused_naming_it_in_bounded_words(
    model: Any, found: str
) -> None:
    """A saved model that is not a dict, has keys of mixed types, or has thousands of keys is
    refused with a ValueError (a TypeError escaped before) whose echo of the keys is cut."""
    peer = _unguarded_peer(_MaskedMlp("mlp", 0))
    try:
        state = peer.state_dict()
        state["model"] = model
        with pytest.raises(ValueError, match="peer checkpoint: model has parameters") as error:
            peer.load_state_dict(state)
        assert found in str(error.value) and len(str(error.value)) < 2000
    finally:
        peer.close()


def test_a_non_finite_tensor_is_allowed_only_where_the_model_itself_holds_one(
    tmp_path: Path,
) -> None:
    """Without constant buffers (gossip_buffers=False) a mask is checked like any tensor: it
    restores holding -inf because the model's own does, while a NaN in a tensor the model
    holds finite is refused before anything is applied."""
    source = _unguarded_peer(_MaskedMlp("mlp", 0))
    state = source.state_dict()
    source.close()
    fresh = _unguarded_peer(_MaskedMlp("mlp", 1))
    try:
        fresh.load_state_dict(copy.deepcopy(state))
        assert torch.equal(fresh.model.mask, source.model.mask)
        assert torch.equal(fresh.model.body[0].bias, source.model.body[0].bias)
        broken = copy.deepcopy(state)
        broken["model"]["body.0.bias"][0] = math.inf
        before = fresh.model.body[0].bias.detach().clone()
        with pytest.raises(ValueError, match="model tensor 'body.0.bias' holds NaN/Inf"):
            fresh.load_state_dict(broken)
        assert torch.equal(fresh.model.body[0].bias, before)
    finally:
        fresh.close()
