"""The one way gossipcomp reads a file an operator points it at: topologies, allowlists, keys,
certificates, checkpoints, reports.

Such a file may come from anywhere, so every read is bounded the same way: the path is opened
without blocking (a FIFO would otherwise wait forever for a writer) and the opened descriptor is
checked, so only a regular file is read (a FIFO, device, directory or socket is refused, also
behind a symbolic link, and a file swapped after a check is never the one read); its size is
checked against a limit before a byte is read; text must be UTF-8; JSON may nest at most
MAX_JSON_DEPTH levels, checked here before the parser (which recurses) sees it. YAML is parsed by
gossipcomp.inputs.yaml_files on top of this module. Every error names what the file is for, its path,
the problem and what was expected, and quotes at most a few dozen characters of its content.

This module imports nothing from gossipcomp but the quoting helper, so every layer may use it;
tests/test_file_readers.py checks that no other module opens a file for reading by itself.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import numpy as np

from gossipcomp.inputs.text import quoted

MAX_KEY_BYTES = 64 * 2**10  # a PEM private key is a few hundred bytes
MAX_JSON_DEPTH = 64  # nesting levels of a JSON file; a report needs 4
_DEPTH_CHUNK = 2**22  # bytes counted at a time: bounded memory for the running sum
_STEPS = np.zeros(256, dtype=np.int8)  # a byte's change of depth outside strings
_STEPS[[ord("["), ord("{")]], _STEPS[[ord("]"), ord("}")]] = 1, -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


class FileRefused(ValueError):
    """A file gossipcomp will not read: "{what} {path}: {problem}; expected {expected}".

    `problem` alone (without the path) is kept for callers that word their own errors."""

    def __init__(self, what: str, path: str | os.PathLike[str], problem: str, expected: str):
        super().__init__(f"{what} {os.fspath(path)}: {problem}; expected {expected}")
        self.path = os.fspath(path)
        self.problem = problem


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "a special file")


@contextmanager
def open_regular_file(
    path: str | os.PathLike[str],
    what: str,
    expected: str,
    *,
    follow_links: bool = True,
    private: bool = False,
) -> Iterator[tuple[BinaryIO, int]]:
    """`path` opened for reading, with its size, only if it is a regular file.

    Opened without blocking and checked through its descriptor (module docstring). Without
    `follow_links`, a symbolic link itself is refused; with `private`, a file that group or
    others may access is refused (a private key). Raises FileNotFoundError or FileRefused.
    """
    flags = _OPEN_FLAGS | (0 if follow_links else os.O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what} {os.fspath(path)}: no such file; expected {expected}"
        ) from None
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_links:
            problem = "is a symbolic link, not a regular file (links are not followed)"
        elif error.errno == errno.ENXIO:  # a socket, or a device with no driver
            problem = "is a socket or an unconnected device, not a regular file"
        else:
            problem = f"cannot be opened ({error.strerror})"
        raise FileRefused(what, path, problem, expected) from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            problem = f"is {_kind(info.st_mode)}, not a regular file"
            raise FileRefused(what, path, problem, expected)
        mode = stat.S_IMODE(info.st_mode)
        if private and mode & 0o077:
            raise FileRefused(
                what,
                path,
                f"mode {mode:04o} lets group or others access this private key",
                f"a file only its owner can read: run `chmod 600 {os.fspath(path)}`",
            )
        with os.fdopen(os.dup(descriptor), "rb") as file:
            yield file, info.st_size
    finally:
        os.close(descriptor)


def read_regular_file(
    path: str | os.PathLike[str],
    what: str,
    expected: str,
    max_bytes: int,
    *,
    private: bool = False,
    follow_links: bool = True,
) -> bytes:
    """The bytes of `path`: a regular file (see open_regular_file) of at most `max_bytes`, the
    size checked before anything is read. Raises FileNotFoundError or FileRefused."""
    with open_regular_file(path, what, expected, follow_links=follow_links, private=private) as (
        file,
        size,
    ):
        if size > max_bytes:
            problem = f"{size} bytes, over the limit of {max_bytes}"
            raise FileRefused(what, path, problem, expected)
        data = file.read(size + 1)  # one byte more: did it grow since fstat?
    if len(data) > size:
        raise FileRefused(what, path, "grew while it was read", "a file that stays put")
    return data


def _utf8(data: bytes, what: str, path: str | os.PathLike[str], expected: str) -> str:
    """`data` decoded as UTF-8; FileRefused naming the file and the first bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 ({error.reason} at byte {error.start})"
        raise FileRefused(what, path, problem, expected) from None


