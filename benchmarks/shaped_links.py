"""Real bandwidth-limited links for benchmarks: one network namespace per peer, a veth pair per
edge of the topology, and `tc` (tbf) limiting each edge's rate on both ends' egress.

Needs root on Linux with `ip` (iproute2, with `ip netns`) and `tc`; where that is missing,
`NamespacesUnavailable` says what is, and the command line exits with status 1 saying so.

Addresses (all inside the namespaces built here; the root namespace's interfaces and routes
are never touched):

- peer r: identity address 10.77.0.<r+1>/32 on its loopback device; that is where its
  `gossipcomp peer` listens (`topology_peers` gives the topology's `peers:` block);
- edge k between a and b: veth `n<b>` in a's namespace and `n<a>` in b's, addressed from
  10.76.0.0/16 (a /30 per edge), with a route to the other end's identity address through it;
- the control namespace (for `gossipcomp coordinator`): 10.78.0.1/32 on its loopback, an
  unshaped veth to every peer (`ctl` in the peer, `p<r>` in the control namespace, a /30 per peer
  from 10.79.0.0/16), peers' control traffic leaving from their identity address.

`ShapedNetwork` builds all of it on entering (namespaces named `gcl<pid>n<serial>p<rank>`, and
`...c` for control), runs commands inside (`popen`, `run`), changes an edge's rate mid-run
(`set_rate`, `tc qdisc change` at both ends), and on leaving kills every process still in its
namespaces and deletes them (their veths go with them). Leaving also happens on SIGTERM (turned
into SystemExit while the network is up), Ctrl-C and interpreter exit (atexit). A namespace of
this kind whose process is gone (killed with SIGKILL) is deleted by the next network built.

Command line: `python benchmarks/shaped_links.py --json PATH` is a self-check on two peers: TCP
throughput through a 100 Mbit/s link, the same link changed to 10 Mbit/s, and the measured
rates written to PATH.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Self

PREFIX = "gcl"
NAME_PATTERN = re.compile(rf"^{PREFIX}(\d+)n\d+(?:p\d+|c)$")  # what `stale_namespaces` may delete
IDENTITY_NET = ipaddress.IPv4Network("10.77.0.0/24")
EDGE_NET = ipaddress.IPv4Network("10.76.0.0/16")
CONTROL_ADDRESS = "10.78.0.1"
CONTROL_NET = ipaddress.IPv4Network("10.79.0.0/16")
MAX_PEERS = 250  # identity addresses 10.77.0.1 .. 10.77.0.250
MAX_EDGES = EDGE_NET.num_addresses // 4
MAX_MBIT = 100_000.0  # 100 Gbit/s: beyond, tbf on a veth is no limit
MIN_MBIT = 0.01
QUEUE_LATENCY_MS = 50  # tbf queue: what waits longer than this is dropped (TCP backs off)
COMMAND_TIMEOUT_S = 30.0  # one `ip` or `tc` call
_serials = itertools.count()


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be built here (not root, no iproute2/tc, or refused)."""


Edge = tuple[int, int]  # (lower rank, higher rank)


def edge(a: int, b: int) -> Edge:
    """The key of the edge between `a` and `b`, whatever the order."""
    return (a, b) if a < b else (b, a)


