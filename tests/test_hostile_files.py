"""Files an operator points gossipcomp at, written by an attacker: topologies and allowlists that
expand (alias bombs), nest, grow or name graphs too large to build, and private key files others
can read or that are not files at all. Each is refused quickly, in bounded memory, with a short
error naming the file, the problem and what was expected."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from gossipcomp.experiment.presentation import format_topology
from gossipcomp.inputs import yaml_files
from gossipcomp.security import TlsFiles, new_ca, new_peer_certificate
from gossipcomp.security.signing_keys import (
    load_signing_key,
    public_key_text,
    read_allowlist,
    write_signing_key,
)
from gossipcomp.topology import (
    MAX_DENSE_PEERS,
    MAX_EDGES,
    MAX_PEERS,
    TopologyError,
    build_topology,
    load_topology,
    topology_from_dict,
)

SHORT = 500  # characters: no error may echo the file


def _bomb() -> str:
    """A ~430-byte flow list: anchors a..i, each nine aliases of the previous, then *i: 9**9
    strings once expanded (the "billion laughs")."""
    names = "abcdefghi"
    lists = ["&a [" + ", ".join(['"lol"'] * 9) + "]"]
    lists += [f"&{name} [{', '.join(['*' + prev] * 9)}]" for prev, name in pairwise(names)]
    return "[" + ", ".join(lists) + ", *i]"


BOMBS = {
    "name": f"kind: ring\nn: 4\nname: {_bomb()}\n",
    "kind": f"kind: {_bomb()}\nn: 4\n",
    "n": f"kind: ring\nn: {_bomb()}\n",
    "peers": f"kind: ring\nn: 4\npeers: {{0: {_bomb()}}}\n",
    "edges": f"kind: edges\nedges: [{_bomb()}]\n",
}
RING_GAP = 4 / 3 * np.sin(np.pi / 4096) ** 2  # w = 1/3: eigenvalues 1/3 + 2/3 cos(2 pi k / n)


REFUSAL_CPU_SECONDS = 1.0  # this thread's CPU: what the refusal costs, however busy the machine
REFUSAL_WALL_SECONDS = 10.0  # wall clock: catches a refusal that blocks (reads a pipe, sleeps)


def _refused(call: Callable[[], Any], error: type[Exception] = TopologyError) -> str:
    """Run `call`, expecting `error` at under a second of this thread's CPU (a wall-clock bound
    flaked at 1.02 s for a 0.3 s parse while the full suite loaded both cores) and without
    blocking; its message, checked to be short."""
    started_cpu, started_wall = time.thread_time(), time.perf_counter()
    with pytest.raises(error) as info:
        call()
    assert time.thread_time() - started_cpu < REFUSAL_CPU_SECONDS
    assert time.perf_counter() - started_wall < REFUSAL_WALL_SECONDS
    message = str(info.value)
    assert len(message) < SHORT, message
    assert "expected" in message
    return message


# ---- topology files: expansion, nesting, keys, size -------------------------------------------


@pytest.mark.parametrize("field", sorted(BOMBS))
def test_alias_bomb_in_any_field_is_refused_at_parse_time(tmp_path: Path, field: str) -> None:
    """A ~430-byte billion-laughs file took 2.5-3.4 GB and up to 60 s before a MemoryError."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMBS[field])
    assert path.stat().st_size < 600
    tracemalloc.start()
    try:
        message = _refused(lambda: load_topology(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20
    assert str(path) in message and "aliases and anchors (*name, &name) are not allowed" in message


def test_deep_nesting_names_the_file(tmp_path: Path) -> None:
    """5000 levels of [ gave a RecursionError that named no file. Whichever check stops it first
    (ours at MAX_YAML_DEPTH, or the parser's own limit that PyYAML 6.0.4 added, which its
    look-ahead reaches first here), it is refused quickly and briefly, naming the file; the
    parser's wording is its own and not asserted."""
    path = tmp_path / "deep.yaml"
    path.write_text("kind: ring\nn: " + "[" * 5000 + "]" * 5000 + "\n")
    message = _refused(lambda: load_topology(path))
    assert str(path) in message and "not valid YAML at line 2" in message


@pytest.mark.parametrize("style", ["flow", "block"])
def test_nesting_past_our_limit_is_refused_by_our_check(tmp_path: Path, style: str) -> None:
    """One level past MAX_YAML_DEPTH, far below any parser's own limit: gossipcomp's check fires."""
    levels = yaml_files.MAX_YAML_DEPTH + 1
    if style == "flow":
        text = "kind: ring\nn: " + "[" * levels + "]" * levels + "\n"
    else:
        text = "kind: ring\nn:\n" + "".join(" " * (2 * i + 2) + "-\n" for i in range(levels))
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    message = _refused(lambda: load_topology(path))
    depth = yaml_files.MAX_YAML_DEPTH
    assert str(path) in message and f"nested more than {depth} levels deep" in message


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("? [1, 2]\n: 3\nkind: ring\nn: 4\n", "a mapping key is a sequence"),
        ("? {a: 1}\n: 3\nkind: ring\nn: 4\n", "a mapping key is a mapping"),
        ("kind: ring\npeers: {? [0]\n: 'h:1'}\nn: 4\n", "a mapping key is a sequence"),
        ("<<: {kind: ring}\nn: 4\n", "a mapping key is a merge"),
    ],
    ids=["list", "mapping", "nested", "merge"],
)
def test_non_scalar_keys_are_a_clear_error(tmp_path: Path, text: str, what: str) -> None:
    """A list as a mapping key gave a TypeError traceback."""
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    message = _refused(lambda: load_topology(path))
    assert str(path) in message and what in message and "not a string or number" in message


