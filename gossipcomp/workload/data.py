"""Real training data for peers: scikit-learn's bundled data sets and a text corpus, split
across peers.

digits (8x8 images, 10 classes), wine (13 features, 3 classes), breast-cancer (30 features, 2
classes) and iris (4 features, 3 classes) ship with scikit-learn, and pysource (the Python
standard library's own source files, for a character-level language model, workload/text.py)
ships with the interpreter, so nothing is downloaded. Every function here is deterministic in
the seed it is given: peers that agree on a seed agree on the data layout without talking to
each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from gossipcomp.workload.bundled import load_table, stratified_split
from gossipcomp.workload.catalog import DATASET_NAMES
from gossipcomp.workload.text import VOCABULARY_SIZE, python_source_windows

PartitionKind = Literal["iid", "by-label", "dirichlet"]

#: Accepted textual forms of a partition, for error messages and CLI help.
PARTITION_FORMS = ('"iid"', '"by-label"', '"dirichlet:ALPHA" with ALPHA > 0')


@dataclass(frozen=True)
class DatasetSplit:
    """A train/test split: float32 features and int64 labels (stratified by label), or for
    text (`vocabulary` set) int64 windows of character ids and their next-character targets."""

    x_train: torch.Tensor  # float32 [N_train, features]; text: int64 ids [N_train, context]
    y_train: torch.Tensor  # int64 [N_train]; text: int64 next ids [N_train, context]
    x_test: torch.Tensor  # float32 [N_test, features]; text: int64 ids [N_test, context]
    y_test: torch.Tensor  # int64 [N_test]; text: int64 next ids [N_test, context]
    vocabulary: int | None = None  # text: the number of character ids; None: labelled rows

    @property
    def num_features(self) -> int:
        """Input width (64 pixels for digits; the context length for text)."""
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        """Number of distinct labels (10 for digits; the vocabulary's size for text)."""
        if self.vocabulary is not None:
            return self.vocabulary
        return int(torch.cat([self.y_train, self.y_test]).max().item()) + 1


DigitsSplit = DatasetSplit  # the name from when digits was the only data set


@dataclass(frozen=True)
class DatasetInfo:
    """A bundled data set: its loader's name in sklearn.datasets (workload/bundled.py reads its
    file) and how its features are scaled.

    `pixels`: the features are 0..16 intensities, divided by 16 into [0, 1] (digits); else each
    feature is standardised to mean 0 and standard deviation 1 on the training part."""

    loader: str
    pixels: bool = False

    def load(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 features and int64 labels."""
        return load_table(self.loader)


@dataclass(frozen=True)
class TextDatasetInfo:
    """A text corpus for a character-level language model: `windows(seed, test_fraction)`
    gives its training and validation windows (workload/text.py)."""

    windows: Callable[[int, float], Any]


DATASETS: dict[str, DatasetInfo | TextDatasetInfo] = dict(
    zip(
        DATASET_NAMES,
        (
            DatasetInfo("load_digits", pixels=True),
            DatasetInfo("load_wine"),
            DatasetInfo("load_breast_cancer"),
            DatasetInfo("load_iris"),
            TextDatasetInfo(python_source_windows),
        ),
        strict=True,
    )
)


def is_text(name: str) -> bool:
    """Whether the registered data set `name` is text (windows with next-character targets)."""
    return isinstance(DATASETS.get(name), TextDatasetInfo)


def load_split(name: str, seed: int = 0, test_fraction: float = 0.2) -> DatasetSplit:
    """Load the bundled data set `name` and split it, stratified by label, deterministically in
    ``seed``; features scaled as DatasetInfo says (standardised with the training part's
    statistics only, so nothing of the test part leaks into training)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    info = DATASETS[name]
    if isinstance(info, TextDatasetInfo):
        train, test = info.windows(seed, test_fraction)
        return DatasetSplit(
            train.inputs, train.targets, test.inputs, test.targets, vocabulary=VOCABULARY_SIZE
        )
    x, y = info.load()
    train, test = stratified_split(y, test_fraction, seed)
    x_tr, x_te, y_tr, y_te = x[train], x[test], y[train], y[test]
    if info.pixels:
        x_tr, x_te = x_tr / np.float32(16.0), x_te / np.float32(16.0)
    else:
        mean = x_tr.mean(axis=0)
        std = np.maximum(x_tr.std(axis=0), np.float32(1e-6))  # a constant feature stays 0
        x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    return DatasetSplit(
        x_train=torch.from_numpy(np.ascontiguousarray(x_tr, dtype=np.float32)),
        y_train=torch.from_numpy(np.ascontiguousarray(y_tr)),
        x_test=torch.from_numpy(np.ascontiguousarray(x_te, dtype=np.float32)),
        y_test=torch.from_numpy(np.ascontiguousarray(y_te)),
    )


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> DatasetSplit:
    """Load digits and split it, stratified by label, deterministically in ``seed``.

    Pixels (0..16) are divided by 16 so every feature lies in [0, 1].
    """
    return load_split("digits", seed, test_fraction)


@dataclass(frozen=True)
class PartitionSpec:
    """How training examples are dealt to peers.

    ``alpha`` is the Dirichlet concentration (smaller = more skewed) and is set only for
    ``kind == "dirichlet"``.
    """

    kind: PartitionKind
    alpha: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("iid", "by-label", "dirichlet"):
            raise ValueError(
                f"unknown partition kind {self.kind!r}; accepted: {', '.join(PARTITION_FORMS)}"
            )
        if self.kind == "dirichlet":
            if self.alpha is None or not math.isfinite(self.alpha) or self.alpha <= 0:
                raise ValueError(f"dirichlet alpha must be a finite number > 0, got {self.alpha!r}")
        elif self.alpha is not None:
            raise ValueError(f"partition {self.kind!r} takes no alpha, got {self.alpha!r}")

    def __str__(self) -> str:
        return f"dirichlet:{self.alpha:g}" if self.kind == "dirichlet" else self.kind


def parse_partition(spec: str) -> PartitionSpec:
    """Parse ``"iid"``, ``"by-label"`` or ``"dirichlet:ALPHA"`` (ALPHA > 0)."""
    accepted = ", ".join(PARTITION_FORMS)
    text = spec.strip()
    if text == "iid":
        return PartitionSpec(kind="iid")
    if text == "by-label":
        return PartitionSpec(kind="by-label")
    if text.startswith("dirichlet:"):
        raw = text[len("dirichlet:") :]
        try:
            alpha = float(raw)
        except ValueError:
            alpha = math.nan
        if math.isfinite(alpha) and alpha > 0:
            return PartitionSpec(kind="dirichlet", alpha=alpha)
        raise ValueError(
            f"bad partition {spec!r}: ALPHA must be a finite number > 0; accepted: {accepted}"
        )
    raise ValueError(f"bad partition {spec!r}; accepted: {accepted}")


def partition_indices(
    labels: np.ndarray, n_parts: int, spec: PartitionSpec, seed: int
) -> list[np.ndarray]:
    """Deal the indices ``0..len(labels)-1`` to ``n_parts`` peers.

    - iid: a seeded shuffle cut into equal (+-1) parts.
    - by-label: indices sorted by label (ties shuffled by the seed) cut into equal contiguous
      chunks, so each peer sees one to three classes.
    - dirichlet: for each class, peer shares drawn from Dir(alpha); a peer left empty takes one
      example from the largest part so every part is non-empty.

    Parts are disjoint, cover every index, are sorted int64 arrays, and depend only on
    ``(labels, n_parts, spec, seed)``. iid reads only how many examples there are, so it also
    deals text windows (whose targets are a row each); the others need one label an example.
    """
    labels = np.asarray(labels)
    if labels.ndim < 1 or (spec.kind != "iid" and labels.ndim != 1):
        raise ValueError(
            f"partition {spec} needs one label per example (1-D labels), got shape "
            f"{labels.shape}; text windows have a row of targets each: expected partition iid"
        )
    n = int(labels.shape[0])
    if n_parts < 1:
        raise ValueError(f"n_parts must be >= 1, got {n_parts}")
    if n_parts > n:
        raise ValueError(f"cannot split {n} examples into {n_parts} non-empty parts")
    rng = np.random.default_rng(seed)

    if spec.kind == "iid":
        parts = np.array_split(rng.permutation(n), n_parts)
    elif spec.kind == "by-label":
        # Shuffle first, then a stable sort by label: ties are broken by the seed.
        shuffled = rng.permutation(n)
        order = shuffled[np.argsort(labels[shuffled], kind="stable")]
        parts = np.array_split(order, n_parts)
    elif spec.kind == "dirichlet":
        assert spec.alpha is not None  # guaranteed by PartitionSpec
        parts = _dirichlet_parts(labels, n_parts, spec.alpha, rng)
    else:  # pragma: no cover - PartitionSpec validates kind
        raise ValueError(f"unknown partition kind {spec.kind!r}")
    return [np.sort(p).astype(np.int64) for p in parts]


def _dirichlet_parts(
    labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per class, split its shuffled indices by Dir(alpha) proportions; then fill empty parts."""
    buckets: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        shares = rng.dirichlet(np.full(n_parts, alpha))
        cuts = np.round(np.cumsum(shares)[:-1] * idx.size).astype(np.int64)
        for part, chunk in enumerate(np.split(idx, cuts)):
            buckets[part].append(chunk)
    parts = [np.concatenate(b) if b else np.empty(0, np.int64) for b in buckets]
    # Guarantee non-empty parts: move one example from the currently largest part.
    for part in range(n_parts):
        if parts[part].size == 0:
            donor = int(np.argmax([p.size for p in parts]))
            parts[part] = parts[donor][-1:]
            parts[donor] = parts[donor][:-1]
    return parts