def _ip(*arguments: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip ARGUMENTS`; a failure raises RuntimeError with what `ip` said."""
    return _command(["ip", *arguments], check=check)


def _command(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:300]
        raise RuntimeError(f"{' '.join(argv)} failed (status {done.returncode}): {said}")
    return done


def check_available() -> None:
    """Raise NamespacesUnavailable naming what is missing: root, `ip`, `tc`, `ip netns add`."""
    if sys.platform != "linux":
        raise NamespacesUnavailable(f"network namespaces need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root (this process is not)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NamespacesUnavailable(f"`{tool}` (iproute2) is not installed")
    probe = f"{PREFIX}{os.getpid()}n{next(_serials)}c"
    try:
        done = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        raise NamespacesUnavailable(f"`ip netns add` could not run: {error}") from None
    if done.returncode != 0:
        said = " ".join(done.stderr.split())[:300]
        raise NamespacesUnavailable(f"`ip netns add` failed: {said}")
    _ip("netns", "del", probe, check=False)


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    listed = _ip("netns", "list").stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces(pattern: re.Pattern[str] = NAME_PATTERN) -> list[str]:
    """Namespaces named by `pattern` (this module's by default: group 1 is the pid that made
    them) whose process is gone (it was killed with SIGKILL)."""
    stale = []
    for name in namespaces():
        match = pattern.match(name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            stale.append(name)
    return stale


def _remove_namespace(name: str) -> None:
    """Kill every process left inside `name`, then delete it (its veths go with it)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while pids and time.monotonic() < deadline:  # a killed process leaves the namespace late
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        time.sleep(0.02)
    _ip("netns", "del", name, check=False)


def _pair(net: ipaddress.IPv4Network, index: int) -> tuple[str, str]:
    """The two host addresses of the `index`-th /30 of `net`."""
    base = net.network_address + 4 * index
    return str(base + 1), str(base + 2)


def identity_address(rank: int) -> str:
    """The address peer `rank` listens at, inside its namespace."""
    return str(IDENTITY_NET.network_address + rank + 1)


STANDARD_FRAME_BYTES = 4096  # a full-size (1500-byte MTU) Ethernet frame and its headers


def burst_bytes(mbit: float, frame_bytes: int = STANDARD_FRAME_BYTES) -> int:
    """The bytes a shaped link lets through at line rate after a pause: 1 ms at `mbit`, and at
    least `frame_bytes` (tbf drops a frame larger than its burst)."""
    return max(frame_bytes, int(mbit * 1e6 / 8 / 1000))


def _tbf(
    mbit: float, queue_bytes: int | None = None, frame_bytes: int = STANDARD_FRAME_BYTES
) -> list[str]:
    """tbf parameters for `mbit`: a burst of `burst_bytes` and a queue of QUEUE_LATENCY_MS, or
    of `queue_bytes` when given."""
    burst = burst_bytes(mbit, frame_bytes)
    queue = (
        ["latency", f"{QUEUE_LATENCY_MS}ms"] if queue_bytes is None else ["limit", str(queue_bytes)]
    )
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), *queue]


def check_mbit(mbit: float, what: str) -> float:
    if (
        isinstance(mbit, bool)
        or not isinstance(mbit, int | float)
        or not (MIN_MBIT <= mbit <= MAX_MBIT)
    ):
        raise ValueError(f"{what}: expected Mbit/s in [{MIN_MBIT}, {MAX_MBIT:g}], got {mbit!r}")
    return float(mbit)


class Namespaces:
    """A set of network namespaces, one per rank 0..n-1 and more as a subclass needs, named
    `<PREFIX><pid>n<serial>...`. A context manager: `_build` (the subclass's) makes them on
    entering, and leaving deletes them with every process inside; so do SIGTERM (turned into
    SystemExit while they are up), Ctrl-C and interpreter exit. Entering first deletes those of
    the same kind (NAME_PATTERN) whose process is gone."""

    PREFIX = PREFIX
    NAME_PATTERN = NAME_PATTERN

    def __init__(self, n: int) -> None:
        self.n = n
        self._prefix = f"{self.PREFIX}{os.getpid()}n{next(_serials)}"
        self._made: list[str] = []
        self._previous_sigterm: Any = None

    @property
    def prefix(self) -> str:
        """What every namespace of this set is named with."""
        return self._prefix

    def namespace(self, rank: int) -> str:
        """Rank `rank`'s namespace."""
        if not 0 <= rank < self.n:
            raise ValueError(f"rank: expected 0 to {self.n - 1}, got {rank}")
        return f"{self._prefix}p{rank}"

    def __enter__(self) -> Self:
        check_available()
        for name in stale_namespaces(self.NAME_PATTERN):
            _remove_namespace(name)
        atexit.register(self.teardown)
        if _in_main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Kill what runs in these namespaces and delete them; safe to call again. SIGINT and
        SIGTERM wait until it is done."""
        if not self._made and self._previous_sigterm is None:
            return
        masked = _in_main_thread()
        if masked:
            previous = {
                s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)
            }
        try:
            for name in reversed(self._made):
                _remove_namespace(name)
            self._made.clear()
        finally:
            if masked:
                if self._previous_sigterm is not None:
                    previous[signal.SIGTERM] = self._previous_sigterm
                    self._previous_sigterm = None
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            atexit.unregister(self.teardown)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        raise NotImplementedError


class ShapedNetwork(Namespaces):
    """Peers 0..n-1 in their own namespaces, joined along `edges` by rate-limited veth pairs,
    plus (with `control`) a control namespace reaching every peer unshaped. A context manager:
    built on entering, torn down on leaving."""

    def __init__(
        self, n: int, edges: Iterable[tuple[int, int]], mbit: float, control: bool = True
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_PEERS:
            raise ValueError(f"peers: expected 2 to {MAX_PEERS}, got {n!r}")
        keys = sorted({edge(a, b) for a, b in edges})
        for a, b in keys:
            if a == b or not (0 <= a < n and 0 <= b < n):
                raise ValueError(f"edge {a}-{b}: expected two distinct ranks in 0..{n - 1}")
        if not keys or len(keys) > MAX_EDGES:
            raise ValueError(f"edges: expected 1 to {MAX_EDGES}, got {len(keys)}")
        super().__init__(n)
        self.edges: tuple[Edge, ...] = tuple(keys)
        self.control = control
        self._start_mbit = check_mbit(mbit, "link rate")
        self.rates: dict[Edge, float] = {}

    # names -----------------------------------------------------------------------------------
    @property
    def control_namespace(self) -> str:
        if not self.control:
            raise ValueError("this network was built without a control namespace")
        return f"{self._prefix}c"

    def topology_peers(self, port: int) -> dict[int, dict[str, str]]:
        """The `peers:` block of a topology whose peers listen at `port` in their namespaces."""
        return {r: {"address": f"{identity_address(r)}:{port}"} for r in range(self.n)}

    # building ----------------------------------------------------------------------------------
    def _build(self) -> None:
        for rank in range(self.n):
            name = self.namespace(rank)
            self._add_namespace(name)
            _ip("-n", name, "addr", "add", f"{identity_address(rank)}/32", "dev", "lo")
        for index, (a, b) in enumerate(self.edges):
            near, far = _pair(EDGE_NET, index)
            self._veth(a, f"n{b}", near, b, f"n{a}", far)
            self.rates[(a, b)] = self._start_mbit
            for rank, device in ((a, f"n{b}"), (b, f"n{a}")):
                self._tc(rank, "add", device, self._start_mbit)
        if self.control:
            self._add_namespace(self.control_namespace)
            _ip("-n", self.control_namespace, "addr", "add", f"{CONTROL_ADDRESS}/32", "dev", "lo")
            for rank in range(self.n):
                ours, theirs = _pair(CONTROL_NET, rank)
                self._control_veth(rank, ours, theirs)

    def _veth(self, a: int, dev_a: str, addr_a: str, b: int, dev_b: str, addr_b: str) -> None:
        """A veth pair between peers a and b, each end routing to the other's identity."""
        ns_a, ns_b = self.namespace(a), self.namespace(b)
        _ip("link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b,
            "netns", ns_b)  # fmt: skip
        for ns, dev, addr, other, other_addr in (
            (ns_a, dev_a, addr_a, b, addr_b),
            (ns_b, dev_b, addr_b, a, addr_a),
        ):
            own = identity_address(a if ns == ns_a else b)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "route", "add", f"{identity_address(other)}/32", "via", other_addr,
                "dev", dev, "src", own)  # fmt: skip

    def _control_veth(self, rank: int, control_addr: str, peer_addr: str) -> None:
        ns, control = self.namespace(rank), self.control_namespace
        _ip("link", "add", "ctl", "netns", ns, "type", "veth", "peer", "name", f"p{rank}",
            "netns", control)  # fmt: skip
        _ip("-n", ns, "addr", "add", f"{peer_addr}/30", "dev", "ctl")
        _ip("-n", ns, "link", "set", "ctl", "up")
        _ip("-n", ns, "route", "add", f"{CONTROL_ADDRESS}/32", "via", control_addr, "dev", "ctl",
            "src", identity_address(rank))  # fmt: skip
        _ip("-n", control, "addr", "add", f"{control_addr}/30", "dev", f"p{rank}")
        _ip("-n", control, "link", "set", f"p{rank}", "up")
        _ip("-n", control, "route", "add", f"{identity_address(rank)}/32", "via", peer_addr,
            "dev", f"p{rank}", "src", CONTROL_ADDRESS)  # fmt: skip

    def _tc(self, rank: int, verb: str, device: str, mbit: float) -> None:
        _command(["ip", "netns", "exec", self.namespace(rank), "tc", "qdisc", verb, "dev",
                  device, "root", *_tbf(mbit)])  # fmt: skip

    # use -------------------------------------------------------------------------------------
    def set_rate(self, link: tuple[int, int], mbit: float) -> None:
        """Change the rate of the edge `link` (both directions) now, with `tc qdisc change`."""
        key = edge(*link)
        if key not in self.rates:
            raise ValueError(f"link {key[0]}-{key[1]}: not an edge of this network")
        mbit = check_mbit(mbit, f"link {key[0]}-{key[1]} rate")
        a, b = key
        self._tc(a, "change", f"n{b}", mbit)
        self._tc(b, "change", f"n{a}", mbit)
        self.rates[key] = mbit

    def qdisc(self, link: tuple[int, int]) -> str:
        """What `tc qdisc show` says about the edge `link` at its lower end (for records)."""
        a, b = edge(*link)
        shown = _command(["ip", "netns", "exec", self.namespace(a), "tc", "qdisc", "show", "dev",
                          f"n{b}"])  # fmt: skip
        return " ".join(shown.stdout.split())

    def _exec(self, where: int | str, argv: Sequence[str]) -> list[str]:
        name = self.control_namespace if where == "control" else self.namespace(int(where))
        if not self._made:
            raise RuntimeError("the network is not up (use it inside `with ShapedNetwork(...)`)")
        return ["ip", "netns", "exec", name, *argv]

    def popen(self, where: int | str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` in peer `where`'s namespace (or "control"). Proxy variables are dropped
        from its environment: nothing outside the network is reachable from inside."""
        env = dict(kwargs.pop("env", None) or os.environ)
        for key in [k for k in env if k.lower().endswith("_proxy")]:
            del env[key]
        return subprocess.Popen(self._exec(where, argv), env=env, **kwargs)

    def run(
        self, where: int | str, argv: Sequence[str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `where`'s namespace to the end; its output captured as text."""
        process = self.popen(where, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


# self-check: TCP throughput through one shaped link ---------------------------------------------
PORT = 5201
CHUNK = 1 << 16


def _sink(bind: str, port: int) -> None:
    """Accept one connection, read to its end; print {bytes, seconds} from first byte to end."""
    with socket.create_server((bind, port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            first = connection.recv(CHUNK)
            began, count = time.perf_counter(), 0
            while chunk := connection.recv(CHUNK):
                count += len(chunk)
            seconds = time.perf_counter() - began
    print(json.dumps({"bytes": count, "seconds": seconds, "first": len(first)}), flush=True)


def _source(to: str, port: int, seconds: float) -> None:
    """Send zeros to `to` for `seconds`."""
    buffer = bytes(CHUNK)
    with socket.create_connection((to, port), timeout=30) as connection:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            connection.sendall(buffer)


def measure_mbit(network: ShapedNetwork, sender: int, receiver: int, seconds: float) -> float:
    """Megabits per second of one TCP stream from `sender` to `receiver`, counted at the
    receiver from its first byte to the last."""
    me = [sys.executable, str(Path(__file__).resolve())]
    sink = network.popen(
        receiver,
        [*me, "_sink", identity_address(receiver), str(PORT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the receiver did not start: {sink.communicate()[1][-500:]}")
        sent = network.run(
            sender,
            [*me, "_source", identity_address(receiver), str(PORT), str(seconds)],
            timeout=seconds + 60,
        )
        if sent.returncode != 0:
            raise RuntimeError(f"the sender failed: {sent.stderr[-500:]}")
        out, err = sink.communicate(timeout=60)
        if sink.returncode != 0:
            raise RuntimeError(f"the receiver failed: {err[-500:]}")
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    got = json.loads(out.strip().splitlines()[-1])
    return got["bytes"] * 8 / got["seconds"] / 1e6


def self_check(mbit: float, changed_mbit: float, seconds: float) -> dict[str, Any]:
    """Two peers on one link: throughput at `mbit`, then after `set_rate` to `changed_mbit`."""
    with ShapedNetwork(2, [(0, 1)], mbit, control=False) as network:
        before = measure_mbit(network, 0, 1, seconds)
        shown_before = network.qdisc((0, 1))
        network.set_rate((0, 1), changed_mbit)
        after = measure_mbit(network, 0, 1, seconds)
        return {
            "namespace_prefix": network.prefix,
            "seconds_per_measurement": seconds,
            "configured_mbit": [mbit, changed_mbit],
            "measured_mbit": [before, after],
            "measured_vs_configured": [before / mbit, after / changed_mbit],
            "qdisc": [shown_before, network.qdisc((0, 1))],
            "kernel": os.uname().release,
        }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_sink"]:
        _sink(argv[1], int(argv[2]))
        return 0
    if argv[:1] == ["_source"]:
        _source(argv[1], int(argv[2]), float(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the measurements here")
    parser.add_argument("--mbit", type=float, default=100.0, help="the link's first rate")
    parser.add_argument("--to-mbit", type=float, default=10.0, help="the rate it changes to")
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    args = parser.parse_args(argv)
    if not 0.1 <= args.seconds <= 600:
        parser.error(f"--seconds: expected 0.1 to 600, got {args.seconds}")
    try:
        check_mbit(args.mbit, "--mbit")
        check_mbit(args.to_mbit, "--to-mbit")
    except ValueError as error:
        parser.error(str(error))
    try:
        result = self_check(args.mbit, args.to_mbit, args.seconds)
    except NamespacesUnavailable as error:
        print(f"shaped_links.py: network namespaces are not available: {error}", file=sys.stderr)
        return 1
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    for configured, measured in zip(
        result["configured_mbit"], result["measured_mbit"], strict=True
    ):
        print(f"{configured:g} Mbit/s link: measured {measured:.1f} Mbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
