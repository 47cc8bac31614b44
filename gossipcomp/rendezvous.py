"""Peer addresses without a `peers:` block: each peer process announces where it listens in a
torch.distributed store and reads every other rank's address from it.

The store is torch's own (a TCPStore reached through `torch.distributed.rendezvous`, as torchrun
and `init_process_group` use it), so nothing here serves or schedules anything. A launch is
described by a URL (`--rendezvous`):

- ``env://``: what torchrun sets; store at MASTER_ADDR:MASTER_PORT, rank RANK, WORLD_SIZE ranks
  (under torchrun's c10d rendezvous the store is the agent's, which torch detects).
- ``tcp://HOST:PORT``: the store at HOST:PORT, hosted by rank 0; rank RANK, WORLD_SIZE ranks
  (the topology's n when unset).
- ``slurm://HOST:PORT`` or ``slurm://``: rank SLURM_PROCID, SLURM_NTASKS ranks; the store at
  HOST:PORT, or at MASTER_ADDR:MASTER_PORT when the URL names none, hosted by rank 0.
- ``coordinator://HOST:PORT``: the store a coordinator hosts (`gossipcomp coordinator
  --registry HOST:PORT`: `Registry` here); rank RANK, WORLD_SIZE ranks (the topology's n when
  unset), as with tcp://. Every peer is a client of the store and no rank hosts it, so the
  addresses outlive any peer, rank 0 included: a rank that joins later finds the store, and every
  address in it, however many of the launch's processes have died.

A value given on the command line (--rank, the URL's endpoint) wins over the environment. Every
value read from the environment or the store is hostile until checked: integers are
range-checked, an address is at most MAX_ADDRESS_BYTES of ASCII and passes the topology's
address check, and no error quotes more than a bounded prefix of what it got.

A live topology (`members:`, n the capacity) is started by fewer processes than its capacity:
the launch's world size may be smaller than n, and at start a peer waits only for the initial
members' addresses (a joiner, or a rank that is not an initial member, waits for nobody). Every
other rank's address is read from the store when it is needed (`StoreAddresses`: the transport
asks before probing a neighbour), so a rank that joins later, from outside the launch, announces
itself in the same store (`tcp://` at the launch's store, or the launch's `coordinator://`, its
own --rank) and the members find it once they admit it. Until then such a rank stands at an
address in the reserved `.invalid` domain, which never resolves. A joiner replaces its rank's earlier announcement (a peer that
comes back may listen at another port); a peer starting fresh may not.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple
from urllib.parse import urlsplit

import torch.distributed as dist

from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.inputs.text import quoted
from gossipcomp.topology import Topology
from gossipcomp.topology.checks import MAX_PEERS, _check_address

SCHEMES = ("env", "tcp", "slurm", "coordinator")
_EXPECTED_URL = (
    "expected env:// (torchrun), tcp://HOST:PORT, slurm[://HOST:PORT] or coordinator://HOST:PORT"
)
_ENDPOINT_ONLY = ("tcp", "coordinator")  # schemes whose URL must name the store
_STORE_TIMEOUT = timedelta(seconds=30)  # a hosted store's default for its own operations
MAX_ADDRESS_BYTES = 262  # "[" + a 253-character host + "]:" + five port digits, with room
MAX_ENV_DIGITS = 9  # RANK, WORLD_SIZE and ports are small integers: longer is a mistake
_KEY = "gossipcomp/peer/{rank}/address"
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")
_UNRESOLVED = "rank{rank}.unresolved.invalid:1"  # RFC 6761: a name that never resolves
LOOKUP_TIMEOUT = 2.0  # seconds a late look-up in the store may take

log = logging.getLogger("gossipcomp.peer")  # its warnings are the peer's


class RendezvousError(ConnectionError):
    """The rendezvous could not give this peer every rank's address; the message says why (an
    OSError, so the command line reports it in one line like an unreachable port)."""


@dataclass(frozen=True)
class Launch:
    """Where the store is and who this process is in the launch."""

    scheme: str  # one of SCHEMES
    host: str  # the store's host
    port: int  # the store's port
    rank: int
    world_size: int

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _env_int(environ: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    """An integer environment variable in low..high, None when unset; ValueError otherwise."""
    raw = environ.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or len(text) > MAX_ENV_DIGITS or not low <= int(text) <= high:
        raise ValueError(
            f"{name}={quoted(raw)} (environment): expected an integer in {low}..{high}"
        )
    return int(text)


def _endpoint(url: str, scheme: str, netloc: str, environ: Mapping[str, str]) -> tuple[str, int]:
    """The store's host and port: the URL's, else MASTER_ADDR and MASTER_PORT."""
    if netloc:
        checked = _check_address(netloc, "the store's", f"--rendezvous {quoted(url)}")
        host, _, port = checked.rpartition(":")
        return host.strip("[]"), int(port)
    if scheme in _ENDPOINT_ONLY:
        raise ValueError(f"--rendezvous {quoted(url)}: expected {scheme}://HOST:PORT, the store")
    host, port = environ.get("MASTER_ADDR"), _env_int(environ, "MASTER_PORT", 1, 65535)
    if not host or port is None:
        raise ValueError(
            f"--rendezvous {scheme}://: no store given and MASTER_ADDR/MASTER_PORT not both set; "
            f"expected them in the environment (torchrun sets them) or {scheme}://HOST:PORT"
        )
    checked = _check_address(f"{host}:{port}", "MASTER_ADDR:MASTER_PORT", "environment")
    return checked.rpartition(":")[0].strip("[]"), port


def parse_launch(
    url: str, rank: int | None, n: int, environ: Mapping[str, str], live: bool = False
) -> Launch:
    """The launch `url` describes for a topology of `n` ranks, with --rank `rank` (None: from
    the environment, RANK or SLURM_PROCID by scheme); ValueError naming what is wrong. `live`:
    n is a live topology's capacity, and the launch may start fewer ranks."""
    if not isinstance(url, str) or len(url) > MAX_ADDRESS_BYTES + 16:
        raise ValueError(f"--rendezvous {quoted(url)}: {_EXPECTED_URL}")
    parts = urlsplit(url if "://" in url else f"{url}://")
    scheme = parts.scheme
    if scheme not in SCHEMES or parts.path or parts.query or parts.fragment:
        raise ValueError(f"--rendezvous {quoted(url)}: {_EXPECTED_URL}")
    if scheme == "env" and parts.netloc:
        raise ValueError(
            f"--rendezvous {quoted(url)}: env:// takes the store from MASTER_ADDR/MASTER_PORT; "
            "expected env:// alone, or tcp://HOST:PORT"
        )
    host, port = _endpoint(url, scheme, parts.netloc, environ)
    rank_var, world_var = (
        ("SLURM_PROCID", "SLURM_NTASKS") if scheme == "slurm" else ("RANK", "WORLD_SIZE")
    )
    world = _env_int(environ, world_var, 1, MAX_PEERS)
    if world is None and scheme not in _ENDPOINT_ONLY:
        raise ValueError(
            f"--rendezvous {scheme}: {world_var} is not set; expected the launch's size"
        )
    world = n if world is None else world
    if live and world > n:
        raise ValueError(
            f"{world_var}={world} (environment): the live topology's capacity is {n} ranks; "
            "expected at most one peer process per rank"
        )
    if not live and world != n:
        raise ValueError(
            f"{world_var}={world} (environment): the topology has {n} ranks; expected one peer "
            "process per rank"
        )
    if rank is None:
        rank = _env_int(environ, rank_var, 0, MAX_PEERS)
        if rank is None:
            raise ValueError(f"--rendezvous {scheme}: no --rank given and {rank_var} not set")
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank}: the topology has ranks 0 to {n - 1}")
    return Launch(scheme, host, port, rank, world)


