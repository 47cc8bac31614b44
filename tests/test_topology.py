"""Tests for gossipcomp.topology: shipped files, mixing-matrix invariants, spectra, errors."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from gossipcomp.experiment.presentation import format_topology
from gossipcomp.security.signing_keys import public_key_text
from gossipcomp.topology import (
    Topology,
    TopologyError,
    build_topology,
    load_topology,
    topology_from_dict,
)

TOPOLOGY_DIR = Path(__file__).resolve().parents[1] / "topologies"
KEY_A, KEY_B = (public_key_text(Ed25519PrivateKey.generate()) for _ in range(2))
SHIPPED = sorted(TOPOLOGY_DIR.glob("*.yaml"))
EXPECTED_FILES = {"ring8", "torus16", "hypercube8", "exponential16", "complete4", "star6", "ring4"}


def disagreement(x: np.ndarray) -> float:
    """Frobenius norm of X minus its row mean (the network average), per-peer rows."""
    return float(np.linalg.norm(x - x.mean(axis=0, keepdims=True)))


def test_expected_files_are_shipped() -> None:
    assert EXPECTED_FILES <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_file_loads_with_valid_mixing_matrix(path: Path) -> None:
    t = load_topology(path)
    assert t.name == path.stem
    assert t.source == str(path)
    assert path.read_text().startswith("# ")
    w, n = t.weights, t.n
    assert w.shape == (n, n) and w.dtype == np.float64
    assert sorted(t.graph.nodes()) == list(range(n))
    assert nx.is_connected(t.graph) and nx.number_of_selfloops(t.graph) == 0
    np.testing.assert_allclose(w, w.T, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert (w >= 0).all()
    support = {(int(i), int(j)) for i, j in zip(*np.nonzero(w > 0), strict=True)}
    expected = {(i, i) for i in range(n)} | {e for i, j in t.edges() for e in ((i, j), (j, i))}
    assert support == expected
    assert len(t.addresses) == n == len(t.public_keys)
    for r in range(n):
        assert t.neighbors(r) == sorted(t.graph.neighbors(r))
        weights = t.neighbor_weights(r)
        assert list(weights) == t.neighbors(r)
        assert t.self_weight(r) + sum(weights.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_spectral_quantities_match_numpy(path: Path) -> None:
    t = load_topology(path)
    ev = np.linalg.eigvals(t.weights)  # general solver, independent of eigvalsh
    assert np.abs(ev.imag).max() < 1e-9
    mods = np.sort(np.abs(ev.real))[::-1]
    assert mods[0] == pytest.approx(1.0, abs=1e-9)
    slem = mods[1]
    assert t.second_largest_eigenvalue_modulus == pytest.approx(slem, abs=1e-9)
    assert t.spectral_gap == pytest.approx(1.0 - slem, abs=1e-9)
    assert 0.0 < t.spectral_gap <= 1.0
    np.testing.assert_allclose(t.eigenvalues, np.sort(ev.real)[::-1], atol=1e-9)
    assert t.eigenvalues[0] == pytest.approx(1.0)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_exact_gossip_contracts_by_spectral_gap(path: Path) -> None:
    t = load_topology(path)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(t.n, 5))
    mean = x.mean(axis=0)
    rate = 1.0 - t.spectral_gap
    for _ in range(25):
        before = disagreement(x)
        x = t.weights @ x
        assert disagreement(x) <= rate * before + 1e-12
        np.testing.assert_allclose(x.mean(axis=0), mean, atol=1e-12)  # average preserved


def test_slem_counts_negative_eigenvalues() -> None:
    """Small self weights push lambda_min towards -1; then |lambda_min| sets the rate."""
    w = [[0.1, 0.45, 0, 0.45], [0.45, 0.1, 0.45, 0], [0, 0.45, 0.1, 0.45], [0.45, 0, 0.45, 0.1]]
    t = build_topology("ring", n=4, weights="explicit", weights_matrix=w)
    np.testing.assert_allclose(t.eigenvalues, [1.0, 0.1, 0.1, -0.8], atol=1e-12)
    assert t.second_largest_eigenvalue_modulus == pytest.approx(0.8)
    assert t.spectral_gap == pytest.approx(0.2)
    assert t.optimal_consensus_step == pytest.approx(2 / (2 - 0.1 + 0.8))
    x = np.array([[1.0], [-1.0], [1.0], [-1.0]])  # the alternating mode, eigenvalue -0.8
    assert disagreement(t.weights @ x) == pytest.approx(0.8 * disagreement(x))


def test_contraction_bound_is_tight_on_ring8() -> None:
    """The gap is not merely a loose bound: the slowest mode decays at exactly SLEM per round."""
    t = load_topology(TOPOLOGY_DIR / "ring8.yaml")
    x = np.random.default_rng(1).normal(size=(t.n, 3))
    for _ in range(60):
        x = t.weights @ x
    before = disagreement(x)
    after = disagreement(t.weights @ x)
    assert after / before == pytest.approx(t.second_largest_eigenvalue_modulus, rel=1e-6)


def test_optimal_consensus_step_on_ring8() -> None:
    t = load_topology(TOPOLOGY_DIR / "ring8.yaml")
    gamma = t.optimal_consensus_step
    assert round(gamma, 3) == 1.308
    lam = t.eigenvalues[1:]  # eigenvalues on the disagreement subspace

    def radius(g: float) -> float:
        return float(np.abs(1.0 - g * (1.0 - lam)).max())

    assert radius(gamma) < radius(1.0)
    assert radius(gamma) <= min(radius(gamma - 0.01), radius(gamma + 0.01))

    rng = np.random.default_rng(2)
    x0 = rng.normal(size=(t.n, 4))
    finals = {}
    for g in (1.0, gamma):
        x = x0.copy()
        for _ in range(30):
            x = x + g * (t.weights @ x - x)
        np.testing.assert_allclose(x.mean(axis=0), x0.mean(axis=0), atol=1e-12)
        finals[g] = disagreement(x)
    assert finals[gamma] < 0.5 * finals[1.0]  # radius 0.745 vs 0.805 per round


def test_hash_stable_and_graph_sensitive(tmp_path: Path) -> None:
    ring8 = load_topology(TOPOLOGY_DIR / "ring8.yaml")
    assert len(ring8.hash) == 64 and int(ring8.hash, 16) >= 0
    assert load_topology(TOPOLOGY_DIR / "ring8.yaml").hash == ring8.hash
    same = build_topology("ring", n=8, name="other-name", base_port=6000)
    assert same.hash == ring8.hash  # name and addresses do not enter the hash
    assert build_topology("ring", n=8, weights="uniform").hash == ring8.hash  # same W on a ring
    relabelled = topology_from_dict(
        {"kind": "edges", "edges": [[(i + 1) % 8, i] for i in range(8)]}
    )
    assert relabelled.hash == ring8.hash
    assert build_topology("ring", n=4).hash != ring8.hash
    assert build_topology("exponential", n=8).hash != ring8.hash
    assert build_topology("hypercube", n=8).hash != ring8.hash
    spur = {"kind": "edges", "edges": [[0, 1], [0, 2], [0, 3], [3, 4]]}
    metropolis = topology_from_dict(spur)
    uniform = topology_from_dict({**spur, "weights": "uniform"})
    assert not np.allclose(metropolis.weights, uniform.weights)
    assert metropolis.hash != uniform.hash
    base = build_topology("ring", n=4)
    nudged = base.weights + 1e-6 * (np.eye(4)[[1, 0, 3, 2]] - np.eye(4))  # still doubly stochastic
    tiny = base.weights + 1e-14 * (np.eye(4)[[1, 0, 3, 2]] - np.eye(4))
    explicit = {"kind": "ring", "n": 4, "weights": "explicit"}
    assert topology_from_dict({**explicit, "weights_matrix": nudged.tolist()}).hash != base.hash
    assert topology_from_dict({**explicit, "weights_matrix": tiny.tolist()}).hash == base.hash
    moved = ring8.with_addresses([f"10.0.0.{r}:7000" for r in range(8)])
    assert moved.hash == ring8.hash and moved.addresses != ring8.addresses
    code = (
        "from gossipcomp.topology import load_topology; "
        f"print(load_topology({str(TOPOLOGY_DIR / 'ring8.yaml')!r}).hash)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ring8.hash


def test_hash_value_is_pinned() -> None:
    """Peers compare hashes in the handshake, so a change of scheme must be deliberate: v2 is
    sha256 over n, sorted edges and weights in units of 1e-12 as little-endian int64."""
    ring8 = load_topology(TOPOLOGY_DIR / "ring8.yaml")
    assert ring8.hash == "e47c63b59a8025e6172f8d10020e421248c42901f244be07348e093f1ea350a5"
    cube = build_topology("hypercube", dim=12)  # sparse path: same scheme, no dense matrix
    assert cube.hash == "7a31ba4f9be39ce08de535d231da25533b22a5f759a64d70cbd3119d5fb99140"


def test_metropolis_weights_on_star6_by_hand() -> None:
    t = load_topology(TOPOLOGY_DIR / "star6.yaml")
    # centre 0 has degree 5, leaves degree 1: w_0j = 1 / (1 + max(5, 1)) = 1/6.
    assert t.neighbors(0) == [1, 2, 3, 4, 5]
    assert t.neighbor_weights(0) == pytest.approx({j: 1 / 6 for j in range(1, 6)})
    assert t.self_weight(0) == pytest.approx(1 - 5 / 6)
    for leaf in range(1, 6):
        assert t.neighbors(leaf) == [0]
        assert t.neighbor_weights(leaf) == pytest.approx({0: 1 / 6})
        assert t.self_weight(leaf) == pytest.approx(5 / 6)


def test_uniform_weights_use_max_degree() -> None:
    t = build_topology("star", n=4, weights="uniform")
    assert t.neighbor_weights(1) == pytest.approx({0: 1 / 4})
    assert t.self_weight(1) == pytest.approx(3 / 4)
    assert t.self_weight(0) == pytest.approx(1 / 4)


def test_generators_shape() -> None:
    torus = build_topology("torus", rows=4, cols=4)
    assert torus.n == 16 and torus.neighbors(0) == [1, 3, 4, 12]
    assert torus.neighbors(5) == [1, 4, 6, 9]
    wide = build_topology("torus", rows=3, cols=4)  # row-major: rank = row * cols + col
    assert wide.neighbors(1) == [0, 2, 5, 9] and wide.neighbors(4) == [0, 5, 7, 8]
    cube = build_topology("hypercube", dim=3)
    assert all(cube.neighbors(i) == sorted(i ^ b for b in (1, 2, 4)) for i in range(8))
    assert build_topology("hypercube", n=8).hash == cube.hash
    expo = build_topology("exponential", n=16)
    assert expo.neighbors(0) == [1, 2, 4, 8, 12, 14, 15]
    two = build_topology("ring", n=2)
    assert two.edges() == [(0, 1)] and two.weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert build_topology("complete", n=5).spectral_gap == pytest.approx(1.0)
    rr = build_topology("random_regular", n=10, degree=3, seed=4)
    assert {d for _, d in rr.graph.degree()} == {3}
    assert build_topology("random_regular", n=10, degree=3, seed=4).hash == rr.hash
    er = build_topology("erdos_renyi", n=12, p=0.5, seed=3)
    assert nx.is_connected(er.graph)
    assert build_topology("erdos_renyi", n=12, p=0.5, seed=3).hash == er.hash
    inferred = topology_from_dict({"kind": "edges", "edges": [[0, 1], [1, 2], [2, 3]]})
    assert inferred.n == 4 and inferred.edges() == [(0, 1), (1, 2), (2, 3)]


def test_build_topology_ring4_defaults() -> None:
    t = build_topology("ring", n=4)
    assert isinstance(t, Topology)
    assert (t.name, t.kind, t.n, t.source) == ("ring4", "ring", 4, "<dict>")
    assert t.edges() == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert t.neighbors(0) == [1, 3]
    assert t.addresses == tuple(f"127.0.0.1:{50100 + r}" for r in range(4))
    assert t.public_keys == (None,) * 4
    assert t.hash == load_topology(TOPOLOGY_DIR / "ring4.yaml").hash
    with pytest.raises(TopologyError, match="out of range"):
        t.neighbors(4)
    with pytest.raises(TopologyError, match="out of range"):
        t.self_weight(-1)


def test_topology_is_immutable_and_pickles() -> None:
    t = build_topology("ring", n=4, peers={1: {"address": "h:9", "public_key": KEY_A}})
    with pytest.raises(ValueError):
        t.weights[0, 0] = 1.0
    with pytest.raises(nx.NetworkXError):
        t.graph.add_edge(0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "other"  # type: ignore[misc]
    copy = pickle.loads(pickle.dumps(t))
    assert (copy.hash, copy.addresses, copy.public_keys) == (t.hash, t.addresses, t.public_keys)
    with pytest.raises(ValueError):
        copy.weights[0, 0] = 1.0


def test_explicit_weights_happy_path(tmp_path: Path) -> None:
    path = tmp_path / "explicit.yaml"
    path.write_text(
        "kind: ring\nn: 4\nweights: explicit\nweights_matrix:\n"
        "  - [0.5, 0.25, 0, 0.25]\n  - [0.25, 0.5, 0.25, 0]\n"
        "  - [0, 0.25, 0.5, 0.25]\n  - [0.25, 0, 0.25, 0.5]\n"
    )
    t = load_topology(path)
    assert t.name == "explicit"
    assert t.self_weight(2) == 0.5
    assert t.neighbor_weights(2) == {1: 0.25, 3: 0.25}
    assert t.hash != build_topology("ring", n=4).hash
    assert t.second_largest_eigenvalue_modulus == pytest.approx(0.5)


def test_peers_and_with_addresses(tmp_path: Path) -> None:
    path = tmp_path / "peers.yaml"
    path.write_text(
        "kind: ring\nn: 4\nbase_port: 6000\npeers:\n  0: '10.0.0.1:7000'\n"
        f"  3: {{address: '[::1]:7003', public_key: '{KEY_A}'}}\n"
    )
    t = load_topology(path)
    assert t.addresses == ("10.0.0.1:7000", "127.0.0.1:6001", "127.0.0.1:6002", "[::1]:7003")
    assert t.public_keys == (None, None, None, KEY_A)
    moved = t.with_addresses(["h0:1", "h1:2", "h2:3", "h3:4"])
    assert moved.addresses[2] == "h2:3" and moved.public_keys == t.public_keys
    with pytest.raises(TopologyError, match="4"):
        t.with_addresses(["h0:1", "h1:2"])
    with pytest.raises(TopologyError, match="duplicate.*ranks 0 and 2"):
        t.with_addresses(["h0:1", "h1:2", "h0:1", "h3:4"])
    with pytest.raises(TopologyError, match="host:port"):
        t.with_addresses(["h0:1", "h1:2", "h2", "h3:4"])


BAD_FILES = {
    "not_yaml": ("kind: ring\nn: [1, 2\n", "YAML"),
    "not_mapping": ("- ring\n- 8\n", "mapping"),
    "empty": ("", "mapping"),
    "duplicate_key": ("kind: ring\nn: 4\nn: 5\n", "duplicate key"),
    "unknown_kind": ("kind: moebius\nn: 4\n", "unknown kind"),
    "unknown_key": ("kind: ring\nn: 4\ncolour: blue\n", "unknown key"),
    "missing_kind": ("n: 4\n", "missing parameter 'kind'"),
    "missing_param": ("kind: ring\n", "missing parameter 'n' for kind 'ring'"),
    "missing_torus": ("kind: torus\nrows: 4\n", "missing parameter 'cols'"),
    "missing_hypercube": ("kind: hypercube\n", "missing parameter"),
    "stray_param": ("kind: ring\nn: 4\np: 0.5\n", "do not apply"),
    "n_too_small": ("kind: ring\nn: 1\n", "too small"),
    "n_too_large": ("kind: complete\nn: 100000\n", "too large"),
    "dim_too_large": ("kind: hypercube\ndim: 40\n", "too large"),
    "n_not_int": ("kind: complete\nn: four\n", "integer"),
    "n_bool": ("kind: star\nn: true\n", "integer"),
    "hypercube_not_pow2": ("kind: hypercube\nn: 6\n", "power of two"),
    "torus_mismatch": ("kind: torus\nrows: 2\ncols: 3\nn: 8\n", "rows * cols"),
    "bad_p": ("kind: erdos_renyi\nn: 8\np: 1.5\n", "probability"),
    "bad_regular": ("kind: random_regular\nn: 5\ndegree: 3\n", "regular"),
    "er_disconnected": ("kind: erdos_renyi\nn: 30\np: 0.02\nseed: 1\n", "disconnected"),
    "disconnected": ("kind: edges\nedges: [[0, 1], [2, 3]]\n", "2 components"),
    "isolated_peer": ("kind: edges\nn: 4\nedges: [[0, 1], [1, 2]]\n", "disconnected"),
    "self_loop": ("kind: edges\nedges: [[0, 1], [1, 1]]\n", "self-loop on node 1"),
    "edge_out_of_range": ("kind: edges\nn: 3\nedges: [[0, 1], [1, 5]]\n", "out of range"),
    "edge_negative": ("kind: edges\nedges: [[0, 1], [-1, 0]]\n", "out of range"),
    "edge_malformed": ("kind: edges\nedges: [[0, 1, 2]]\n", "malformed"),
    "peer_out_of_range": ("kind: ring\nn: 4\npeers: {7: 'h:1'}\n", "out of range"),
    "peer_duplicate": ("kind: ring\nn: 4\npeers: {1: 'h:1', 3: 'h:1'}\n", "ranks 1 and 3"),
    "peer_default_clash": ("kind: ring\nn: 4\npeers: {3: '127.0.0.1:50100'}\n", "duplicate"),
    "peer_not_hostport": ("kind: ring\nn: 4\npeers: {2: 'localhost'}\n", "host:port"),
    "peer_bad_port": ("kind: ring\nn: 4\npeers: {2: 'h:99999'}\n", "host:port"),
    "peer_no_address": ("kind: ring\nn: 4\npeers: {2: {public_key: k}}\n", "address"),
    "peer_key_not_ed25519": (
        "kind: ring\nn: 4\npeers: {2: {address: 'h:1', public_key: abc123}}\n",
        "peer 2: public key 'abc123' is not an Ed25519 key",
    ),
    "peer_key_short": (
        "kind: ring\nn: 4\npeers: {2: {address: 'h:1', public_key: 'ed25519:AAAA'}}\n",
        "public key has 3 bytes",
    ),
    "allowlist_missing": ("kind: ring\nn: 4\nallowlist: nowhere.yaml\n", "no such file"),
    "bad_base_port": ("kind: ring\nn: 4\nbase_port: 65534\n", "base_port"),
    "unknown_scheme": ("kind: ring\nn: 4\nweights: magic\n", "unknown weights scheme"),
    "explicit_missing": ("kind: ring\nn: 4\nweights: explicit\n", "weights_matrix"),
    "explicit_size": (
        "kind: ring\nn: 3\nweights: explicit\nweights_matrix: [[1, 0], [0, 1]]\n",
        "shape",
    ),
    "explicit_asym": (
        "kind: ring\nn: 3\nweights: explicit\nweights_matrix: "
        "[[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]]\n",
        "not symmetric: w[0,1]",
    ),
    "explicit_rowsum": (
        "kind: ring\nn: 3\nweights: explicit\nweights_matrix: "
        "[[0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.5]]\n",
        "row 2 sums to 0.9",
    ),
    "explicit_non_edge": (
        "kind: edges\nedges: [[0, 1], [1, 2]]\nweights: explicit\n"
        "weights_matrix: [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], "
        "[0.25, 0.25, 0.5]]\n",
        "non-edge (0, 2)",
    ),
    "explicit_negative": (
        "kind: ring\nn: 2\nweights: explicit\nweights_matrix: [[1.5, -0.5], [-0.5, 1.5]]\n",
        "negative",
    ),
    "explicit_zero_edge": (
        "kind: ring\nn: 2\nweights: explicit\nweights_matrix: [[1, 0], [0, 1]]\n",
        "zero weight on edge",
    ),
    "explicit_no_mixing": (
        "kind: ring\nn: 2\nweights: explicit\nweights_matrix: [[0, 1], [1, 0]]\n",
        "does not converge",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_raises_clear_error(tmp_path: Path, case: str) -> None:
    text, word = BAD_FILES[case]
    path = tmp_path / "topo.yaml"  # a neutral name: the problem word must come from the message
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert str(path) in message
    assert word in message
    assert "expected" in message


def test_missing_file_and_dict_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(TopologyError, match="topology file .*nowhere.yaml: no such file"):
        load_topology(missing)
    with pytest.raises(TopologyError, match="<dict>: unknown kind 'blob'.*'torus'"):
        topology_from_dict({"kind": "blob"})
    with pytest.raises(TopologyError, match="unknown key.*'base_port'"):
        build_topology("ring", n=4, bogus=1)
    assert issubclass(TopologyError, ValueError)


def test_format_topology_renders() -> None:
    t = load_topology(TOPOLOGY_DIR / "ring8.yaml")
    console = Console(record=True, width=200)
    console.print(format_topology(t))
    text = console.export_text()
    for needle in (
        "ring8",
        t.hash,
        "1.308",
        "0.1953",
        "0.8047",
        "127.0.0.1:50107",
        "0.3333",
        "1:0.3333, 7:0.3333",
    ):
        assert needle in text


def test_allowlist_file_fills_public_keys_relative_to_the_topology(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "allow.yaml").write_text(f"0: '{KEY_A}'\n2: '{KEY_B}'\n")
    path = tmp_path / "ring.yaml"
    path.write_text(
        f"kind: ring\nn: 4\nallowlist: keys/allow.yaml\npeers:\n"
        f"  2: {{address: 'h:1', public_key: '{KEY_B}'}}\n"
    )
    assert load_topology(path).public_keys == (KEY_A, None, KEY_B, None)
    path.write_text(
        f"kind: ring\nn: 4\nallowlist: keys/allow.yaml\npeers:\n"
        f"  2: {{address: 'h:1', public_key: '{KEY_A}'}}\n"
    )
    with pytest.raises(TopologyError, match="peer 2 has public_key .* but the allowlist says"):
        load_topology(path)
    (tmp_path / "keys" / "allow.yaml").write_text(f"0: '{KEY_A}'\n3: '{KEY_A}'\n")
    path.write_text("kind: ring\nn: 4\nallowlist: keys/allow.yaml\n")
    with pytest.raises(TopologyError, match="peers 0 and 3 have the same public key"):
        load_topology(path)
    (tmp_path / "keys" / "allow.yaml").write_text(f"9: '{KEY_A}'\n")
    path.write_text("kind: ring\nn: 4\nallowlist: keys/allow.yaml\n")
    with pytest.raises(TopologyError, match="allowlist has rank 9; expected ranks 0..3"):
        load_topology(path)
