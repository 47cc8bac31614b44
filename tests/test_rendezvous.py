"""Peer addresses from torch's rendezvous store instead of a `peers:` block (issue 27, part 3):
threads announcing and collecting addresses through a real TCPStore, a missing rank named at the
deadline, hostile store and environment values refused with bounded messages, the topology built
equal to the one a static `peers:` block gives (peers handshake over real gRPC with it), and four
`gossipcomp peer` processes started by torchrun with no address in their file, each writing its
own report."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers import benchmark, store_set

from gossipcomp.cli import main
from gossipcomp.inputs.text import quoted
from gossipcomp.rendezvous import (
    Launch,
    Registry,
    RendezvousError,
    exchange_addresses,
    open_store,
    parse_launch,
    registry_endpoint,
    rendezvous_topology,
    reserved_port,
)
from gossipcomp.topology import Topology, topology_from_dict
from gossipcomp.topology.checks import TopologyError
from gossipcomp.transport.base import Identity
from gossipcomp.transport.grpc_transport import GrpcTransport

ROOT = Path(__file__).resolve().parents[1]
RING4 = {"name": "ring4", "kind": "ring", "n": 4}


def _store() -> dist.TCPStore:
    """A store this test hosts on a free loopback port, as rank 0 of a launch would."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)


def _client(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))


def _in_threads(n: int, work: Callable[[int], Any]) -> list[Any]:
    """work(rank) for ranks 0..n-1 at once; each result, or the exception it raised."""

    def caught(rank: int) -> Any:
        try:
            return work(rank)
        except Exception as error:  # returned, so every thread's outcome can be checked
            return error

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(caught, range(n)))


def test_threads_exchange_addresses_and_build_the_static_topology() -> None:
    master = _store()
    addresses = [f"127.0.0.1:{41000 + r}" for r in range(4)]
    got = _in_threads(
        4, lambda r: exchange_addresses(_client(master), r, 4, addresses[r], 30.0, "test")
    )
    assert got == [tuple(addresses)] * 4
    rendezvoused = topology_from_dict(RING4).with_addresses(got[0])
    static = topology_from_dict({**RING4, "peers": dict(enumerate(addresses))})
    assert rendezvoused.addresses == static.addresses
    assert rendezvoused.hash == static.hash


def test_a_missing_rank_is_named_at_the_deadline() -> None:
    master = _store()
    got = _in_threads(
        3, lambda r: exchange_addresses(_client(master), r, 4, f"127.0.0.1:{42000 + r}", 1.0, "s")
    )
    for error in got:
        assert isinstance(error, RendezvousError), error
        assert "no address from rank(s) 3 (1 of 4) within 1 s" in str(error)


def _hostile(value: bytes, rank: int = 2) -> RendezvousError:
    """What the honest ranks say when rank `rank`'s key holds `value`."""
    master = _store()
    store_set(master, f"gossipcomp/peer/{rank}/address", value)
    honest = [r for r in range(3) if r != rank]
    got = _in_threads(
        len(honest),
        lambda i: exchange_addresses(
            _client(master), honest[i], 3, f"127.0.0.1:{43000 + i}", 10.0, "s"
        ),
    )
    assert all(isinstance(error, RendezvousError) for error in got), got
    return got[0]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (b"h" * 100_000 + b":1", "rank 2 announced an address of 100002 bytes; expected"),
        (b"\xff\xfe:50100", "not ASCII"),
        (b"evil host:50100", "is not host:port"),
        (b"127.0.0.1:99999", "is not host:port"),
        (b"127.0.0.1", "is not host:port"),
        (b"[::1:50100", "is not host:port"),
    ],
)
def test_hostile_addresses_in_the_store_are_refused(value: bytes, said: str) -> None:
    message = str(_hostile(value))
    assert said in message and "rank 2" in message
    assert len(message) < 400  # never the whole value


