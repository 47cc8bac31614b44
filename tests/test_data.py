"""Tests of the data split, partitions, model construction and the local training loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossipcomp.workload.data import (
    DigitsSplit,
    PartitionSpec,
    load_digits_split,
    parse_partition,
    partition_indices,
)
from gossipcomp.workload.models import build_mlp, model_signature, parameter_vector
from gossipcomp.workload.training import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LR,
    DEFAULT_MOMENTUM,
    BatchStream,
    derive_seed,
    evaluate_accuracy,
    local_step,
    make_optimizer,
)

N_PARTS = 8
SPECS = ["iid", "by-label", "dirichlet:0.5", "dirichlet:0.05"]


@pytest.fixture(scope="module")
def digits() -> DigitsSplit:
    return load_digits_split(seed=0)


# --- the split -----------------------------------------------------------------------------


def test_split_shapes_dtypes_and_range(digits: DigitsSplit) -> None:
    assert digits.x_train.dtype == torch.float32 and digits.x_test.dtype == torch.float32
    assert digits.y_train.dtype == torch.int64 and digits.y_test.dtype == torch.int64
    assert digits.x_train.shape[1] == 64 and digits.num_features == 64
    assert digits.num_classes == 10
    assert digits.x_train.shape[0] + digits.x_test.shape[0] == 1797
    assert digits.x_test.shape[0] == pytest.approx(0.2 * 1797, abs=1)
    assert float(digits.x_train.min()) >= 0.0 and float(digits.x_train.max()) == 1.0


def test_split_is_stratified_and_deterministic(digits: DigitsSplit) -> None:
    again = load_digits_split(seed=0)
    assert torch.equal(digits.x_train, again.x_train)
    assert torch.equal(digits.y_test, again.y_test)
    other = load_digits_split(seed=1)
    assert not torch.equal(digits.y_train, other.y_train)
    train_frac = torch.bincount(digits.y_train, minlength=10).double() / digits.y_train.numel()
    test_frac = torch.bincount(digits.y_test, minlength=10).double() / digits.y_test.numel()
    assert torch.allclose(train_frac, test_frac, atol=0.01)


def test_split_rejects_bad_fraction() -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_split(test_fraction=1.0)


# --- partitions ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_partition_disjoint_covering_deterministic(digits: DigitsSplit, spec: str) -> None:
    labels = digits.y_train.numpy()
    parts = partition_indices(labels, N_PARTS, parse_partition(spec), seed=3)
    assert len(parts) == N_PARTS
    assert all(p.dtype == np.int64 and p.size > 0 for p in parts)
    joined = np.concatenate(parts)
    assert joined.size == labels.size  # disjoint ...
    assert np.array_equal(np.sort(joined), np.arange(labels.size))  # ... and covering
    again = partition_indices(labels, N_PARTS, parse_partition(spec), seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(labels, N_PARTS, parse_partition(spec), seed=4)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_parts_are_balanced(digits: DigitsSplit) -> None:
    labels = digits.y_train.numpy()
    parts = partition_indices(labels, N_PARTS, PartitionSpec("iid"), seed=0)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.unique(labels[p]).size == 10 for p in parts)


def test_by_label_peers_see_few_classes(digits: DigitsSplit) -> None:
    labels = digits.y_train.numpy()
    parts = partition_indices(labels, N_PARTS, PartitionSpec("by-label"), seed=0)
    distinct = [np.unique(labels[p]).size for p in parts]
    assert max(distinct) <= 3
    assert max(p.size for p in parts) - min(p.size for p in parts) <= 1


def test_dirichlet_skews_class_proportions(digits: DigitsSplit) -> None:
    labels = digits.y_train.numpy()
    global_frac = np.bincount(labels, minlength=10) / labels.size
    parts = partition_indices(labels, N_PARTS, parse_partition("dirichlet:0.5"), seed=0)
    fracs = np.stack([np.bincount(labels[p], minlength=10) / p.size for p in parts])
    # Skewed: peers' class mixes differ clearly from the global mix and from each other.
    assert np.abs(fracs - global_frac).max() > 0.15
    assert fracs.std(axis=0).mean() > 0.05
    sizes = [p.size for p in parts]
    assert min(sizes) > 0 and max(sizes) > 1.5 * min(sizes)
    # A large alpha approaches iid.
    flat = partition_indices(labels, N_PARTS, parse_partition("dirichlet:1000"), seed=0)
    flat_fracs = np.stack([np.bincount(labels[p], minlength=10) / p.size for p in flat])
    assert np.abs(flat_fracs - global_frac).max() < 0.05


def test_dirichlet_tiny_alpha_keeps_every_part_non_empty() -> None:
    labels = np.repeat(np.arange(3), 4)  # 12 examples, 3 classes, 10 parts
    for seed in range(20):
        parts = partition_indices(labels, 10, parse_partition("dirichlet:0.01"), seed)
        assert all(p.size > 0 for p in parts)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(12))


def test_partition_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        partition_indices(np.zeros(3, np.int64), 4, PartitionSpec("iid"), seed=0)
    with pytest.raises(ValueError, match="n_parts"):
        partition_indices(np.zeros(3, np.int64), 0, PartitionSpec("iid"), seed=0)


def test_parse_partition_accepts_forms() -> None:
    assert parse_partition("iid") == PartitionSpec("iid")
    assert parse_partition("by-label") == PartitionSpec("by-label")
    assert parse_partition("dirichlet:0.5") == PartitionSpec("dirichlet", 0.5)
    assert str(parse_partition("dirichlet:0.25")) == "dirichlet:0.25"


@pytest.mark.parametrize(
    "bad", ["", "IID", "bylabel", "dirichlet", "dirichlet:", "dirichlet:0", "dirichlet:-1",
            "dirichlet:abc", "dirichlet:inf", "dirichlet:nan"],
)  # fmt: skip
def test_parse_partition_errors_name_input_and_forms(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_partition(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert "iid" in message and "by-label" in message and "dirichlet:ALPHA" in message


def test_partition_spec_validates_alpha() -> None:
    with pytest.raises(ValueError):
        PartitionSpec("dirichlet")
    with pytest.raises(ValueError):
        PartitionSpec("iid", 1.0)


# --- models --------------------------------------------------------------------------------


def test_build_mlp_is_deterministic_in_seed() -> None:
    a, b, c = build_mlp(7), build_mlp(7), build_mlp(8)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(parameter_vector(a), parameter_vector(c))


def test_build_mlp_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    build_mlp(0)
    assert torch.equal(state, torch.random.get_rng_state())


def test_build_mlp_shape() -> None:
    model = build_mlp(0)
    assert model(torch.zeros(5, 64)).shape == (5, 10)
    assert parameter_vector(model).numel() == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert parameter_vector(model).dtype == torch.float64


def test_model_signature_is_stable_and_tracks_architecture() -> None:
    sig = model_signature(build_mlp(0))
    assert len(sig) == 64 and int(sig, 16) >= 0
    assert model_signature(build_mlp(1)) == sig  # values are not part of the layout
    assert model_signature(build_mlp(0, hidden=(256, 128))) != sig
    assert model_signature(build_mlp(0, hidden=(256,))) != sig
    assert model_signature(build_mlp(0).to(torch.float64)) != sig


def test_parameter_vector_is_a_copy() -> None:
    model = build_mlp(0)
    vec = parameter_vector(model, dtype=torch.float32)
    vec.zero_()
    assert parameter_vector(model).abs().sum() > 0


# --- local training ------------------------------------------------------------------------


def test_batch_stream_covers_each_index_once_per_epoch() -> None:
    n, batch = 50, 8
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(n)
    stream = BatchStream(x, y, batch_size=batch, seed=0, rank=2)
    batches_per_epoch = -(-n // batch)
    epochs = []
    for _ in range(3):
        seen = torch.cat([stream.next_batch()[1] for _ in range(batches_per_epoch)])
        assert torch.equal(torch.sort(seen).values, y)
        epochs.append(seen)
    assert stream.epoch == 3
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled each epoch


def test_batch_stream_depends_on_seed_and_rank() -> None:
    x = torch.arange(40, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(40)

    def first(seed: int, rank: int) -> torch.Tensor:
        return BatchStream(x, y, 10, seed, rank).next_batch()[1]

    assert torch.equal(first(0, 0), first(0, 0))
    assert not torch.equal(first(0, 0), first(0, 1))
    assert not torch.equal(first(0, 0), first(1, 0))
    assert derive_seed(1, 23) != derive_seed(12, 3)


def test_batch_stream_validates_input() -> None:
    with pytest.raises(ValueError):
        BatchStream(torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64), 2, 0, 0)
    with pytest.raises(ValueError):
        BatchStream(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), 0, 0, 0)


def test_make_optimizer_validates() -> None:
    model = build_mlp(0)
    with pytest.raises(ValueError):
        make_optimizer(model, lr=0.0, momentum=0.9)
    with pytest.raises(ValueError):
        make_optimizer(model, lr=0.1, momentum=1.0)


@pytest.mark.usefixtures("one_thread")
def test_centralized_training_reaches_high_accuracy(digits: DigitsSplit) -> None:
    model = build_mlp(0)
    optimizer = make_optimizer(model, DEFAULT_LR, DEFAULT_MOMENTUM)
    stream = BatchStream(digits.x_train, digits.y_train, DEFAULT_BATCH_SIZE, seed=0, rank=0)
    before = evaluate_accuracy(model, digits.x_test, digits.y_test)
    losses = [local_step(model, optimizer, stream.next_batch()) for _ in range(600)]
    model.train()
    after = evaluate_accuracy(model, digits.x_test, digits.y_test)
    assert model.training  # evaluate_accuracy restores the mode
    assert before < 0.3
    assert np.mean(losses[-50:]) < 0.3 * np.mean(losses[:10])
    assert after >= 0.95
