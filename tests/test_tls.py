"""Mutual TLS over real loopback gRPC, with certificates made by gossipcomp.security."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from conftest import run_in_threads
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import benchmark

from gossipcomp.cli import main
from gossipcomp.security import (
    TlsFiles,
    channel_credentials,
    new_ca,
    new_peer_certificate,
    throwaway_certificates,
)
from gossipcomp.transport.base import Identity, PeerUnreachableError
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport


def _network(directory: Path, names: list[str]) -> dict[str, TlsFiles]:
    ca_cert, ca_key = new_ca(directory)
    return {n: new_peer_certificate(directory, n, ["127.0.0.1"], ca_cert, ca_key) for n in names}


@pytest.fixture
def peer_files(tmp_path) -> dict[str, TlsFiles]:
    return _network(tmp_path / "ca", ["peer0", "peer1"])


@pytest.fixture
def tls_server(peer_files):
    """A TLS transport (rank 0, neighbour 1) serving on loopback."""
    transport = GrpcTransport(
        Identity(0, "topo", "model"), [1], options=GrpcOptions(tls=peer_files["peer0"])
    )
    yield transport
    transport.close()


def _health_check(channel: grpc.Channel) -> grpc.StatusCode:
    """Status of one health check over `channel` (OK when the server answered)."""
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_mutual_tls_transports_exchange_envelopes_bit_exact(peer_files):
    a = GrpcTransport(Identity(0, "t", "m"), [1], options=GrpcOptions(tls=peer_files["peer0"]))
    b = GrpcTransport(Identity(1, "t", "m"), [0], options=GrpcOptions(tls=peer_files["peer1"]))
    try:
        run_in_threads(
            [lambda: a.connect({1: b.address}, timeout=10), lambda: b.connect({0: a.address}, 10)]
        )
        x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        spec = (tensor_spec("x", x),)
        a.inbox.expect("p", spec)
        b.inbox.expect("p", spec)
        ra, rb = run_in_threads(
            [
                lambda: a.exchange(0, "p", {1: (encode_raw("x", x),)}, 20),
                lambda: b.exchange(0, "p", {0: (encode_raw("x", -x),)}, 20),
            ]
        )
        assert not ra.failed and not rb.failed
        got_b = decode_raw(rb.received[0].tensor("x"))
        got_a = decode_raw(ra.received[1].tensor("x"))
        assert got_b.numpy().tobytes() == x.numpy().tobytes()
        assert got_a.numpy().tobytes() == (-x).numpy().tobytes()
        assert ra.bytes_sent[1] == rb.bytes_received[0] > x.numel() * 4
    finally:
        a.close()
        b.close()


def test_a_client_with_the_network_certificate_is_answered(tls_server, peer_files):
    credentials = channel_credentials(peer_files["peer1"])
    channel = grpc.secure_channel(tls_server.address, credentials)
    assert _health_check(channel) == grpc.StatusCode.OK


def test_plaintext_client_cannot_talk_to_a_tls_peer(tls_server):
    channel = grpc.insecure_channel(tls_server.address)
    assert _health_check(channel) == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_from_another_ca_is_refused(tls_server, peer_files, tmp_path):
    stranger = _network(tmp_path / "other-ca", ["stranger"])["stranger"]
    # it trusts our CA (so it accepts the server), but its own certificate is not ours
    files = TlsFiles(cert=stranger.cert, key=stranger.key, ca=peer_files["peer0"].ca)
    channel = grpc.secure_channel(tls_server.address, channel_credentials(files))
    assert _health_check(channel) == grpc.StatusCode.UNAVAILABLE
    # a whole transport with such a certificate never gets through the handshake
    intruder = GrpcTransport(Identity(1, "topo", "model"), [0], options=GrpcOptions(tls=files))
    try:
        with pytest.raises(PeerUnreachableError, match="not reachable within 1 s"):
            intruder.connect({0: tls_server.address}, timeout=1)
    finally:
        intruder.close()


def test_client_without_a_certificate_is_refused(tls_server, peer_files):
    credentials = grpc.ssl_channel_credentials(peer_files["peer0"].ca.read_bytes())
    channel = grpc.secure_channel(tls_server.address, credentials)
    assert _health_check(channel) == grpc.StatusCode.UNAVAILABLE


def test_certificates_cover_loopback_and_keys_are_private(tmp_path):
    with throwaway_certificates(["a"]) as files:
        directory = files["a"].cert.parent
        assert stat.S_IMODE(files["a"].key.stat().st_mode) == 0o600
        assert stat.S_IMODE((directory / "ca-key.pem").stat().st_mode) == 0o600
        files["a"].load()
    assert not directory.exists()
    _network(tmp_path, ["x"])
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        new_ca(tmp_path)
    wrong = TlsFiles(cert=tmp_path / "x.pem", key=tmp_path / "ca-key.pem", ca=tmp_path / "ca.pem")
    with pytest.raises(ValueError, match=r"--tls-key.*does not match"):
        wrong.load()


def test_simulate_over_tls_trains(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["simulate", "--tls", "--rounds", "20", "--topology", "ring4", "--quiet"]
    assert main([*argv, "--report", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["mode"] == "simulate" and result["rounds"] == 20
    assert 0.0 < result["final_test_accuracy"] <= 1.0
    assert result["bytes_sent_total"] > 0


def _guide_secure_ring() -> str:
    """The first bash block of the security guide's secure-ring section, as written there."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "security.md").read_text()
    section = guide[guide.index("## A secure ring") :]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start : section.index("\n```", start)]


