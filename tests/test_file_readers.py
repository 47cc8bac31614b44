"""Every file reader of gossipcomp, fed every hostile file (issue 23, finding 6 and "one way to
read a file"): a FIFO (waits forever for a writer), /dev/zero (never ends), a directory, a link
to a device, a sparse file of 4 GiB, JSON and YAML nested 10,000 deep, bytes that are not UTF-8,
and a well-formed file of the wrong top-level type. Each must be refused quickly and in bounded
memory, with a short error naming the file. `gossipcomp plot` hung on the FIFO, read /dev/zero
until 3.3 GB and reported the nested JSON as an internal error (RecursionError).

READERS lists every reader; a new one is covered the day it is added, because two tests walk the
source: every function that calls the shared reader (gossipcomp.inputs.files, gossipcomp.inputs.yaml_files)
must be in READERS, and no module but gossipcomp/inputs/files.py may open a file for reading itself.
"""

from __future__ import annotations

import ast
import contextlib
import os
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gossipcomp.cli import resolve_topology
from gossipcomp.experiment import plot
from gossipcomp.inputs import files, yaml_files
from gossipcomp.inputs.text import QUOTE_LIMIT
from gossipcomp.security import TlsFiles, new_ca, new_peer_certificate
from gossipcomp.security.signing_keys import load_signing_key, read_allowlist
from gossipcomp.topology import load_topology
from gossipcomp.workload.bundled import read_table
from gossipcomp.workload.checkpoint import CheckpointStore
from gossipcomp.workload.text import read_source_start

PACKAGE = Path(__file__).resolve().parent.parent / "gossipcomp"
SECONDS = 10.0  # a refusal is immediate; the bound leaves room for a machine under load
PEAK_BYTES = 64 * 2**20  # nothing hostile is read into memory
SHORT = 500  # characters: an error never echoes the file
DEEP = 10_000  # levels of nesting: 20 kB of brackets


@dataclass(frozen=True)
class Reader:
    """One way gossipcomp reads a file: `read(path, folder)` reads `path` the way the reader
    does (`folder`: a scratch directory holding valid companion files, see `companions`).
    `covers`: the functions of gossipcomp (module.qualname) this entry exercises."""

    read: Callable[[Path, Path], Any]
    covers: tuple[str, ...]
    # hostile contents it leaves to its callers (a generic reader): it must read them cleanly
    passes: tuple[str, ...] = ()


def _tls(slot: str) -> Callable[[Path, Path], Any]:
    def read(path: Path, folder: Path) -> Any:
        valid = {
            "cert": folder / "peer.pem",
            "key": folder / "peer-key.pem",
            "ca": folder / "ca.pem",
        }
        return TlsFiles(**{**valid, slot: path}).load()

    return read


def _ca(slot: str) -> Callable[[Path, Path], Any]:
    def read(path: Path, folder: Path) -> Any:
        valid = {"ca_cert": folder / "ca.pem", "ca_key": folder / "ca-key.pem"}
        out = folder / "issued"
        out.mkdir(exist_ok=True)
        return new_peer_certificate(out, "x", ["127.0.0.1:1"], **{**valid, slot: path})

    return read


READERS: dict[str, Reader] = {
    "topology": Reader(lambda p, _: load_topology(p), ("topology.files.load_topology",)),
    "topology by flag": Reader(
        lambda p, _: resolve_topology(str(p)), ("cli.common.resolve_topology",)
    ),
    "allowlist": Reader(lambda p, _: read_allowlist(p), ("security.signing_keys.read_allowlist",)),
    "signing key": Reader(
        lambda p, _: load_signing_key(p), ("security.signing_keys.load_signing_key",)
    ),
    "tls cert": Reader(_tls("cert"), ("security.tls.TlsFiles.load", "security.tls._read")),
    "tls key": Reader(_tls("key"), ("security.tls.TlsFiles.load", "security.tls._read")),
    "tls ca": Reader(_tls("ca"), ("security.tls.TlsFiles.load", "security.tls._read")),
    "ca cert": Reader(_ca("ca_cert"), ("security.certificates._load_ca",)),
    "ca key": Reader(_ca("ca_key"), ("security.certificates._load_ca",)),
    "checkpoint": Reader(
        lambda p, f: CheckpointStore(f, 0).read(p), ("workload.checkpoint.CheckpointStore.read",)
    ),
    "checkpoint bounded": Reader(
        lambda p, f: CheckpointStore(f, 0).read(p, max_payload=2**20),
        ("workload.checkpoint.CheckpointStore.read",),
    ),
    "report (plot)": Reader(
        lambda p, _: plot.load_curves([p]),
        ("experiment.plot.load_curves", "experiment.plot.load_curve"),
    ),
    "json": Reader(
        lambda p, _: files.load_json_file(p, "json", "a JSON file", 2**30),
        ("inputs.files.load_json_file",),
        ("wrong top level",),
    ),
    "yaml": Reader(
        lambda p, _: yaml_files.load_yaml_file(p, "yaml", "a YAML file"),
        ("inputs.yaml_files.load_yaml_file",),
        ("wrong top level",),
    ),
    "python source (pysource)": Reader(
        lambda p, _: read_source_start(p, 2**30),
        ("workload.text.read_source_start",),
        ("deep json", "deep yaml", "not utf-8", "wrong top level"),
    ),
    "bundled table": Reader(
        lambda p, _: read_table(p, has_header=True),
        ("workload.bundled.read_table", "workload.bundled._read_text"),
    ),
    "text": Reader(
        lambda p, _: files.read_text_file(p, "text", "a text file", 2**30),
        ("inputs.files.read_text_file",),
        ("deep json", "deep yaml", "wrong top level"),
    ),
}