def test_a_second_process_for_one_rank_is_refused() -> None:
    master = _store()
    store_set(master, "gossipcomp/peer/0/address", b"10.0.0.9:50100")
    with pytest.raises(RendezvousError) as caught:
        exchange_addresses(_client(master), 0, 2, "127.0.0.1:45000", 5.0, "s")
    message = str(caught.value)
    assert "rank 0 was already announced at b'10.0.0.9:50100' by another process" in message


def test_two_ranks_at_one_address_are_refused_by_the_topology() -> None:
    master = _store()
    got = _in_threads(
        2, lambda r: exchange_addresses(_client(master), r, 2, "127.0.0.1:44000", 5.0, "s")
    )
    two = topology_from_dict({"kind": "ring", "n": 2})
    with pytest.raises(TopologyError, match="duplicate address '127.0.0.1:44000' for ranks 0"):
        two.with_addresses(got[0])


ENV = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "RANK": "2", "WORLD_SIZE": "4"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "MASTER_ADDR": "node1", "MASTER_PORT": "29400"}


@pytest.mark.parametrize(
    ("url", "rank", "environ", "expected"),
    [
        ("env://", None, ENV, Launch("env", "10.1.2.3", 29500, 2, 4)),
        ("env://", 1, ENV, Launch("env", "10.1.2.3", 29500, 1, 4)),  # --rank over RANK
        ("tcp://h:7", None, ENV, Launch("tcp", "h", 7, 2, 4)),  # the URL's store over MASTER_*
        ("tcp://[::1]:7", 0, {}, Launch("tcp", "::1", 7, 0, 4)),  # world: the topology's n
        ("slurm", None, SLURM, Launch("slurm", "node1", 29400, 3, 4)),
        ("slurm://s:9", None, {**SLURM, "RANK": "0"}, Launch("slurm", "s", 9, 3, 4)),
        ("coordinator://h:7", None, ENV, Launch("coordinator", "h", 7, 2, 4)),  # RANK, WORLD_SIZE
        ("coordinator://[::1]:7", 3, {}, Launch("coordinator", "::1", 7, 3, 4)),  # world: n
    ],
)
def test_a_launch_takes_flags_over_the_environment(
    url: str, rank: int | None, environ: dict[str, str], expected: Launch
) -> None:
    assert parse_launch(url, rank, 4, environ) == expected