def _free_port_run(count: int) -> int:
    """A base port with `count` consecutive free ports after it."""
    for _ in range(50):
        base = benchmark("faults").free_ports(1)[0]
        if base + count < 65536 and all(_port_free(base + k) for k in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_secure_setup_as_in_the_security_guide_with_peer_processes(tmp_path):
    """Runs the security guide's block (docs/guides/security.md) in bash, changed only to train
    60 rounds quietly and to listen on free ports (a base_port line in the topology it writes)."""
    script = _guide_secure_ring()
    topology_line = "printf 'kind: ring\\nn: 4\\n"
    assert topology_line in script and "--report peer$r.json &" in script
    script = script.replace(topology_line, f"{topology_line}base_port: {_free_port_run(4)}\\n")
    script = script.replace("--report peer$r.json &", "--report peer$r.json --rounds 60 --quiet &")
    bin_dir = str(Path(sys.executable).parent)  # where pip put the gossipcomp script
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this checkout's code
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    listed = yaml.safe_load((tmp_path / "keys" / "allowlist.yaml").read_text())
    assert sorted(listed) == [0, 1, 2, 3] and len(set(listed.values())) == 4
    for rank in range(4):
        report_file = tmp_path / f"peer{rank}.json"
        assert report_file.is_file(), f"peer {rank} wrote no report: {done.stderr}"
        report = json.loads(report_file.read_text())
        assert report["mode"] == "peer" and report["rounds"] == 60
        assert report["bytes_sent_total"] > 0
        assert report["per_peer"][0]["failed_exchanges"] == 0


def test_tls_flags_come_all_three_or_none(tmp_path, capsys):
    cert = tmp_path / "peer.pem"
    assert main(["peer", "--topology", "ring4", "--rank", "0", "--tls-cert", str(cert)]) == 2
    err = capsys.readouterr().err
    assert "missing --tls-key, --tls-ca" in err


def test_keys_new_without_a_ca_names_the_missing_ca_files(tmp_path, capsys):
    assert main(["keys", "new", "--out", str(tmp_path), "--name", "peer1"]) == 2
    err = capsys.readouterr().err
    assert "ca.pem" in err and "--ca" in err
    assert not (tmp_path / "peer1.pem").exists()


def test_keys_new_with_ca_refuses_to_overwrite_a_ca(tmp_path, capsys):
    assert main(["keys", "new", "--out", str(tmp_path), "--ca", "--address", "10.1.2.3"]) == 0
    out = capsys.readouterr().out
    assert "ca.pem" in out and "peer.pem" in out and "peer-key.pem" in out
    before = (tmp_path / "ca.pem").read_bytes()
    assert main(["keys", "new", "--out", str(tmp_path), "--ca"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "ca.pem").read_bytes() == before