def open_store(launch: Launch, timeout: float) -> dist.Store:
    """Torch's store for `launch` (rank 0 hosts it, unless torchrun's agent or, with
    coordinator://, the coordinator does), waiting at most `timeout` seconds for it and (but
    with coordinator://, where a peer waits only for the addresses it needs) for every rank to
    reach it."""
    if launch.scheme == "coordinator":
        return _registry_client(launch, timeout)
    url = "env://" if launch.scheme == "env" else f"tcp://{launch.endpoint}"
    try:
        store, _, _ = next(
            dist.rendezvous(url, launch.rank, launch.world_size, timeout=timedelta(seconds=timeout))
        )
    except (RuntimeError, ValueError) as error:  # torch's DistError and its bad-value errors
        raise RendezvousError(
            f"rank {launch.rank}: rendezvous store at {launch.endpoint} not reached by all "
            f"{launch.world_size} ranks within {timeout:g} s ({quoted(str(error), 200)}); "
            "expected every rank started with the same --rendezvous"
        ) from None
    return store


def _registry_client(launch: Launch, timeout: float) -> dist.Store:
    """A client of the store a coordinator hosts (`Registry`), connected within `timeout`."""
    try:
        return dist.TCPStore(
            launch.host, launch.port, None, False, timedelta(seconds=max(timeout, 0.001))
        )
    except (RuntimeError, ValueError) as error:  # torch's DistNetworkError: nobody there
        raise RendezvousError(
            f"rank {launch.rank}: the coordinator's registry at {launch.endpoint} not reached "
            f"within {timeout:g} s ({quoted(str(error), 200)}); expected a coordinator started "
            f"with --registry {launch.endpoint}"
        ) from None