def test_node_count_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yaml_files, "MAX_YAML_NODES", 1000)
    path = tmp_path / "many.yaml"
    path.write_text("kind: edges\nedges: [" + ", ".join(["[0, 1]"] * 400) + "]\n")
    message = _refused(lambda: load_topology(path))
    assert "more than 1000 nodes (MAX_YAML_NODES)" in message and str(path) in message
    path.write_text("kind: edges\nedges: [" + ", ".join(["[0, 1]"] * 300) + "]\n")
    assert load_topology(path).n == 2  # 903 nodes: under the limit


def test_oversized_file_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:
        file.truncate(yaml_files.MAX_YAML_BYTES + 1)  # sparse: costs no disk
    message = _refused(lambda: load_topology(path))
    assert f"{yaml_files.MAX_YAML_BYTES + 1} bytes, over the limit" in message


@pytest.mark.timeout(20)
def test_fifo_directory_and_device_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # nobody writes: reading it would block forever
    assert "is a FIFO (named pipe), not a regular file" in _refused(lambda: load_topology(fifo))
    assert "is a directory" in _refused(lambda: load_topology(tmp_path))
    assert "character device" in _refused(lambda: load_topology("/dev/zero"))


def _refused_naming_file(path: Path, text: str, needle: str) -> str:
    """Load `text` as the topology file `path`; the refusal must hold `needle` and the path."""
    path.write_text(text)
    message = _refused(lambda: load_topology(path))
    assert needle in message and str(path) in message
    return message


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("kind: " + "x" * 100_000 + "\nn: 4\n", "unknown kind 'xxxx"),
        ("kind: ring\nn: " + "7" * 4000 + "\n", "parameter 'n' is 7777"),
        ("kind: ring\nn: 4\nname: [" + "1, " * 20_000 + "]\n", "name is [1, 1"),
        ("kind: ring\nn: 4\npeers: {1: '" + "h" * 50_000 + "'}\n", "address 'hhh"),
        ("kind: edges\nedges: [[0, 1], [" + "2, " * 20_000 + "]]\n", "edge [2, 2"),
        ("kind: ring\nn: 4\n" + "y" * 1000 + ": 1\n", "unknown key(s) ['yyy"),
        ("kind: ring\nn: !!python/object:" + "z" * 100_000 + " 4\n", "tag:yaml.org,2002:python"),
        ("kind: ring\nn: 4\n" + ("k" * 1000 + ": 1\n") * 2, "duplicate key 'kkk"),
        ("kind: ring\nn: 4\n" + "k" * 100_000 + ": 1\n", "not valid YAML at line 3"),
        ("kind: erdos_renyi\nn: 8\np: '" + "q" * 100_000 + "'\n", "parameter 'p' is 'qqq"),
    ],
    ids=["kind", "n", "name", "address", "edge", "key", "tag", "duplicate", "long_key", "p"],
)
def test_errors_quote_at_most_a_few_dozen_characters(
    tmp_path: Path, text: str, needle: str
) -> None:
    _refused_naming_file(tmp_path / "long.yaml", text, needle)