@pytest.mark.parametrize(
    ("url", "rank", "environ", "said"),
    [
        (
            "env://",
            None,
            {**ENV, "WORLD_SIZE": "8"},
            "WORLD_SIZE=8 (environment): the topology has 4",
        ),
        ("env://", None, {**ENV, "RANK": "7" * 60}, "RANK='777"),
        ("env://", None, {**ENV, "RANK": "-1"}, "RANK='-1' (environment): expected an integer"),
        ("env://", None, {"RANK": "0", "WORLD_SIZE": "4"}, "MASTER_ADDR/MASTER_PORT not both set"),
        ("env://", None, {**ENV, "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
        ("env://h:1", None, ENV, "env:// takes the store from MASTER_ADDR"),
        ("tcp://", 0, {}, "expected tcp://HOST:PORT"),
        ("tcp://h:0", 0, {}, "is not host:port"),
        ("udp://h:1", 0, {}, "expected env:// (torchrun), tcp://HOST:PORT, slurm"),
        ("coordinator://", 0, {}, "'coordinator://': expected coordinator://HOST:PORT, the store"),
        ("coordinator", 0, {}, "'coordinator': expected coordinator://HOST:PORT, the store"),
        ("coordinator://h", 0, {}, "the store's address 'h' is not host:port"),
        ("coordinator://h:0", 0, {}, "the store's address 'h:0' is not host:port"),
        ("coordinator://h:99999", 0, {}, "the store's address 'h:99999' is not host:port"),
        ("coordinator://h:1/x", 0, {}, "'coordinator://h:1/x': expected env:// (torchrun)"),
        ("coordinator://h:1?a=b", 0, {}, "'coordinator://h:1?a=b': expected env:// (torchrun)"),
        ("coordinator://h:1", None, {}, "no --rank given and RANK not set"),
        ("coordinator://h:1", None, {"RANK": "x1"}, "RANK='x1' (environment): expected"),
        ("coordinator://h:1", 0, {"WORLD_SIZE": "5"}, "WORLD_SIZE=5 (environment): the topology"),
        ("coordinator://h:1", 9, {}, "rank 9: the topology has ranks 0 to 3"),
        ("coordinator://" + "h" * 10_000 + ":1", 0, {}, "characters)"),
        ("slurm", None, {"SLURM_PROCID": "0", **ENV}, "SLURM_NTASKS is not set"),
        ("tcp://h:1", 4, {}, "rank 4: the topology has ranks 0 to 3"),
        ("x" * 10_000, 0, {}, "characters)"),
    ],
)
def test_bad_launches_are_refused_naming_the_value(
    url: str, rank: int | None, environ: dict[str, str], said: str
) -> None:
    with pytest.raises(ValueError) as caught:
        parse_launch(url, rank, 4, environ)
    assert said in str(caught.value) and len(str(caught.value)) < 400


def test_a_reserved_port_is_taken_by_the_peer_server_and_by_no_one_else() -> None:
    with reserved_port("127.0.0.1", 0) as port:
        intruder = socket.socket()
        with pytest.raises(OSError):
            intruder.bind(("127.0.0.1", port))
        intruder.close()
        transport = GrpcTransport(Identity(0, "h", "s"), [1], bind=f"127.0.0.1:{port}")
        try:
            assert transport.address == f"127.0.0.1:{port}"
        finally:
            transport.close()


def test_a_port_a_server_already_serves_is_not_held_twice() -> None:
    """gRPC's server sets SO_REUSEPORT: a holder that set it alone would share its port."""
    serving = GrpcTransport(Identity(0, "h", "s"), [1], bind="127.0.0.1:0")
    try:
        port = int(serving.address.rpartition(":")[2])
        with pytest.raises(RendezvousError, match=f"cannot bind 127.0.0.1:{port} for this peer"):
            with reserved_port("127.0.0.1", port):
                pass
    finally:
        serving.close()


def test_an_overlong_advertised_host_is_refused_before_it_is_announced() -> None:
    master = _store()
    with pytest.raises(RendezvousError, match="longer than 262 bytes; expected a shorter"):
        exchange_addresses(_client(master), 0, 2, "h" * 300 + ":1", 5.0, "s")
    assert not master.check(["gossipcomp/peer/0/address"])


def _handshaken(
    base: Topology, launch: Launch, all_connected: threading.Barrier
) -> tuple[Topology, str, Any, str, dict[int, Any]]:
    """One rank's rendezvous, then a gRPC server at the announced address handshaking with its
    neighbours; the server stays up until every rank passed `all_connected` (one that closed
    early would refuse a slower neighbour). Returns the topology, the bound address, the late
    address source, the address the server reports and the neighbours' answers."""
    with rendezvous_topology(base, launch, "127.0.0.1:0", None, 60.0) as rendezvoused:
        topology, bound, late = rendezvoused
        identity = Identity(launch.rank, topology.hash, "model")
        transport = GrpcTransport(identity, topology.neighbors(launch.rank), bind=bound)
        try:
            neighbours = {j: topology.addresses[j] for j in topology.neighbors(launch.rank)}
            answers = transport.connect(neighbours, timeout=60.0)
            all_connected.wait()
        except BaseException:
            all_connected.abort()
            raise
        finally:
            transport.close()
    return topology, bound, late, transport.address, answers


def test_peers_rendezvous_through_torch_and_handshake_over_grpc() -> None:
    """Four ranks in threads: torch's tcp:// rendezvous (rank 0 hosts the store), each holds a
    free port, and the topologies they build agree (hash and addresses), so their gRPC servers,
    bound at the announced ports, accept each other's handshakes."""
    (endpoint_port,) = benchmark("faults").free_ports(1)
    base = topology_from_dict(RING4)
    # A peer that closed its server once its own handshakes were done would refuse a slower
    # neighbour's; every server stays up until all four are done.
    all_connected = threading.Barrier(4, timeout=120.0)

    def peer(rank: int) -> tuple[Topology, str, dict[int, Any]]:
        launch = Launch("tcp", "127.0.0.1", endpoint_port, rank, 4)
        topology, bound, _, served_at, answers = _handshaken(base, launch, all_connected)
        assert served_at == topology.addresses[rank] == bound
        return topology, bound, answers

    got = _in_threads(4, peer)
    for result in got:
        assert not isinstance(result, Exception), result
    topologies = [topology for topology, _, _ in got]
    assert len({t.hash for t in topologies}) == 1
    assert topologies[0].addresses == tuple(bound for _, bound, _ in got)
    assert all(sorted(answers) == t.neighbors(r) for r, (t, _, answers) in enumerate(got))


@pytest.mark.parametrize(
    ("arguments", "environ", "said"),
    [
        (["--advertise", "h"], {}, "--advertise: expected --rendezvous with it"),
        (["--rendezvous", "env://"], {**ENV, "WORLD_SIZE": "3"}, "WORLD_SIZE=3 (environment)"),
        (["--rendezvous", "tcp://127.0.0.1:9", "--bind", "h"], {}, "--bind 'h': expected HOST"),
        (["--rendezvous", "tcp://127.0.0.1:{port}", "--rank", "1"], {}, "rank 1: rendezvous "
         "store at 127.0.0.1:{port} not reached by all 4 ranks within 2 s"),
    ],
)  # fmt: skip
def test_the_peer_command_names_a_failed_rendezvous_in_one_line(
    arguments: list[str],
    environ: dict[str, str],
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every mistake exits with status 2 before training, the rank with no store after the
    --startup-timeout bound."""
    (port,) = benchmark("faults").free_ports(1)  # nobody hosts a store there
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "ring4.yaml").write_text("kind: ring\nn: 4\n")
    argv = ["peer", "--topology", str(tmp_path / "ring4.yaml"), "--startup-timeout", "2"]
    argv += [a.format(port=port) for a in arguments] + ["--dataset", "iris", "--quiet"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said.format(port=port) in lines[0], lines


def test_four_peer_processes_started_by_torchrun_write_their_own_reports(tmp_path: Path) -> None:
    """torchrun's c10d rendezvous (--standalone: its store on a free local port) starts four
    `gossipcomp peer` processes from one command line and a file with no address in it; each
    finds its neighbours through the store, trains, and writes its own report."""
    (tmp_path / "ring4.yaml").write_text("name: ring4\nkind: ring\nn: 4\n")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", "gossipcomp", "peer", "--topology", "ring4.yaml", "--rendezvous", "env://",
        "--dataset", "iris", "--rounds", "4", "--eval-every", "0", "--round-timeout", "20",
        "--startup-timeout", "150", "--quiet", "--report", "report.json",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, timeout=240, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "report.json").exists()
    for rank in range(4):
        report = json.loads((tmp_path / f"report.rank{rank}.json").read_text())
        (mine,) = report["per_peer"]
        assert mine["rank"] == rank and report["rounds"] == 4
        assert mine["failed_exchanges"] == 0 and mine["bytes_received"] > 0


def _connects(port: int) -> bool:
    """Whether a store client reaches a store at 127.0.0.1:`port` within a second or two."""
    try:
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=1))
    except RuntimeError:  # torch's DistNetworkError: nobody serves there
        return False
    client.set("probe", "1")
    return client.get("probe") == b"1"


def test_the_coordinator_s_registry_serves_until_it_is_closed() -> None:
    """The coordinator's side (`Registry`): a store on a free port (port 0), its URL naming the
    port it got, readable by any client, and gone once closed; a taken port is refused."""
    registry = Registry("127.0.0.1:0")
    launch = parse_launch(registry.url, 0, 4, {})
    assert launch.scheme == "coordinator" and launch.host == "127.0.0.1" and launch.port > 0
    try:
        assert _connects(launch.port)
        with pytest.raises(RendezvousError, match="--registry '127.0.0.1:.*cannot host the"):
            Registry(f"127.0.0.1:{launch.port}")
    finally:
        registry.close()
    assert not _connects(launch.port)


@pytest.mark.parametrize(
    "address",
    ["h", "h:", ":1", "h:-1", "h:65536", "h:123456", "h:\u00b2", "::1:5", "[]:5", "h h:1",
     "h\u00e9:1", "[::1]x:5", "h" * 10_000 + ":1", 5],
)  # fmt: skip
def test_hostile_registry_addresses_are_refused_naming_the_value(address: object) -> None:
    with pytest.raises(ValueError) as caught:
        registry_endpoint(address)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith(f"--registry {quoted(address)}: expected HOST:PORT")
    assert len(message) < 400


def test_a_peer_without_the_coordinator_s_registry_says_so() -> None:
    (port,) = benchmark("faults").free_ports(1)  # nobody hosts a store there
    launch = parse_launch(f"coordinator://127.0.0.1:{port}", 1, 4, {})
    with pytest.raises(RendezvousError) as caught:
        open_store(launch, 1.0)
    assert f"rank 1: the coordinator's registry at 127.0.0.1:{port} not reached within 1 s" in (
        str(caught.value)
    )
    assert f"expected a coordinator started with --registry 127.0.0.1:{port}" in str(caught.value)


def test_peers_rendezvous_through_the_coordinator_s_registry_and_handshake_over_grpc() -> None:
    """The coordinator's side hosts the store in this thread; four ranks in threads, every one
    a client of it (coordinator://), build the same topology and their gRPC servers, bound at
    the announced ports, accept each other's handshakes."""
    base = topology_from_dict(RING4)
    all_connected = threading.Barrier(4, timeout=120.0)  # every server up until all are done

    def peer(rank: int) -> tuple[Topology, str, dict[int, Any]]:
        launch = parse_launch(registry.url, rank, 4, {})
        topology, bound, late, _, answers = _handshaken(base, launch, all_connected)
        assert late is None  # a fixed topology: every address known at start
        return topology, bound, answers

    with Registry("127.0.0.1:0") as registry:
        got = _in_threads(4, peer)
        held = [_client_at(registry.url).get(f"gossipcomp/peer/{r}/address") for r in range(4)]
    for result in got:
        assert not isinstance(result, Exception), result
    topologies = [topology for topology, _, _ in got]
    assert len({t.hash for t in topologies}) == 1
    assert topologies[0].addresses == tuple(bound for _, bound, _ in got)
    assert held == [bound.encode() for _, bound, _ in got]  # the coordinator's store holds them
    assert all(sorted(answers) == t.neighbors(r) for r, (t, _, answers) in enumerate(got))


def _client_at(url: str) -> dist.TCPStore:
    launch = parse_launch(url, 0, 4, {})
    return dist.TCPStore(launch.host, launch.port, None, False, timedelta(seconds=30))


LIVE5 = {"name": "live5", "kind": "ring", "n": 5, "members": [0, 1, 2, 3]}


def test_rank_0_is_not_special_with_the_coordinator_s_registry() -> None:
    """Members 0-3 of a capacity-5 live ring meet in the coordinator's store; rank 0 closes its
    transport and leaves (with tcp:// it hosted the store, which went with it). A joiner, rank
    4, still announces itself there; the members left read its address, and rank 0's old one,
    from the store, and rank 3 handshakes with the joiner over gRPC at the address it read."""
    live = topology_from_dict(LIVE5)
    met = threading.Barrier(4, timeout=120.0)
    gone, joined, greeted = threading.Event(), threading.Event(), threading.Event()

    def member(rank: int) -> tuple[str | None, str | None, list[int]]:
        launch = parse_launch(registry.url, rank, 5, {"WORLD_SIZE": "4"}, live=True)
        with rendezvous_topology(live, launch, "127.0.0.1:0", None, 60.0) as rendezvoused:
            topology, bound, late = rendezvoused
            assert late is not None and topology.addresses[4] == "rank4.unresolved.invalid:1"
            identity = Identity(rank, topology.hash, "model")
            transport = GrpcTransport(identity, [4], bind=bound, address_source=late)
            try:
                met.wait()
                if rank == 0:
                    return None, None, []  # its transport and store client close on the way out
                assert gone.wait(120) and joined.wait(120)
                found, zero = late(4), late(0)
                answered = []
                if rank == 3 and found is not None:  # the joiner's neighbour on the ring
                    answered = sorted(transport.connect({4: found}, timeout=60.0))
                return found, zero, answered
            finally:
                transport.close()
                if rank == 0:
                    gone.set()
                if rank == 3:
                    greeted.set()

    with Registry("127.0.0.1:0") as registry, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(member, r) for r in range(4)]
        assert gone.wait(120), [f.exception() for f in futures if f.done()]
        futures[0].result(timeout=60)  # rank 0 left its rendezvous block too
        joiner = parse_launch(registry.url, 4, 5, {}, live=True)
        with rendezvous_topology(live, joiner, "127.0.0.1:0", None, 30.0, joining=True) as (
            topology,
            bound,
            _,
        ):
            transport = GrpcTransport(Identity(4, topology.hash, "model"), [3], bind=bound)
            try:
                joined.set()
                results = [future.result(timeout=120) for future in futures[1:]]
                assert greeted.wait(120)
            finally:
                transport.close()
    zero_address = topology.addresses[0]
    assert zero_address.startswith("127.0.0.1:")  # rank 0 had announced itself
    for found, zero, _ in results:
        assert found == bound and zero == zero_address
    assert results[2][2] == [4]  # rank 3 greeted the joiner


@pytest.mark.parametrize(
    ("address", "expected"),
    [("h:0", ("h", 0)), ("node1.example:29400", ("node1.example", 29400)), ("[::1]:7", ("::1", 7))],
)
def test_a_registry_address_may_name_any_free_port(address: str, expected: tuple) -> None:
    assert registry_endpoint(address) == expected


def test_the_coordinator_command_hosts_the_registry_until_it_is_terminated(tmp_path: Path) -> None:
    """`gossipcomp coordinator --registry` prints the URL peers start with; a store client
    sets and gets a key there while it runs; SIGTERM stops it cleanly (status 0), and the
    store with it."""
    registry_port, address_port = benchmark("faults").free_ports(2)
    command = [
        sys.executable, "-m", "gossipcomp", "coordinator", "--topology", "ring4",
        "--address", f"127.0.0.1:{address_port}", "--registry", f"127.0.0.1:{registry_port}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "500", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env
    )
    try:
        assert process.stdout is not None
        seen = ""
        deadline = time.monotonic() + 240
        while "registry:" not in seen and process.poll() is None and time.monotonic() < deadline:
            seen += process.stdout.readline()
        url = f"coordinator://127.0.0.1:{registry_port}"
        assert f"registry: peers start with --rendezvous {url}" in seen, seen
        client = _client_at(url)
        client.set("gossipcomp/peer/0/address", "127.0.0.1:1234")
        assert _client_at(url).get("gossipcomp/peer/0/address") == b"127.0.0.1:1234"
        del client
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, seen + rest
    assert "terminated (SIGTERM); stopped serving" in " ".join(rest.split())
    assert not _connects(registry_port)


def test_the_coordinator_command_refuses_a_bad_registry_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["coordinator", "--topology", "ring4", "--registry", "127.0.0.1:99999"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--registry '127.0.0.1:99999': expected HOST:PORT" in lines[0]
