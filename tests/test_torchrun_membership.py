"""A live network started by torchrun with no address in its file (issue 27, parts 2 and 3):
torchrun's c10d rendezvous starts four `gossipcomp peer` processes on a live ring of capacity
5 (members 0-3) with a coordinator; a fifth process, outside torchrun, finds the others in the
same store (`--rendezvous tcp://` at the store the members print, its own --rank, --join) and
is admitted; then one member's process is killed for good and the coordinator removes it after
--member-timeout. Every report and checkpoint left agrees: the rounds done, the joiner's
admission and the leaver's removal in the schedules each survivor holds, one model among them.

torchrun tears down every worker when one fails, so each worker is a thin wrapper around its
`gossipcomp peer` process (the launch's rank is the peer's): the leaver's wrapper SIGKILLs its
peer when the test says so and exits cleanly, as a machine that vanishes would look to the
others while torchrun's agent keeps the rest running."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import benchmark, store_set

from gossipcomp.rendezvous import (
    Launch,
    RendezvousError,
    StoreAddresses,
    exchange_addresses,
    parse_launch,
    rendezvous_topology,
)
from gossipcomp.topology import topology_from_dict
from gossipcomp.transport.base import Greeting, Identity
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcTransport
from gossipcomp.workload.checkpoint import CheckpointStore

ROOT = Path(__file__).resolve().parents[1]
LEAVER = 2
JOINER = 4
# the network must outlast the joiner's admission and the leaver's removal (an 8 s member
# timeout after the kill): on a fast machine 800 rounds ended first ("a process ended"), and
# 2400 once each edge's envelopes went on one open stream (the removal's round came after the
# last round)
ROUNDS = 4800
WRAPPER = """\
import os, subprocess, sys, time
from pathlib import Path