# ---- topology size: limits before building, linear memory, lazy sparse spectrum ---------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("kind: complete\nn: 4096\n", "a complete graph on 4096 peers, over the limit of"),
        ("kind: erdos_renyi\nn: 4096\np: 1\n", "expects 8386560 edges, over the limit of"),
        ("kind: random_regular\nn: 16000\ndegree: 200\n", "200-regular graph on 16000 peers"),
        (f"kind: ring\nn: {MAX_PEERS + 1}\n", "(too large); expected an integer in 2..16384"),
        ("kind: hypercube\ndim: 15\n", "'dim' is 15 (too large)"),
    ],
    ids=["complete", "erdos_renyi", "random_regular", "ring", "hypercube"],
)
def test_graphs_over_the_limits_are_refused_before_they_are_built(
    tmp_path: Path, text: str, needle: str
) -> None:
    """`kind: complete, n: 4096` (23 bytes) ran out of memory hashing a dense 4096 x 4096 W."""
    message = _refused_naming_file(tmp_path / "big.yaml", text, needle)
    assert "MAX_EDGES" in message or "too large" in message


def test_edge_list_over_the_limit_is_refused_before_it_is_read() -> None:
    edges = [[0, 1]] * (MAX_EDGES + 1)
    message = _refused(lambda: topology_from_dict({"kind": "edges", "edges": edges}))
    assert f"edges lists {MAX_EDGES + 1} edges, over the limit of {MAX_EDGES}" in message


def _show(topology: Any) -> str:
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(format_topology(topology))
    return console.export_text()


@pytest.mark.parametrize(
    ("text", "gap", "step"),
    [
        ("kind: ring\nn: 4096\n", RING_GAP, 2 / (2 - (1 - RING_GAP) + 1 / 3)),
        ("kind: hypercube\ndim: 12\n", 2 / 13, 1.0),  # w = 1/13: eigenvalues 1 - 2k/13
    ],
    ids=["ring4096", "hypercube12"],
)
def test_large_topologies_load_hash_and_show_in_seconds(
    tmp_path: Path, text: str, gap: float, step: float
) -> None:
    """A ring of 4096 took 2.4 GB and 14.5 s; hypercube dim 12, 39 s."""
    path = tmp_path / "large.yaml"
    path.write_text(text)
    tracemalloc.start()
    try:
        topology = load_topology(path)
        digest = topology.hash
        rows = [topology.neighbor_weights(r) for r in (0, 1, topology.n - 1)]
        measured = (topology.spectral_gap, topology.optimal_consensus_step)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20  # a dense W alone would be 128 MiB, its hash text gigabytes
    assert measured[0] == pytest.approx(gap, rel=1e-6)
    assert measured[1] == pytest.approx(step, rel=1e-9)
    assert all(sum(row.values()) + topology.self_weight(0) == pytest.approx(1.0) for row in rows)
    start = time.perf_counter()
    again = load_topology(path)
    shown = _show(again)
    elapsed = time.perf_counter() - start
    assert elapsed < 30.0  # ~2 s on 2 busy cores
    assert again.hash == digest and digest in shown
    assert f"{topology.n} / {topology.graph.number_of_edges()}" in shown