def registry_endpoint(address: str) -> tuple[str, int]:
    """The host and port of a coordinator's --registry HOST:PORT (port 0: any free one);
    ValueError naming the value otherwise."""
    expected = 'expected HOST:PORT with port 0..65535 (0: any free one; IPv6 as "[::1]:PORT")'
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_BYTES:
        raise ValueError(f"--registry {quoted(address)}: {expected}")
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    name = host[1:-1] if bracketed else host  # an IPv6 address only in brackets
    name_ok = name.isascii() and (bracketed or ":" not in name) and "[" not in name
    host_ok = bool(name) and name_ok and "]" not in name and not any(c.isspace() for c in name)
    port_ok = port.isascii() and port.isdigit() and len(port) <= 5 and int(port) <= 65535
    if not sep or not host_ok or not port_ok:
        raise ValueError(f"--registry {quoted(address)}: {expected}")
    return name, int(port)


class Registry:
    """The peers' addresses in a store a coordinator hosts for as long as it runs, or until
    close(): torch's TCPStore, the one engine every scheme uses, with no rank hosting it, so
    the addresses outlive every peer. `url` is what peers pass as --rendezvous. Torch's store
    listens on every interface at the port, whatever the host; HOST is the name peers reach it
    at. Nothing in it is trusted: peers check every address read, as with any scheme."""

    def __init__(self, address: str) -> None:
        host, port = registry_endpoint(address)
        try:
            store = dist.TCPStore(host, port, None, True, _STORE_TIMEOUT, wait_for_workers=False)
        except (RuntimeError, ValueError) as error:  # torch's DistNetworkError: port taken
            raise RendezvousError(
                f"--registry {quoted(address)}: cannot host the store there "
                f"({quoted(str(error), 200)}); expected a free port"
            ) from None
        self._store: dist.TCPStore | None = store
        shown = f"[{host}]" if ":" in host else host
        self.url = f"coordinator://{shown}:{store.port}"

    def close(self) -> None:
        """Stop serving: torch shuts its store's server down with the last reference to it."""
        self._store = None

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decoded(raw: bytes, rank: int, source: str) -> str:
    """Rank `rank`'s announced address, checked like a topology's (bounded, ASCII, host:port)."""
    if len(raw) > MAX_ADDRESS_BYTES:
        raise RendezvousError(
            f"{source}: rank {rank} announced an address of {len(raw)} bytes; expected "
            f'"host:port" of at most {MAX_ADDRESS_BYTES} bytes'
        )
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise RendezvousError(
            f'{source}: rank {rank} announced {quoted(raw)}, not ASCII; expected "host:port"'
        ) from None
    try:
        return _check_address(text, f"rank {rank}", source)
    except ValueError as error:
        raise RendezvousError(str(error)) from None


