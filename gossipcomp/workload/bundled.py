"""scikit-learn's bundled tables (digits, wine, breast cancer, iris), read from the files it
ships without importing scikit-learn.

Why: `import sklearn.datasets` and `sklearn.model_selection` pull in scipy.stats and cost
0.6-0.8 s of CPU in every process that loads data (each simulate run, peer, worker process),
while the tables themselves are a few hundred kilobytes of CSV read in milliseconds
(docs/benchmarks.md, "A run's own start-up"). The files are scikit-learn's: `digits.csv.gz` (no header,
the label last), and for the others a first line `n_samples,n_features,class names...`, then
rows with the label last. Where a file is not where this scikit-learn keeps it (another
layout), scikit-learn's own loader reads the same table. A file is checked like any input:
its declared counts, finite features, whole labels in range.
"""

from __future__ import annotations

import importlib.util
import math
import zlib
from pathlib import Path

import numpy as np

from gossipcomp.inputs.files import read_regular_file

#: the loader's name in sklearn.datasets -> (its file in sklearn/datasets/data, has a header)
BUNDLED_FILES: dict[str, tuple[str, bool]] = {
    "load_digits": ("digits.csv.gz", False),
    "load_wine": ("wine_data.csv", True),
    "load_breast_cancer": ("breast_cancer.csv", True),
    "load_iris": ("iris.csv", True),
}
# the largest bundled table, digits, is 0.26 MB unpacked; a table of the most bytes, all short
# fields, parses in about 30 MB (its fields as strings on the way to one float64 array)
MAX_TABLE_BYTES = 1 << 20
MAX_CLASSES = 1000


def data_directory() -> Path | None:
    """Where scikit-learn keeps its bundled tables (found without importing it), or None."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"


def load_table(loader: str, directory: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 features [n, f] and int64 labels [n] of the bundled table `loader` (a name of
    BUNDLED_FILES), read from `directory` (scikit-learn's, by default); scikit-learn's loader
    when the file is not there. Raises ValueError for a file that is not a valid table."""
    if loader not in BUNDLED_FILES:
        raise ValueError(f"bundled table {loader!r}: expected one of {sorted(BUNDLED_FILES)}")
    name, has_header = BUNDLED_FILES[loader]
    folder = directory if directory is not None else data_directory()
    if folder is None:
        return _through_sklearn(loader)
    try:
        return read_table(folder / name, has_header)
    except FileNotFoundError:  # anything else there is read, and refused if it is no table
        return _through_sklearn(loader)


def read_table(path: Path, has_header: bool) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of the table file `path` (parse_table says how it is checked)."""
    return parse_table(_read_text(path), has_header, str(path))


def _through_sklearn(loader: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    bunch = getattr(datasets, loader)()
    return np.asarray(bunch.data, dtype=np.float32), np.asarray(bunch.target, dtype=np.int64)


def _read_text(path: Path) -> str:
    """The table's text: the file read through the shared reader, a gzip one unpacked to at
    most MAX_TABLE_BYTES (a small file that unpacks to gigabytes is refused, not unpacked)."""
    what = "bundled table"
    data = read_regular_file(path, what, "a CSV table shipped with scikit-learn", MAX_TABLE_BYTES)
    if path.suffix == ".gz":
        unpacker = zlib.decompressobj(wbits=31)  # gzip framing
        try:
            data = unpacker.decompress(data, MAX_TABLE_BYTES + 1)
        except zlib.error:
            raise ValueError(f"{path}: not a gzip file, expected a packed CSV table") from None
        if len(data) <= MAX_TABLE_BYTES and not unpacker.eof:  # cut short: rows would be lost
            raise ValueError(f"{path}: the gzip stream ends early, expected a whole packed table")
    if len(data) > MAX_TABLE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_TABLE_BYTES} bytes, expected a small table")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: expected ASCII text, a CSV table") from None


def parse_table(text: str, has_header: bool, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels of a CSV table whose last column is the label; with `has_header`,
    a first line `n_samples,n_features,...` that the rows must match."""
    lines = text.splitlines()
    declared: tuple[int, int] | None = None
    if has_header:
        if not lines:
            raise ValueError(f"{source}: empty, expected a header line")
        declared = _header_counts(lines[0], source)
        lines = lines[1:]
    rows = [line.split(",") for line in lines if line.strip()]
    if len({len(row) for row in rows}) > 1:
        raise ValueError(f"{source}: expected rows of comma-separated numbers, all as long")
    try:
        table = np.asarray(rows, dtype=np.float64).reshape(len(rows), -1)
    except ValueError:
        raise ValueError(f"{source}: expected rows of comma-separated numbers") from None
    if table.shape[0] < 2 or table.shape[1] < 2:
        raise ValueError(f"{source}: expected at least 2 rows of features and a label")
    features, labels = table[:, :-1], table[:, -1]
    if declared is not None and declared != features.shape:
        raise ValueError(
            f"{source}: header declares {declared[0]} rows of {declared[1]} features, "
            f"got {features.shape[0]} of {features.shape[1]}"
        )
    if not np.isfinite(features).all():
        raise ValueError(f"{source}: features: expected finite numbers, got NaN/Inf")
    if not (np.isfinite(labels).all() and (labels == np.round(labels)).all()):
        raise ValueError(f"{source}: labels: expected whole numbers")
    if labels.min() < 0 or labels.max() >= MAX_CLASSES:
        raise ValueError(f"{source}: labels: expected in [0, {MAX_CLASSES})")
    return features.astype(np.float32), labels.astype(np.int64)


def _header_counts(line: str, source: str) -> tuple[int, int]:
    fields = line.split(",")
    try:
        rows, columns = int(fields[0]), int(fields[1])
    except (ValueError, IndexError):
        raise ValueError(
            f"{source}: first line: expected 'n_samples,n_features,...' (two whole numbers)"
        ) from None
    if rows < 1 or columns < 1:
        raise ValueError(f"{source}: first line: expected positive counts")
    return rows, columns


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Train and test row indices, each class split in the same proportion (`test_fraction`
    of the rows, rounded up, go to test: see _test_rows_per_class), both shuffled;
    deterministic in `seed`."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    take = _test_rows_per_class(counts, math.ceil(len(labels) * test_fraction))
    train, test = [], []
    for label, count in zip(classes, take, strict=True):
        rows = rng.permutation(np.flatnonzero(labels == label))
        test.append(rows[:count])
        train.append(rows[count:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _test_rows_per_class(counts: np.ndarray, n_test: int) -> np.ndarray:
    """How many of each class's rows go to test: its share of `n_test`, rounded down, kept to
    at least one row on each side for a class of two or more, then the rows still owed (or
    over) added to the classes with the largest remainders (taken from the smallest)."""
    shares = counts * (n_test / counts.sum())
    low = np.where(counts >= 2, 1, 0)
    high = np.where(counts >= 2, counts - 1, counts)
    take = np.clip(np.floor(shares).astype(np.int64), low, high)
    by_remainder = np.argsort(-(shares - np.floor(shares)), kind="stable")
    owed = n_test - int(take.sum())
    while owed:
        before = owed
        for i in by_remainder if owed > 0 else by_remainder[::-1]:
            if owed > 0 and take[i] < high[i]:
                take[i], owed = take[i] + 1, owed - 1
            elif owed < 0 and take[i] > low[i]:
                take[i], owed = take[i] - 1, owed + 1
        if owed == before:  # no class has room: every row already where it must be
            break
    return take
