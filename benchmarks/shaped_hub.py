"""gloo ranks behind rate-limited NICs: one network namespace per rank, a bridge in a hub
namespace, and `tc` (tbf) on both ends of each rank's veth to the bridge.

Every rank has one interface, `hub` (GLOO_SOCKET_IFNAME names it; jumbo frames, MTU_BYTES),
addressed 10.81.0.<r+1>/24, whose egress (what the rank sends) and whose bridge port's egress
(what it receives) are each limited to `mbit`: a NIC of `mbit` Mbit/s in each direction, as on
a machine whose network card (not the path between two machines) is what binds. The rendezvous
store is rank 0's, over the same shaped links (heartbeats are a few bytes a second). Namespaces
are named `gch<pid>n<serial>p<rank>` and `...h` for the hub; leaving (or SIGTERM, Ctrl-C,
interpreter exit) deletes them with every process inside, and a network of this kind whose
process is gone (SIGKILL) is deleted by the next one built (shaped_links.Namespaces does all of
that).

`run_ranks(hub, fn, args)` is `gossipcomp.allreduce.launch.spawn` for ranks in namespaces:
fn(session, *args) in each rank's namespace (the child enters it with setns(2) before it opens
any socket), results in rank order, a failed or late rank ending all of them with LaunchError.

Needs root on Linux with iproute2 and tc (shaped_links.check_available says what is missing).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import queue
import re
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from shaped_links import (
    Namespaces,
    NamespacesUnavailable,
    _command,
    _ip,
    _tbf,
    check_mbit,
)

from gossipcomp.allreduce.launch import LaunchError, init_from_env

PREFIX = "gch"
NAME_PATTERN = re.compile(rf"^{PREFIX}(\d+)n\d+(?:p\d+|h)$")
DEVICE = "hub"  # each rank's interface, the one gloo uses
BRIDGE = "br0"
SUBNET = "10.81.0"
STORE_PORT = 29500  # rank 0's rendezvous store, inside its own namespace
MAX_RANKS = 16
# each tbf's queue: a NIC that sends slower than its host writes backs the sender up, it does
# not drop what its own host sent. The kernel keeps at most tcp_limit_output_bytes (4 MiB by
# default) of a socket in the qdisc, so a queue above that never drops. With tbf's 50 ms queue
# (shaped_links) TCP dropped about 1% of a rank's segments at 14.5 Mbit/s and its loss probes
# and retransmits stalled whole steps: one configuration's median step 391 ms in one repeat,
# 156-172 ms in the others (benchmarks/allreduce_merge.py, top-1%, docs/benchmarks.md)
NIC_QUEUE_BYTES = 8 << 20
# jumbo frames, as on the cluster networks where communication is what binds: the ranks share
# the machine's cores, and at 1500 bytes a frame the kernel's per-packet work for identity's
# 366 Mbit/s ran on the backward's core (planned groups over one: 1.02 at 1500, 1.10 at 9000,
# docs/benchmarks.md)
MTU_BYTES = 9000
FRAME_BYTES = MTU_BYTES + 1024  # what tbf must let through whole: a frame and its headers
CLONE_NEWNET = 0x40000000
POLL_S = 0.2

__all__ = ["NamespacesUnavailable", "ShapedHub", "run_ranks"]


class ShapedHub(Namespaces):
    """`n` ranks, each with a NIC of `mbit` Mbit/s each way to a shared bridge (docstring).
    A context manager: built on entering, torn down on leaving (shaped_links.Namespaces)."""

    PREFIX = PREFIX
    NAME_PATTERN = NAME_PATTERN

    def __init__(self, n: int, mbit: float) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_RANKS:
            raise ValueError(f"ranks: expected 2 to {MAX_RANKS}, got {n!r}")
        super().__init__(n)
        self.mbit = check_mbit(mbit, "link rate")

    @property
    def hub(self) -> str:
        return f"{self._prefix}h"

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def _build(self) -> None:
        self._add_namespace(self.hub)
        _ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.hub, "link", "set", BRIDGE, "up")
        for rank in range(self.n):
            name, port = self.namespace(rank), f"r{rank}"
            self._add_namespace(name)
            _ip("link", "add", DEVICE, "netns", name, "type", "veth", "peer", "name", port,
                "netns", self.hub)  # fmt: skip
            _ip("-n", name, "addr", "add", f"{self.address(rank)}/24", "dev", DEVICE)
            _ip("-n", name, "link", "set", DEVICE, "mtu", str(MTU_BYTES))
            _ip("-n", self.hub, "link", "set", port, "mtu", str(MTU_BYTES))
            _ip("-n", name, "link", "set", DEVICE, "up")
            _ip("-n", self.hub, "link", "set", port, "master", BRIDGE)
            _ip("-n", self.hub, "link", "set", port, "up")
            self._tc(name, "add", DEVICE, self.mbit)
            self._tc(self.hub, "add", port, self.mbit)
        _ip("-n", self.hub, "link", "set", BRIDGE, "mtu", str(MTU_BYTES))

    def _tc(self, namespace: str, verb: str, device: str, mbit: float) -> None:
        _command(["ip", "netns", "exec", namespace, "tc", "qdisc", verb, "dev", device, "root",
                  *_tbf(mbit, NIC_QUEUE_BYTES, FRAME_BYTES)])  # fmt: skip

    def set_rate(self, mbit: float) -> None:
        """Every rank's NIC to `mbit` Mbit/s each way, now (`tc qdisc change`)."""
        mbit = check_mbit(mbit, "link rate")
        for rank in range(self.n):
            self._tc(self.namespace(rank), "change", DEVICE, mbit)
            self._tc(self.hub, "change", f"r{rank}", mbit)
        self.mbit = mbit

    def qdisc(self, rank: int) -> str:
        """What `tc qdisc show` says about rank `rank`'s NIC (for records)."""
        shown = _command(["ip", "netns", "exec", self.namespace(rank), "tc", "qdisc", "show",
                          "dev", DEVICE])  # fmt: skip
        return " ".join(shown.stdout.split())