def test_sparse_spectrum_matches_dense_on_both_methods() -> None:
    """Just above MAX_DENSE_PEERS: a thin torus (banded path) and a random regular graph
    (Lanczos path) give the extremes a dense solver gives."""
    for topology in (
        build_topology("torus", rows=8, cols=MAX_DENSE_PEERS // 8 + 8),
        build_topology("random_regular", n=MAX_DENSE_PEERS + 76, degree=3, seed=1),
    ):
        assert topology.n > MAX_DENSE_PEERS
        ev = np.linalg.eigvalsh(topology.mixing.toarray())
        slem = max(abs(ev[-2]), abs(ev[0]))
        assert topology.second_largest_eigenvalue_modulus == pytest.approx(slem, abs=1e-8)
        expected_step = 2 / (2 - ev[-2] - ev[0])
        assert topology.optimal_consensus_step == pytest.approx(expected_step, abs=1e-7)


def test_spectrum_is_lazy_and_dense_views_are_bounded() -> None:
    topology = build_topology("ring", n=MAX_DENSE_PEERS + 1)
    assert "_extreme_eigenvalues" not in vars(topology)  # nothing computed at construction
    for view in ("weights", "eigenvalues"):
        with pytest.raises(TopologyError, match=f"over MAX_DENSE_PEERS, {MAX_DENSE_PEERS}"):
            getattr(topology, view)
    assert topology.spectral_gap > 0
    with pytest.raises(TopologyError, match="weights: explicit on 1100 peers"):
        build_topology("ring", n=1100, weights="explicit", weights_matrix=[[1.0]])


def test_large_hash_is_identical_in_another_process(tmp_path: Path) -> None:
    path = tmp_path / "cube.yaml"
    path.write_text("kind: hypercube\ndim: 11\n")
    code = (
        f"from gossipcomp.topology import load_topology; print(load_topology({str(path)!r}).hash)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == load_topology(path).hash


# ---- allowlist files: the same reader ---------------------------------------------------------


def test_allowlist_goes_through_the_hardened_reader(tmp_path: Path) -> None:
    key = public_key_text(Ed25519PrivateKey.generate())
    allow = tmp_path / "allow.yaml"
    allow.write_text(f"0: {_bomb()}\n1: '{key}'\n")
    message = _refused(lambda: read_allowlist(allow), ValueError)
    assert str(allow) in message and "aliases and anchors" in message
    allow.write_text(f"0: '{key}'\n0: '{key}'\n")
    assert "duplicate key 0" in _refused(lambda: read_allowlist(allow), ValueError)
    allow.write_text(f"0: '{'A' * 100_000}'\n")
    assert "is not an Ed25519 key" in _refused(lambda: read_allowlist(allow), ValueError)
    topology = tmp_path / "ring.yaml"
    topology.write_text("kind: ring\nn: 4\nallowlist: allow.yaml\n")
    allow.unlink()
    os.mkfifo(allow)
    message = _refused(lambda: load_topology(topology))
    assert "allowlist" in message and "FIFO" in message


# ---- private key files ------------------------------------------------------------------------


def test_signing_key_readable_by_others_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "peer0-signing-key.pem"
    key = write_signing_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert public_key_text(load_signing_key(path)) == public_key_text(key)
    for mode in (0o644, 0o640, 0o604):
        path.chmod(mode)
        message = _refused(lambda: load_signing_key(path), ValueError)
        assert f"signing key (--key) {path}: mode {mode:04o}" in message
        assert f"`chmod 600 {path}`" in message
    path.chmod(0o400)  # owner-only, read-only: fine
    assert public_key_text(load_signing_key(path)) == public_key_text(key)


def test_tls_and_ca_keys_readable_by_others_are_refused(tmp_path: Path) -> None:
    ca_cert, ca_key = new_ca(tmp_path)
    files = new_peer_certificate(tmp_path, "peer0", ["127.0.0.1"], ca_cert, ca_key)
    files.load()  # 0600 as written
    files.key.chmod(0o644)
    message = _refused(files.load, ValueError)
    assert f"private key (--tls-key) {files.key}: mode 0644" in message
    assert f"`chmod 600 {files.key}`" in message
    files.cert.chmod(0o644)  # certificates are public
    files.key.chmod(0o600)
    files.load()
    ca_key.chmod(0o660)
    message = _refused(
        lambda: new_peer_certificate(tmp_path, "peer1", [], ca_cert, ca_key), ValueError
    )
    assert f"CA key {ca_key}: mode 0660" in message and "chmod 600" in message


@pytest.mark.timeout(20)
def test_key_files_that_are_not_regular_files_are_refused_without_blocking(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "key.pem"
    os.mkfifo(fifo, 0o600)
    assert "is a FIFO" in _refused(lambda: load_signing_key(fifo), ValueError)
    ca_cert, ca_key = new_ca(tmp_path / "ca")
    files = new_peer_certificate(tmp_path / "ca", "peer0", [], ca_cert, ca_key)
    tls = TlsFiles(cert=files.cert, key=fifo, ca=files.ca)
    assert "--tls-key" in _refused(tls.load, ValueError)
    assert "is a directory" in _refused(lambda: load_signing_key(tmp_path), ValueError)
    with pytest.raises(FileNotFoundError, match="no such file; expected a PEM Ed25519"):
        load_signing_key(tmp_path / "missing.pem")