def exchange_addresses(
    store: dist.Store,
    rank: int,
    world_size: int,
    address: str,
    timeout: float,
    source: str,
    waited: Collection[int] | None = None,
    rejoin: bool = False,
) -> tuple[str | None, ...]:
    """Announce `address` as rank `rank`'s, then wait at most `timeout` seconds for the
    addresses of `waited` (None: every rank) and return every rank's in rank order, each
    checked (None: a rank not waited for that has not announced one yet). RendezvousError
    names the ranks still missing at the deadline, another process announcing this rank, or a
    malformed address. `rejoin`: this rank may have been announced before (a peer coming back)
    and its new address replaces the old one."""
    if len(address) > MAX_ADDRESS_BYTES:
        raise RendezvousError(
            f"{source}: this peer's address {quoted(address)} is longer than "
            f"{MAX_ADDRESS_BYTES} bytes; expected a shorter --advertise host"
        )
    _check_address(address, f"rank {rank}'s own", source)
    keys = [_KEY.format(rank=r) for r in range(world_size)]
    if rejoin:
        store.set(keys[rank], address)
    held = store.compare_set(keys[rank], "", address)  # set only if no one announced it yet
    if held != address.encode():
        raise RendezvousError(
            f"{source}: rank {rank} was already announced at {quoted(held[:MAX_ADDRESS_BYTES])} "
            f"by another process, not at {address}; expected one process per rank"
        )
    wanted = range(world_size) if waited is None else sorted(set(waited) | {rank})
    try:
        store.wait([keys[r] for r in wanted], timedelta(seconds=max(timeout, 0.001)))
    except dist.DistStoreError:
        missing = [r for r in wanted if not store.check([keys[r]])]
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise RendezvousError(
            f"{source}: no address from rank(s) {shown} ({len(missing)} of {len(wanted)}) within "
            f"{timeout:g} s; expected every rank to start with the same --rendezvous"
        ) from None
    strict = set(wanted)
    addresses = tuple(
        _decoded(store.get(key), r, source) if r in strict else _lenient(store, key, r, source)
        for r, key in enumerate(keys)
    )
    if addresses[rank] != address:
        raise RendezvousError(f"{source}: rank {rank}'s address changed in the store")
    return addresses


def _lenient(store: dist.Store, key: str, rank: int, source: str) -> str | None:
    """Rank `rank`'s address if it announced a well-formed one (a rank not waited for: a
    malformed value is warned about and left out, as a late look-up would)."""
    if not store.check([key]):
        return None
    try:
        return _decoded(store.get(key), rank, source)
    except RendezvousError as error:
        log.warning("%s; not used", error)
        return None


def advertised_host(bind_host: str, advertise: str | None) -> str:
    """The host other peers reach this one at: `advertise`, else the bind host, else (for a
    wildcard bind) this machine's fully qualified name."""
    if advertise:
        return advertise
    return socket.getfqdn() if bind_host in _WILDCARDS else bind_host