def _enter_namespace(name: str) -> None:
    """Move this thread (and the threads it starts later) into network namespace `name`."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


def _child(
    namespace: str,
    rank: int,
    nproc: int,
    master: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    session = None
    try:
        _enter_namespace(namespace)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            MASTER_ADDR=master,
            MASTER_PORT=str(STORE_PORT),
            GLOO_SOCKET_IFNAME=DEVICE,
        )
        torch.set_num_threads(1)  # the ranks share the cores
        session = init_from_env(timeout_s, backend="gloo")
        with session.guard():
            value = fn(session, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as error:  # reported to the launcher, which raises
        results.put((rank, False, f"{type(error).__name__}: {traceback.format_exc(limit=6)}"))
    finally:
        if session is not None:
            session.liveness.stop()


def run_ranks(
    hub: ShapedHub,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = 60.0,
    deadline_s: float = 1800.0,
) -> list[Any]:
    """fn(session, *args) on ranks 0..hub.n-1, each in its namespace; results in rank order.

    A rank that fails ends the others (SIGKILL after the collectives' timeout and a margin, so
    a rank blocked in a collective is not waited for), and so does the deadline."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=_child,
            args=(hub.namespace(r), r, hub.n, hub.address(0), timeout_s, fn, args, results),
            name=f"gossipcomp-hub-rank{r}",
            daemon=True,
        )
        for r in range(hub.n)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    end = time.monotonic() + deadline_s
    failed_at: float | None = None
    try:
        while len(outcomes) < hub.n:
            try:
                rank, ok, value = results.get(timeout=POLL_S)
                outcomes[rank] = (ok, pickle.loads(value) if ok else value)
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            for rank, process in enumerate(processes):
                if rank not in outcomes and process.exitcode is not None:
                    time.sleep(0.2)  # a result put just before exiting may still be in flight
                    if rank not in outcomes and results.empty():
                        outcomes[rank] = (False, f"exited with status {process.exitcode}")
                        failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            late = failed_at is not None and now - failed_at > timeout_s + 5
            if late or now > end:
                why = "still running after another rank failed" if late else "past the deadline"
                for rank in range(hub.n):
                    outcomes.setdefault(rank, (False, why))
    finally:
        for process in processes:
            process.join(timeout=2.0)
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join()
        results.close()
    failed = {rank: value for rank, (ok, value) in sorted(outcomes.items()) if not ok}
    if failed:
        raise LaunchError("; ".join(f"rank {rank}: {value}" for rank, value in failed.items()))
    return [outcomes[rank][1] for rank in range(hub.n)]
