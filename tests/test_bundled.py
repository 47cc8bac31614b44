"""scikit-learn's bundled tables read without importing scikit-learn (workload/bundled.py):
the same table its loaders give, a hostile file refused with a reason, a stratified split
that keeps each class's share, and a run of simulate that loads neither scikit-learn nor
sympy (the start-up they cost)."""

from __future__ import annotations

import gzip
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers import loaded_modules

from gossipcomp.workload.bundled import (
    BUNDLED_FILES,
    MAX_TABLE_BYTES,
    load_table,
    parse_table,
    stratified_split,
)


@pytest.mark.parametrize("loader", sorted(BUNDLED_FILES))
def test_a_table_read_from_its_file_is_the_one_scikit_learns_loader_gives(loader: str) -> None:
    from sklearn import datasets

    bunch = getattr(datasets, loader)()
    features, labels = load_table(loader)
    assert features.dtype == np.float32 and labels.dtype == np.int64
    np.testing.assert_array_equal(features, np.asarray(bunch.data, dtype=np.float32))
    np.testing.assert_array_equal(labels, np.asarray(bunch.target, dtype=np.int64))


def test_a_table_whose_file_is_elsewhere_comes_through_scikit_learns_loader(
    tmp_path: Path,
) -> None:
    from sklearn import datasets

    features, labels = load_table("load_iris", directory=tmp_path)  # no iris.csv there
    np.testing.assert_array_equal(features, datasets.load_iris().data.astype(np.float32))
    np.testing.assert_array_equal(labels, datasets.load_iris().target)


def test_an_unknown_table_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'load_faces'.*load_breast_cancer"):
        load_table("load_faces")


@pytest.mark.parametrize(
    ("text", "has_header", "reason"),
    [
        ("", True, "empty, expected a header line"),
        ("three,4,a\n1,2,3,4,0\n", True, "two whole numbers"),
        ("0,4,a\n1,2,3,4,0\n", True, "positive counts"),
        ("3,4,a\n1,2,3,4,0\n5,6,7,8,1\n", True, "declares 3 rows of 4 features, got 2 of 4"),
        ("2,4,a\n1,2,3,4,0\n5,6,7,8\n", True, "comma-separated numbers"),
        ("1,2,x\n3,4,1\n", False, "comma-separated numbers"),
        ("1,nan,0\n3,4,1\n", False, "features: expected finite"),
        ("1,2,0.5\n3,4,1\n", False, "labels: expected whole numbers"),
        ("1,2,-1\n3,4,1\n", False, r"labels: expected in \[0, 1000\)"),
        ("1,2,0\n", False, "at least 2 rows"),
    ],
)
def test_a_hostile_table_is_refused_naming_what_is_wrong(
    text: str, has_header: bool, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason) as refused:
        parse_table(text, has_header, "table.csv")
    assert str(refused.value).startswith("table.csv: ")


def test_a_packed_table_cut_short_is_refused_not_read_in_part(tmp_path: Path) -> None:
    """A gzip file cut at a line boundary of its text would parse as a smaller table: the
    stream's missing end is what refuses it."""
    rows = b"".join(b"%d,%d,%d\n" % (i, i + 1, i % 3) for i in range(2000))
    packed = gzip.compress(rows)
    (tmp_path / "digits.csv.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match="the gzip stream ends early"):
        load_table("load_digits", directory=tmp_path)
    (tmp_path / "digits.csv.gz").write_bytes(packed)
    features, labels = load_table("load_digits", directory=tmp_path)
    assert features.shape == (2000, 2) and labels.tolist() == [i % 3 for i in range(2000)]


def test_a_table_file_larger_than_any_bundled_one_is_refused_unread(tmp_path: Path) -> None:
    """A gzip bomb: a small file that unpacks past the bound is refused after reading the
    bound, not unpacked whole."""
    with gzip.open(tmp_path / "digits.csv.gz", "wb") as out:
        out.write(b"0," * (MAX_TABLE_BYTES // 2 + 1))
    with pytest.raises(ValueError, match=f"larger than {MAX_TABLE_BYTES} bytes"):
        load_table("load_digits", directory=tmp_path)


def test_a_table_of_the_most_bytes_and_shortest_fields_parses_in_bounded_memory() -> None:
    """The worst a table under the bound can ask: a field every two bytes."""
    fields_per_row = 1024
    row = ",".join(["0"] * fields_per_row)
    text = "\n".join([row] * (MAX_TABLE_BYTES // (len(row) + 1)))
    tracemalloc.start()
    try:
        features, labels = parse_table(text, False, "table.csv")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert features.shape[1] == fields_per_row - 1 and (labels == 0).all()
    assert peak < 64 << 20, peak


def test_the_split_keeps_each_class_share_on_both_sides_and_covers_every_row_once() -> None:
    labels = np.repeat(np.arange(5), [40, 13, 7, 2, 100])
    train, test = stratified_split(labels, 0.2, seed=3)
    assert len(test) == int(np.ceil(0.2 * len(labels)))
    assert sorted([*train, *test]) == list(range(len(labels)))
    for label, count in zip(*np.unique(labels, return_counts=True), strict=True):
        in_test = int((labels[test] == label).sum())
        assert abs(in_test - 0.2 * count) <= 1
        assert in_test >= 1 and (labels[train] == label).sum() >= 1


def test_the_split_is_deterministic_in_its_seed_and_shuffled() -> None:
    labels = np.repeat(np.arange(10), 50)
    first, again, other = (stratified_split(labels, 0.25, seed) for seed in (0, 0, 1))
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[1], other[1])
    assert not np.array_equal(np.sort(first[0]), first[0])  # not left in file order


def test_a_split_with_a_fraction_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match=r"test_fraction must be in \(0, 1\), got 1.0"):
        stratified_split(np.arange(10) % 2, 1.0, seed=0)


def test_loading_data_and_building_models_loads_neither_scikit_learn_nor_sympy() -> None:
    """Their imports were about 1 s of every process's start-up (0.6 s scikit-learn's
    model_selection and datasets, 0.3 s sympy through `to_empty`): the run must not bring
    them in. (torch.optim's first optimizer imports torch._dynamo, and sympy with it, and so
    does initialising chartransformer's embedding on the meta device: the statement builds
    the tabular models and no optimizer.)"""
    statement = (
        "from gossipcomp.workload.data import load_split\n"
        "from gossipcomp.workload.models import build_model\n"
        "for name in ('digits', 'wine', 'breast-cancer', 'iris'):\n"
        "    load_split(name, seed=0)\n"
        "for model in ('mlp', 'resmlp', 'cnn', 'wide-mlp'):\n"
        "    build_model(model, 0)\n"
    )
    names = loaded_modules(statement, "sklearn", "sympy", "scipy")
    assert [m for m in names if m.split(".")[0] in ("sklearn", "sympy", "scipy")] == []
