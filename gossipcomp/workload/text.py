"""A text corpus every machine has: the Python standard library's own source files, read from
the running interpreter, cut into windows for a character-level language model.

Files: the `*.py` files directly in ``sysconfig.get_paths()["stdlib"]``, sorted by name; the
first `per_file` bytes of each are read (every file a little, so that no single module fills
the corpus), through the project's bounded file reader. Bytes map to a fixed vocabulary: the 100
printable ASCII characters, then one id for every other byte. The split is by file: a seeded
permutation of the files puts the first `test_fraction` of them in validation, so no window of
validation text was ever seen in training. Each file is cut into windows of `context + 1`
characters at a stride of `context` (windows never cross files); a window's first `context`
characters are the input, its last `context` the next-character targets. Validation keeps at
most `max_test_windows` of its windows, evenly spaced, so that evaluating (every peer, every
`eval_every` steps) costs a bounded forward pass.

Deterministic in (interpreter, seed, sizes): peers on one machine, or on machines with the same
Python version, agree on the data without talking. Another Python version has other files.
"""

from __future__ import annotations

import math
import string
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gossipcomp.inputs.files import FileRefused, open_regular_file

#: The characters with their own id, in id order; every other byte is UNKNOWN.
CHARACTERS = string.printable.encode("ascii")
UNKNOWN = len(CHARACTERS)  # the id of every byte not in CHARACTERS
VOCABULARY_SIZE = UNKNOWN + 1
DEFAULT_CONTEXT = 64  # characters a window holds as input
DEFAULT_PER_FILE = 3 * 2**10  # bytes read from the start of each source file
MAX_SOURCE_FILE_BYTES = 16 * 2**20  # a standard library file is at most a few hundred kB
MAX_CONTEXT = 4096
DEFAULT_MAX_TEST_WINDOWS = 512  # validation windows kept (32768 predictions at context 64)

_TABLE = np.full(256, UNKNOWN, dtype=np.int64)
_TABLE[np.frombuffer(CHARACTERS, dtype=np.uint8)] = np.arange(len(CHARACTERS))


def encode(data: bytes) -> np.ndarray:
    """The ids of `data`'s bytes (int64), UNKNOWN for a byte outside CHARACTERS."""
    return _TABLE[np.frombuffer(data, dtype=np.uint8)]


def decode(ids: torch.Tensor | np.ndarray) -> str:
    """The text of `ids`, with "\ufffd" for UNKNOWN (for looking at samples)."""
    return "".join(
        chr(CHARACTERS[i]) if 0 <= i < UNKNOWN else "\ufffd" for i in np.asarray(ids).tolist()
    )


def stdlib_sources(folder: Path | None = None) -> list[Path]:
    """The `*.py` files directly in the interpreter's standard library folder, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"]) if folder is None else folder
    found = sorted(p for p in root.glob("*.py") if p.is_file())
    if not found:
        raise FileNotFoundError(
            f"no Python source files in {root}; expected the standard library of the running "
            "interpreter (sysconfig's 'stdlib' path) to hold its *.py files"
        )
    return found


def read_source_start(path: Path, per_file: int) -> bytes:
    """The first `per_file` bytes of `path`, a regular file of at most MAX_SOURCE_FILE_BYTES
    (anything else is refused by the shared reader, naming the file)."""
    expected = f"a Python source file of at most {MAX_SOURCE_FILE_BYTES} bytes"
    with open_regular_file(path, "python source", expected) as (file, size):
        if size > MAX_SOURCE_FILE_BYTES:
            problem = f"{size} bytes, over the limit of {MAX_SOURCE_FILE_BYTES}"
            raise FileRefused("python source", path, problem, expected)
        return file.read(min(size, per_file))


@dataclass(frozen=True)
class TextWindows:
    """Windows of a corpus: inputs [N, context] and next-character targets [N, context] (int64
    ids), and the index of the source file each window comes from."""

    inputs: torch.Tensor
    targets: torch.Tensor
    files: torch.Tensor


def windows(texts: list[np.ndarray], file_ids: list[int], context: int) -> TextWindows:
    """Cut each encoded text into windows of context + 1 ids at a stride of `context`."""
    rows, owners = [], []
    for ids, owner in zip(texts, file_ids, strict=True):
        count = (ids.size - 1) // context
        if count < 1:
            continue
        starts = np.arange(count) * context
        rows.append(ids[starts[:, None] + np.arange(context + 1)])
        owners.append(np.full(count, owner, dtype=np.int64))
    if not rows:
        raise ValueError(f"no text holds a window of {context + 1} characters")
    table = torch.from_numpy(np.concatenate(rows))
    return TextWindows(
        table[:, :-1].contiguous(),
        table[:, 1:].contiguous(),
        torch.from_numpy(np.concatenate(owners)),
    )


def python_source_windows(
    seed: int,
    test_fraction: float,
    context: int = DEFAULT_CONTEXT,
    per_file: int = DEFAULT_PER_FILE,
    folder: Path | None = None,
    max_test_windows: int = DEFAULT_MAX_TEST_WINDOWS,
) -> tuple[TextWindows, TextWindows]:
    """Training and validation windows of the standard library's sources (module docstring),
    split by file with a permutation seeded by `seed`."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= MAX_CONTEXT:
        raise ValueError(f"context must be an integer in [1, {MAX_CONTEXT}], got {context!r}")
    if not isinstance(per_file, int) or not context < per_file <= MAX_SOURCE_FILE_BYTES:
        raise ValueError(
            f"per_file must be an integer in ({context}, {MAX_SOURCE_FILE_BYTES}], got {per_file!r}"
        )
    paths = stdlib_sources(folder)
    if len(paths) < 2:
        raise ValueError(f"{len(paths)} source file: expected at least 2 to split by file")
    texts = [encode(read_source_start(p, per_file)) for p in paths]
    order = np.random.default_rng(seed).permutation(len(paths))
    held_out = min(len(paths) - 1, max(1, math.ceil(test_fraction * len(paths))))
    test_files, train_files = sorted(order[:held_out]), sorted(order[held_out:])
    train = windows([texts[i] for i in train_files], [int(i) for i in train_files], context)
    test = windows([texts[i] for i in test_files], [int(i) for i in test_files], context)
    if max_test_windows < 1:
        raise ValueError(f"max_test_windows must be >= 1, got {max_test_windows!r}")
    if test.inputs.shape[0] > max_test_windows:
        keep = torch.from_numpy(
            np.linspace(0, test.inputs.shape[0] - 1, max_test_windows).round().astype(np.int64)
        )
        test = TextWindows(test.inputs[keep], test.targets[keep], test.files[keep])
    return train, test