@contextmanager
def reserved_port(host: str, port: int) -> Iterator[int]:
    """Hold `host`:`port` (0: a free one the system picks) for this peer's gRPC server until
    the block ends, and yield the port. A first socket without SO_REUSEPORT proves the port
    free (a server already there, gRPC's included, makes it fail); the holder that replaces it
    sets SO_REUSEPORT, as gRPC does on its listening socket, so the server binds the same port
    while no other program can take it. The holder never listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError as error:
            raise RendezvousError(f"cannot bind {host}:{port} for this peer: {error}") from None
        port = probe.getsockname()[1]
    with socket.socket(family, socket.SOCK_STREAM) as holder:
        if hasattr(socket, "SO_REUSEPORT"):
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            holder.bind((address, port))
        except OSError as error:  # taken in the moment between the two binds
            raise RendezvousError(f"cannot hold {host}:{port} for this peer: {error}") from None
        yield port


class StoreAddresses:
    """Ranks' addresses as the store holds them now, for a live network: asked for a rank
    (one of the capacity), it reads that rank's key without waiting and returns the address,
    checked like any announced one, or None when the rank has announced none, the value is
    malformed (warned once per rank and value, never applied) or the store does not answer
    within LOOKUP_TIMEOUT seconds (warned once until it answers again)."""

    def __init__(self, store: dist.Store, capacity: int, source: str) -> None:
        self._store = store
        self._capacity = capacity
        self._source = source
        self._lock = threading.Lock()  # one look-up at a time; warnings noted under it
        self._warned: set[tuple[int, bytes]] = set()
        self._unreachable = False
        store.set_timeout(timedelta(seconds=LOOKUP_TIMEOUT))

    def __call__(self, rank: int) -> str | None:
        checked_integer(f"{self._source}: rank", rank, 0, self._capacity - 1)
        key = _KEY.format(rank=rank)
        with self._lock:
            try:
                raw = self._store.get(key) if self._store.check([key]) else None
            except (RuntimeError, ValueError) as error:  # torch's DistError: store gone, slow
                if not self._unreachable:
                    log.warning(
                        "%s: no answer looking up rank %d (%s); the addresses known stay",
                        self._source,
                        rank,
                        quoted(str(error), 200),
                    )
                self._unreachable = True
                return None
            self._unreachable = False
            if raw is None:
                return None
            try:
                return _decoded(raw, rank, self._source)
            except RendezvousError as error:
                seen = (rank, raw[:MAX_ADDRESS_BYTES])
                if seen not in self._warned and len(self._warned) < self._capacity:
                    self._warned.add(seen)
                    log.warning("%s; not used", error)
                return None


class Rendezvoused(NamedTuple):
    """What a rendezvous gives a peer: the topology with the addresses known at start, the
    address its server binds, and (live topologies) where later addresses are read."""

    topology: Topology
    bind: str
    addresses: StoreAddresses | None


def waited_ranks(topology: Topology, rank: int, joining: bool) -> tuple[int, ...] | None:
    """Whose addresses a peer waits for at start (None: every rank's): on a live topology,
    the initial members' when it is one of them and not joining, else nobody's (the members it
    will gossip with are read from the store when it probes them)."""
    live = topology.live
    if live is None:
        return None
    return live.initial if rank in live.initial and not joining else ()


@contextmanager
def rendezvous_topology(
    topology: Topology,
    launch: Launch,
    bind: str,
    advertise: str | None,
    timeout: float,
    joining: bool = False,
) -> Iterator[Rendezvoused]:
    """`topology` with the ranks' addresses from the rendezvous, the address this peer's
    server must bind (its port held meanwhile) and, on a live topology, the store's later
    addresses. `bind` is HOST:PORT (port 0: any free one); the store stays open until the
    block ends, since rank 0's process may host it. A rank whose address is not known yet
    stands at an unresolvable `.invalid` name. `joining`: this peer (re)joins a live network,
    replacing an earlier announcement of its rank."""
    bind_host, _, bind_port = bind.rpartition(":")
    source = f"rendezvous {launch.scheme} at {launch.endpoint}"
    n = topology.n
    with reserved_port(bind_host, int(bind_port)) as port:
        own = f"{advertised_host(bind_host, advertise)}:{port}"
        start = time.monotonic()
        store = open_store(launch, timeout)  # held until the block ends: rank 0 may host it
        remaining = timeout - (time.monotonic() - start)
        waited = waited_ranks(topology, launch.rank, joining)
        found = exchange_addresses(
            store, launch.rank, n, own, remaining, source, waited, rejoin=joining
        )
        addresses = [a or _UNRESOLVED.format(rank=r) for r, a in enumerate(found)]
        late = None if topology.live is None else StoreAddresses(store, n, source)
        yield Rendezvoused(topology.with_addresses(addresses), f"{bind_host}:{port}", late)