# the shared reader's own functions, and what calls them to read (every other caller is a reader)
SHARED = {"read_regular_file", "read_text_file", "open_regular_file", "load_json_file"}
SHARED |= {"load_yaml_file"}


@contextlib.contextmanager
def _fifo(path: Path) -> Iterator[Path]:
    os.mkfifo(path)
    try:
        yield path
    finally:  # a reader blocked in open() would be let go here (no writer: it gets EOF)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _hostile(kind: str, folder: Path, stack: contextlib.ExitStack) -> Path:
    """A hostile file of `kind` in `folder` (or /dev/zero itself)."""
    path = folder / f"hostile-{kind}"
    if kind == "fifo":
        return stack.enter_context(_fifo(path))
    if kind == "device":
        return Path("/dev/zero")
    if kind == "directory":
        path.mkdir()
    elif kind == "link to device":
        path.symlink_to("/dev/zero")
    elif kind == "4 GiB":
        with path.open("wb") as file:
            file.truncate(4 * 2**30)  # sparse: costs no disk
    elif kind == "deep json":
        path.write_text("[" * DEEP + "]" * DEEP)
    elif kind == "deep yaml":
        path.write_text("kind: ring\nn: " + "{a: " * DEEP + "1" + "}" * DEEP + "\n")
    elif kind == "not utf-8":
        path.write_bytes(b"kind: ring\nn: 4\nname: \xff\xfe\xc3\x28\n")
    elif kind == "wrong top level":
        path.write_text("[1, 2]\n")  # JSON and YAML: a list where a mapping/object belongs
    if kind not in ("directory", "link to device"):
        path.chmod(0o600)  # a private-key reader refuses a file others may read before all else
    return path


KINDS = [
    "fifo",
    "device",
    "directory",
    "link to device",
    "4 GiB",
    "deep json",
    "deep yaml",
    "not utf-8",
    "wrong top level",
]


@pytest.fixture(scope="module")
def companions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Valid files the readers of several files need beside the hostile one: a CA, a peer's
    certificate and key."""
    folder = tmp_path_factory.mktemp("valid")
    new_ca(folder)
    new_peer_certificate(folder, "peer", ["127.0.0.1:1"], folder / "ca.pem", folder / "ca-key.pem")
    return folder


def _refusal(call: Callable[[], Any]) -> tuple[BaseException | None, float, int]:
    """Run `call` in a thread (so that a reader blocked on a FIFO fails the test instead of
    hanging it): what it raised, the seconds it took, the peak of traced memory."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - judged by the test
            outcome.append(error)

    tracemalloc.start()
    start = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SECONDS)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert outcome, f"still reading after {SECONDS} s (blocked or unbounded)"
    return outcome[0], seconds, peak


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_every_hostile_file(
    reader: str, kind: str, tmp_path: Path, companions: Path
) -> None:
    with contextlib.ExitStack() as stack:
        path = _hostile(kind, tmp_path, stack)
        error, seconds, peak = _refusal(lambda: READERS[reader].read(path, companions))
    assert seconds < SECONDS and peak < PEAK_BYTES, (seconds, peak)
    if kind in READERS[reader].passes:
        assert error is None, f"{reader} refused a file its callers judge: {error}"
        return
    assert error is not None, f"{reader} accepted {kind}"
    assert isinstance(error, ValueError | OSError), f"{reader}: {type(error).__name__}: {error}"
    message = str(error)
    assert str(path) in message, message
    assert len(message) < SHORT, message
    assert "[" * QUOTE_LIMIT not in message and "{a: " * (QUOTE_LIMIT // 4) not in message


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "link to device"])
def test_the_shared_reader_names_what_the_file_is(kind: str, tmp_path: Path) -> None:
    expected = {
        "fifo": "is a FIFO (named pipe), not a regular file",
        "device": "is a character device, not a regular file",
        "directory": "is a directory, not a regular file",
        "link to device": "is a character device, not a regular file",
    }
    with contextlib.ExitStack() as stack:
        path = _hostile(kind, tmp_path, stack)
        with pytest.raises(files.FileRefused) as info:
            files.read_regular_file(path, "thing", "a thing file", 100)
    assert str(info.value) == f"thing {path}: {expected[kind]}; expected a thing file"