def read_text_file(path: str | os.PathLike[str], what: str, expected: str, max_bytes: int) -> str:
    """The UTF-8 text of `path` (see read_regular_file); FileRefused when it is not UTF-8."""
    return _utf8(read_regular_file(path, what, expected, max_bytes), what, path, expected)


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of JSON text `data` nest, found without recursing.

    A bracket counts only outside strings: a quote not escaped (preceded by an even run of
    backslashes) opens or closes a string. Counted with numpy in fixed chunks, so a report of
    tens of MB takes well under a second and bounded memory. Text that is not JSON gets some
    number; the parser then refuses it."""
    codes = np.frombuffer(data, dtype=np.uint8)
    deepest = depth = 0
    quotes = 0  # unescaped quotes so far: odd while inside a string
    backslashes = 0  # the run of backslashes that ends the previous chunk
    for start in range(0, len(codes), _DEPTH_CHUNK):
        chunk = codes[start : start + _DEPTH_CHUNK]
        quote_at = np.flatnonzero(chunk == _QUOTE)
        escaped, backslashes = _escaped(chunk, quote_at, backslashes)
        real = quote_at[~escaped]
        steps = _STEPS[chunk]
        if len(real):  # blank what lies between an opening quote and its closing one
            toggles = np.zeros(len(chunk), dtype=np.int8)
            toggles[real] = 1
            inside = np.bitwise_xor.accumulate(toggles) ^ (quotes & 1)
            steps[inside.view(bool)] = 0
        elif quotes % 2:
            steps[:] = 0
        running = np.cumsum(steps, dtype=np.int32)
        deepest = max(deepest, depth + int(running.max()))
        depth, quotes = depth + int(running[-1]), quotes + len(real)
    return deepest


def _escaped(chunk: np.ndarray, quote_at: np.ndarray, carried: int) -> tuple[np.ndarray, int]:
    """Which quotes at `quote_at` follow an odd run of backslashes (`carried` of them end the
    previous chunk), and the run that ends this chunk."""
    escaped = np.zeros(len(quote_at), dtype=bool)
    escaped[quote_at == 0] = carried % 2 == 1
    slashes = np.flatnonzero(chunk == _BACKSLASH)
    if not len(slashes):
        return escaped, 0
    firsts = np.zeros(len(slashes), dtype=np.int64)  # index in slashes where each run starts
    breaks = np.flatnonzero(np.diff(slashes) != 1) + 1
    firsts[breaks] = breaks
    firsts = np.maximum.accumulate(firsts)

    def run(index: np.ndarray) -> np.ndarray:  # length of the run that ends at slashes[index]
        first = firsts[index]
        return index - first + 1 + np.where(slashes[first] == 0, carried, 0)

    index = np.minimum(np.searchsorted(slashes, quote_at - 1), len(slashes) - 1)
    after_slash = slashes[index] == quote_at - 1
    escaped[after_slash] = run(index[after_slash]) % 2 == 1
    ends_with_slash = slashes[-1] == len(chunk) - 1
    return escaped, int(run(np.array([len(slashes) - 1]))[0]) if ends_with_slash else 0


def load_json_file(
    path: str | os.PathLike[str],
    what: str,
    expected: str,
    max_bytes: int,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Read (see read_regular_file) and parse one UTF-8 JSON file nested at most `max_depth`
    levels; FileNotFoundError or FileRefused naming the file."""
    data = read_regular_file(path, what, expected, max_bytes)
    depth = json_depth(data)
    if depth > max_depth:
        problem = f"JSON nested {depth} levels deep, more than {max_depth}"
        raise FileRefused(what, path, problem, expected)
    text = _utf8(data, what, path, expected)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        problem = f"not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        raise FileRefused(what, path, problem, expected) from None
    except (ValueError, RecursionError) as error:  # e.g. an integer of more than 4300 digits
        problem = f"not valid JSON: {quoted(str(error))}"
        raise FileRefused(what, path, problem, expected) from None