if os.environ["RANK"] == "0":  # the store torchrun gave the workers, for the test's joiner
    Path("store.tmp").write_text(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    Path("store.tmp").rename("store")
peer = subprocess.Popen([sys.executable, "-m", "gossipcomp", "peer", *sys.argv[1:]])
if os.environ["RANK"] == os.environ["LEAVER"]:
    while not Path("leave").exists() and peer.poll() is None:
        time.sleep(0.05)
    if peer.poll() is None:
        peer.kill()
        peer.wait()
        Path("left").write_text("killed")
        sys.exit(0)
sys.exit(peer.wait())
"""


LIVE5 = {"name": "live5", "kind": "ring", "n": 5, "members": [0, 1, 2, 3]}
KEY = "gossipcomp/peer/{rank}/address"


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)


def _client(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))


def test_a_launch_of_a_live_topology_may_start_fewer_ranks_than_its_capacity() -> None:
    """torchrun starts the initial members (WORLD_SIZE 4) of a capacity-5 network; a world
    over the capacity, or a rank outside it, is still refused naming the value."""
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4"}
    assert parse_launch("env://", None, 5, env, live=True) == Launch("env", "h", 29500, 3, 4)
    assert parse_launch("tcp://h:1", 4, 5, {}, live=True) == Launch("tcp", "h", 1, 4, 5)
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .environment.: the topology has 5"):
        parse_launch("env://", None, 5, env)  # a fixed topology: one process per rank
    with pytest.raises(ValueError, match="WORLD_SIZE=6 .environment.: the live topology's capac"):
        parse_launch("env://", None, 5, {**env, "WORLD_SIZE": "6"}, live=True)
    with pytest.raises(ValueError, match="rank 5: the topology has ranks 0 to 4"):
        parse_launch("tcp://h:1", 5, 5, {}, live=True)


def test_the_initial_members_rendezvous_without_waiting_for_a_joiner() -> None:
    """Members 0-3 of a capacity-5 live ring wait for each other only: rank 4 stands at an
    unresolvable name until it announces itself, and is then read from the store."""
    (port,) = benchmark("faults").free_ports(1)
    live = topology_from_dict(LIVE5)

    def member(rank: int) -> tuple[tuple[str, ...], str | None, str | None]:
        launch = Launch("tcp", "127.0.0.1", port, rank, 4)
        with rendezvous_topology(live, launch, "127.0.0.1:0", None, 60.0) as (topology, _, late):
            assert late is not None
            before = late(4)
            barrier.wait(timeout=60)  # every member holds its store until the joiner came
            joined.wait(timeout=60)
            after = late(4)
            looked.wait(timeout=60)  # rank 0 hosts the store: it stays until all looked
            return topology.addresses, before, after

    barrier, looked, joined = threading.Barrier(5), threading.Barrier(4), threading.Event()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(member, r) for r in range(4)]
        barrier.wait(timeout=60)
        joiner = Launch("tcp", "127.0.0.1", port, 4, 5)
        with rendezvous_topology(live, joiner, "127.0.0.1:0", None, 10.0, joining=True) as (
            topology,
            bound,
            _,
        ):
            joined.set()
            results = [future.result(timeout=60) for future in futures]
    assert topology.addresses[4] == bound and topology.addresses[:4] == results[0][0][:4]
    for addresses, before, after in results:
        assert addresses[4] == "rank4.unresolved.invalid:1" and before is None
        assert after == bound


def test_a_joiner_replaces_its_rank_s_announcement_and_a_fresh_start_may_not() -> None:
    master = _store()
    store_set(master, KEY.format(rank=4), b"127.0.0.1:40004")  # rank 4's process before it left
    with pytest.raises(RendezvousError, match="rank 4 was already announced at b'127.0.0.1:400"):
        exchange_addresses(_client(master), 4, 5, "127.0.0.1:40014", 5.0, "s", ())
    got = exchange_addresses(_client(master), 4, 5, "127.0.0.1:40014", 5.0, "s", (), rejoin=True)
    assert got == (None, None, None, None, "127.0.0.1:40014")


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (b"h" * 100_000 + b":1", "rank 4 announced an address of 100002 bytes"),
        (b"\xff\xfe:50100", "not ASCII"),
        (b"evil host:50100", "is not host:port"),
        (b"127.0.0.1:0", "is not host:port"),
    ],
)
def test_hostile_late_addresses_are_warned_about_once_and_never_used(
    value: bytes, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    master = _store()
    late = StoreAddresses(_client(master), 5, "s")
    assert late(4) is None  # nothing announced yet
    store_set(master, KEY.format(rank=4), value)
    with caplog.at_level(logging.WARNING, logger="gossipcomp.peer"):
        assert [late(4) for _ in range(3)] == [None] * 3
    (record,) = caplog.records
    assert said in record.getMessage() and len(record.getMessage()) < 400
    store_set(master, KEY.format(rank=4), b"127.0.0.1:40004")  # announced again, well formed
    assert late(4) == "127.0.0.1:40004"


def test_late_look_ups_are_bounded_to_the_capacity_and_in_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    master = _store()
    late = StoreAddresses(_client(master), 5, "s")
    for rank in (5, -1, True, "4"):
        with pytest.raises(ValueError, match=r"^s: rank: expected an integer in \[0, 4\], got "):
            late(rank)  # type: ignore[arg-type]
    store_set(master, KEY.format(rank=1), b"127.0.0.1:40001")
    assert late(1) == "127.0.0.1:40001"
    del master  # the store's host is gone: a look-up answers None within its bound
    gc.collect()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gossipcomp.peer"):
        assert late(1) is None and late(1) is None
    assert time.monotonic() - started < 10
    (record,) = caplog.records  # said once until the store answers again
    assert "no answer looking up rank 1" in record.getMessage()


def test_a_transport_probes_a_neighbour_at_the_address_announced_after_connect() -> None:
    """The member connected while rank 1 stood at an unresolvable name (not greeted, as on a
    live topology); once the source gives rank 1's address its probe reaches rank 1's server.
    Without the source the channel stays at the name it was given and the probe fails."""
    joiner = GrpcTransport(Identity(1, "h", "m"), [0])
    announced: dict[int, str] = {}
    follows = GrpcTransport(Identity(0, "h", "m"), [1], address_source=announced.get)
    stays = GrpcTransport(Identity(0, "h", "m"), [1])
    try:
        for member in (follows, stays):
            member.connect({1: "rank1.unresolved.invalid:1"}, 10.0, Greeting(among=frozenset()))
        with pytest.raises(Exception):  # noqa: B017 - the name never resolves
            follows.probe(1, 0, 0, False).result(timeout=30)
        announced[1] = joiner.address
        assert follows.probe(1, 0, 0, False).result(timeout=30).round == 0
        with pytest.raises(Exception):  # noqa: B017
            stays.probe(1, 0, 0, False).result(timeout=30)
    finally:
        for transport in (joiner, follows, stays):
            transport.close()


def test_a_push_goes_to_the_address_announced_after_connect() -> None:
    """A joiner connected before the members announced themselves, and its edge to member 0
    came up by the member's probe, not its own: its first push goes to the address the source
    names now, not the unresolvable stand-in (a push there failed with UNAVAILABLE)."""
    member = GrpcTransport(Identity(0, "h", "m"), [1])
    joiner = GrpcTransport(Identity(1, "h", "m"), [0], address_source={0: member.address}.get)
    spec = (tensor_spec("w", torch.zeros(3)),)
    try:
        member.connect({1: joiner.address}, 10.0, Greeting(among=frozenset()))
        joiner.connect({0: "rank0.unresolved.invalid:1"}, 10.0, Greeting(among=frozenset()))
        for transport in (member, joiner):
            transport.inbox.expect("p", spec)
        payload = (encode_raw("w", torch.tensor([1.0, 2.0, 3.0])),)
        with ThreadPoolExecutor(2) as pool:
            to_member = pool.submit(joiner.exchange, 0, "p", {0: payload}, 30.0)
            to_joiner = pool.submit(member.exchange, 0, "p", {1: payload}, 30.0)
            sent, received = to_member.result(timeout=60), to_joiner.result(timeout=60)
        assert sent.failed == {} and received.failed == {}, (sent.failed, received.failed)
        assert torch.equal(
            decode_raw(received.received[1].tensor("w")), torch.tensor([1.0, 2.0, 3.0])
        )
    finally:
        joiner.close()
        member.close()


class Process:
    """A process of the test in its own process group (torchrun's workers and their peers
    included, so none outlives the test), its stderr read line by line into a log file."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], log: str) -> None:
        self.log = cwd / log
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            command, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        with self.log.open("w") as out:
            for line in self.process.stderr:
                self.lines.append(line)
                out.write(line)
                out.flush()

    def text(self) -> str:
        return " ".join("".join(self.lines).split())

    def wait_for(
        self,
        found: Callable[[str], object],
        seconds: float,
        what: str,
        running: Sequence[Process] = (),
    ) -> object:
        """What `found` returns from this process's log once true; AssertionError at the
        deadline, or as soon as this process or one of `running` has ended."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            result = found(self.text())
            if result:
                return result
            ended = [p for p in (self, *running) if p.process.poll() is not None]
            if ended:
                logs = " | ".join(p.text()[-3000:] for p in ended)
                raise AssertionError(f"waiting for {what}, a process ended: {logs}")
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {seconds:g} s: {self.text()[-3000:]}")

    def finish(self, seconds: float) -> int:
        """Its exit status, waiting at most `seconds`."""
        status = self.process.wait(timeout=seconds)
        self._thread.join(timeout=30)
        return status

    def end(self) -> None:
        """Stops it and everything it started, if still running."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its children, even once it ended
        except ProcessLookupError:
            pass


def _members(log: str) -> list[tuple[list[int], list[int], list[int]]]:
    """The coordinator's membership changes: (members after, removed, admitted) each."""
    changes = re.findall(
        r"members \[([\d, ]*)\] -> \[([\d, ]*)\] \(removed: \[([\d, ]*)\]; admitted: \[([\d, ]*)\]\)",
        log,
    )
    ranks = lambda text: [int(r) for r in text.replace(",", " ").split()]  # noqa: E731
    return [
        (ranks(after), ranks(removed), ranks(admitted)) for _, after, removed, admitted in changes
    ]


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def test_a_torchrun_network_admits_a_joiner_and_removes_a_leaver(tmp_path: Path) -> None:
    """The coordinator admits the joiner and, once the leaver is killed, removes it; the four
    survivors finish every round with one model, their last checkpoints at the last round."""
    started = time.monotonic()
    coordinator_port, rdzv_port = benchmark("faults").free_ports(2)
    (tmp_path / "live.yaml").write_text("name: live5\nkind: ring\nn: 5\nmembers: [0, 1, 2, 3]\n")
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    address = f"127.0.0.1:{coordinator_port}"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "500",
        "LEAVER": str(LEAVER),
    }
    common = ["--topology", "live.yaml", "--algorithm", "dpsgd", "--dataset", "iris"]
    common += ["--rounds", str(ROUNDS), "--eval-every", "0", "--round-timeout", "3"]
    common += ["--startup-timeout", "150", "--coordinator", address, "--report-every", "2"]
    common += ["--checkpoint-dir", "checkpoints", "--checkpoint-every", "50", "--quiet"]
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}",
        "--max-restarts", "0", "wrapper.py", *common, "--rendezvous", "env://",
        "--report", "report.json",
    ]  # fmt: skip
    processes = [Process(launch, tmp_path, env, "launch.log")]
    try:
        torchrun = processes[0]
        # the joiner starts with the members (it takes as long to start), at the store their
        # launch has; each member prints that store for joiners once it holds the addresses
        store = torchrun.wait_for(lambda _: _read(tmp_path / "store"), 150, "torchrun's store")
        joining = [*common, "--join", "--rendezvous", f"tcp://{store}", "--rank", str(JOINER)]
        joiner = Process(
            [sys.executable, "-m", "gossipcomp", "peer", *joining]
            + ["--report", f"report.rank{JOINER}.json"],
            tmp_path,
            env,
            "joiner.log",
        )
        processes.append(joiner)
        torchrun.wait_for(
            lambda text: text.count(f"rendezvous store at {store}; a rank joins with") == 4,
            150,
            "the members' rendezvous",
        )
        # the members run; the coordinator starts now, so none is silent for its start-up
        coordinator = Process(
            [sys.executable, "-m", "gossipcomp", "coordinator", "--topology", "live.yaml"]
            + ["--address", address, "--report-every", "2", "--member-timeout", "8"],
            tmp_path,
            env,
            "coordinator.log",
        )
        processes.append(coordinator)
        coordinator.wait_for(
            lambda text: f"admitted: [{JOINER}]" in text,
            150,
            "admission of the joiner",
            [torchrun, joiner],
        )
        (tmp_path / "leave").write_text("now")  # the leaver's wrapper kills its peer
        coordinator.wait_for(
            lambda text: f"removed: [{LEAVER}]" in text,
            150,
            "removal of the leaver",
            [torchrun, joiner],
        )
        assert torchrun.process.poll() is None, "the members finished before the removal"
        for process in (torchrun, joiner):
            assert process.finish(300) == 0, process.text()[-3000:]
    finally:
        for process in reversed(processes):
            process.end()
    took = time.monotonic() - started
    print(f"the torchrun network with a joiner and a leaver took {took:.1f} s")
    assert (tmp_path / "left").read_text() == "killed"

    # the coordinator: the joiner admitted, then the leaver removed; afterwards at most the
    # removal of survivors that had finished their rounds (they stop reporting, and the last
    # to finish may still be writing its report), never another admission
    changes = _members(coordinator.text())
    expected = [([0, 1, 2, 3, 4], [], [4]), ([0, 1, 3, 4], [2], [])]
    assert changes[:2] == expected, coordinator.text()
    assert all(not admitted for _, _, admitted in changes[2:]), coordinator.text()

    survivors = [r for r in range(5) if r != LEAVER]
    reports = {r: json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in survivors}
    assert not (tmp_path / f"report.rank{LEAVER}.json").exists()
    for rank, report in reports.items():
        (mine,) = report["per_peer"]
        assert mine["rank"] == rank and report["gossip_rounds"] == ROUNDS
        assert report["final_test_accuracy"] > 0.8
    # the survivors agree on the round of every schedule they both hold (a peer may skip one
    # that a newer one replaced before its round), except that one which reached a peer after
    # its round (rounds of milliseconds, a busy machine, a peer alone and ahead) is in force
    # there from the peer's next round, later than at the others; they end on the same one;
    # the joiner holds none from before its admission but epoch 0, and every survivor holds
    # the admission and the removal (CI at stop 43: a member ahead of every republication of
    # the removal finished under the members before it)
    held = {
        r: {s["epoch"]: (s["effective_round"], s["late"]) for s in report["schedule_epochs"]}
        for r, report in reports.items()
    }
    held = {r: {e: v for e, v in h.items() if v[0] < ROUNDS} for r, h in held.items()}
    for a in survivors:
        for b in survivors:
            for epoch in held[a].keys() & held[b].keys():
                (at_a, late_a), (at_b, late_b) = held[a][epoch], held[b][epoch]
                assert at_a == at_b or (late_a and at_a > at_b) or (late_b and at_b > at_a), held
    assert len({max(h) for h in held.values()}) == 1, held
    admission = min(held[JOINER].keys() - {0})
    removal = min(e for e in held[0] if e > admission)
    assert all({admission, removal} <= set(h) for h in held.values()), held
    # one model: the survivors' network averages agree
    norms = [report["average_model_norm"] for report in reports.values()]
    assert max(norms) - min(norms) < 1e-3 * max(norms), norms
    # each survivor's newest checkpoint is its last round, with the members in force there
    # (the joiner in, the leaver out) and a model within a hair of the others'; the leaver's
    # stop where it was killed
    norms = []
    for rank in survivors:
        loaded = CheckpointStore(tmp_path / "checkpoints", rank).load_latest()
        assert loaded is not None and loaded.round == ROUNDS
        state = loaded.state["peer"]
        assert state["schedules"]["current"]["members"] == survivors, state["schedules"]
        model = torch.cat([p.flatten().double() for p in state["model"].values()])
        norms.append(float(model.norm()))
    assert max(norms) - min(norms) < 1e-3 * max(norms), norms
    left = CheckpointStore(tmp_path / "checkpoints", LEAVER).load_latest()
    assert left is None or left.round < ROUNDS