def test_links_are_refused_where_they_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert files.read_regular_file(link, "thing", "x", 100) == b"{}"
    with pytest.raises(files.FileRefused, match="is a symbolic link, not a regular file"):
        files.read_regular_file(link, "thing", "x", 100, follow_links=False)


def test_json_nesting_is_counted_outside_strings_only(tmp_path: Path) -> None:
    """Brackets inside strings (escaped quotes too) do not count; 10 kB of nesting is refused
    before the parser recurses, and the limit is exact."""
    assert files.json_depth(b'{"a": ["[[[", "\\"[[", {"b": "\\\\"}]}') == 3
    path = tmp_path / "x.json"
    path.write_text("[" * 8 + "]" * 8)
    assert files.load_json_file(path, "json", "x", 100, max_depth=8) == [[[[[[[[]]]]]]]]
    with pytest.raises(files.FileRefused, match="JSON nested 9 levels deep, more than 8"):
        path.write_text("[" * 9 + "]" * 9)
        files.load_json_file(path, "json", "x", 100, max_depth=8)


def _qualname(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    names = []
    while node in parents:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        node = parents[node]
    return ".".join(reversed(names))


def _calls(path: Path) -> Iterator[tuple[str, ast.Call, str]]:
    """(module, call, enclosing qualname) for every call in a module of the package."""
    module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield module, node, _qualname(node, parents)


def _sources() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "proto" not in p.parts]


def _called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def test_every_caller_of_the_shared_reader_is_fed_the_hostile_files() -> None:
    covered = {name for reader in READERS.values() for name in reader.covers}
    callers = set()
    for path in _sources():
        for module, call, where in _calls(path):
            if _called(call) in SHARED and module not in ("inputs.files", "inputs.yaml_files"):
                callers.add(f"{module}.{where}")
    missing = sorted(callers - covered)
    assert not missing, f"readers not in READERS (add them, with how to call them): {missing}"


# calls that open or load a file without the shared reader, each for a reason other than reading
# a file someone points gossipcomp at: (module, enclosing function, call) -> why
NOT_READS = {
    ("inputs.atomic_files", "fsync_directory", "open"): "opens a folder to fsync a rename",
    ("inputs.atomic_files", "write_atomically", "fdopen"): "writes a temporary file it made",
    (
        "workload.checkpoint",
        "CheckpointStore.read",
        "load",
    ): "torch.load of bytes already read and checked",
    ("security.signing_keys", "write_signing_key", "open"): "creates a key file (O_CREAT|O_EXCL)",
    ("security.signing_keys", "write_signing_key", "fdopen"): "writes the key file it created",
    ("security.certificates", "_write", "fdopen"): "writes a certificate or key it created",
}
RAW_READS = {"open", "fdopen", "read_text", "read_bytes", "load", "safe_load", "fromfile"}
RAW_READS |= {"loadtxt", "open_text", "open_binary"}


def test_no_module_opens_a_file_for_reading_but_the_shared_reader() -> None:
    """A raw open()/read_text()/json.load()/torch.load() outside gossipcomp/inputs/files.py is a reader
    that skips the checks; only the calls listed in NOT_READS (writes, fsyncs) may stay."""
    found = {}
    for path in _sources():
        for module, call, where in _calls(path):
            name = _called(call)
            if module == "inputs.files" or name not in RAW_READS:
                continue
            if name == "load" and _is_attribute_of(call, ("json", "torch", "yaml", "np", "pickle")):
                found[(module, where, name)] = ast.unparse(call)[:80]
            elif name != "load":
                found[(module, where, name)] = ast.unparse(call)[:80]
    unexplained = {k: v for k, v in found.items() if k not in NOT_READS}
    assert not unexplained, (
        "files opened or loaded outside gossipcomp/inputs/files.py (read them with it, or list a "
        f"write in NOT_READS): {unexplained}"
    )
    stale = set(NOT_READS) - set(found)
    assert not stale, f"NOT_READS lists calls that are gone: {stale}"


def _is_attribute_of(call: ast.Call, owners: tuple[str, ...]) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in owners
    )
