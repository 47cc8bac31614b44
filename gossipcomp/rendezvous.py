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

A value given on the command line (--rank, the URL's endpoint) wins over the environment. Every
value read from the environment or the store is hostile until checked: integers are
range-checked, an address is at most MAX_ADDRESS_BYTES of ASCII and passes the topology's
address check, and no error quotes more than a bounded prefix of what it got.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import torch.distributed as dist

from gossipcomp.inputs.text import quoted
from gossipcomp.topology import Topology
from gossipcomp.topology.checks import MAX_PEERS, _check_address

SCHEMES = ("env", "tcp", "slurm")
MAX_ADDRESS_BYTES = 262  # "[" + a 253-character host + "]:" + five port digits, with room
MAX_ENV_DIGITS = 9  # RANK, WORLD_SIZE and ports are small integers: longer is a mistake
_KEY = "gossipcomp/peer/{rank}/address"
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


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
    if scheme == "tcp":
        raise ValueError(f"--rendezvous {quoted(url)}: expected tcp://HOST:PORT, the store")
    host, port = environ.get("MASTER_ADDR"), _env_int(environ, "MASTER_PORT", 1, 65535)
    if not host or port is None:
        raise ValueError(
            f"--rendezvous {scheme}://: no store given and MASTER_ADDR/MASTER_PORT not both set; "
            f"expected them in the environment (torchrun sets them) or {scheme}://HOST:PORT"
        )
    checked = _check_address(f"{host}:{port}", "MASTER_ADDR:MASTER_PORT", "environment")
    return checked.rpartition(":")[0].strip("[]"), port


def parse_launch(url: str, rank: int | None, n: int, environ: Mapping[str, str]) -> Launch:
    """The launch `url` describes for a topology of `n` ranks, with --rank `rank` (None: from
    the environment, RANK or SLURM_PROCID by scheme); ValueError naming what is wrong."""
    if not isinstance(url, str) or len(url) > MAX_ADDRESS_BYTES + 16:
        raise ValueError(f"--rendezvous {quoted(url)}: expected env://, tcp://HOST:PORT or slurm")
    parts = urlsplit(url if "://" in url else f"{url}://")
    scheme = parts.scheme
    if scheme not in SCHEMES or parts.path or parts.query or parts.fragment:
        raise ValueError(
            f"--rendezvous {quoted(url)}: expected env:// (torchrun), tcp://HOST:PORT or "
            "slurm[://HOST:PORT]"
        )
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
    if world is None and scheme != "tcp":
        raise ValueError(
            f"--rendezvous {scheme}: {world_var} is not set; expected the launch's size"
        )
    world = n if world is None else world
    if world != n:
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
    """Torch's store for `launch` (rank 0 hosts it, unless torchrun's agent does), waiting at
    most `timeout` seconds for it and for every rank to reach it."""
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
    store: dist.Store, rank: int, world_size: int, address: str, timeout: float, source: str
) -> tuple[str, ...]:
    """Announce `address` as rank `rank`'s, then wait at most `timeout` seconds for every
    rank's and return them in rank order, each checked. RendezvousError names the ranks still
    missing at the deadline, another process announcing this rank, or a malformed address."""
    if len(address) > MAX_ADDRESS_BYTES:
        raise RendezvousError(
            f"{source}: this peer's address {quoted(address)} is longer than "
            f"{MAX_ADDRESS_BYTES} bytes; expected a shorter --advertise host"
        )
    _check_address(address, f"rank {rank}'s own", source)
    keys = [_KEY.format(rank=r) for r in range(world_size)]
    held = store.compare_set(keys[rank], "", address)  # set only if no one announced it yet
    if held != address.encode():
        raise RendezvousError(
            f"{source}: rank {rank} was already announced at {quoted(held[:MAX_ADDRESS_BYTES])} "
            f"by another process, not at {address}; expected one process per rank"
        )
    try:
        store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
    except dist.DistStoreError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise RendezvousError(
            f"{source}: no address from rank(s) {shown} ({len(missing)} of {world_size}) within "
            f"{timeout:g} s; expected every rank to start with the same --rendezvous"
        ) from None
    addresses = tuple(_decoded(store.get(key), r, source) for r, key in enumerate(keys))
    if addresses[rank] != address:
        raise RendezvousError(f"{source}: rank {rank}'s address changed in the store")
    return addresses


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


@contextmanager
def rendezvous_topology(
    topology: Topology, launch: Launch, bind: str, advertise: str | None, timeout: float
) -> Iterator[tuple[Topology, str]]:
    """`topology` with every rank's address from the rendezvous, and the address this peer's
    server must bind (its port held meanwhile). `bind` is HOST:PORT (port 0: any free one);
    the store stays open until the block ends, since rank 0's process may host it."""
    bind_host, _, bind_port = bind.rpartition(":")
    source = f"rendezvous {launch.scheme} at {launch.endpoint}"
    with reserved_port(bind_host, int(bind_port)) as port:
        own = f"{advertised_host(bind_host, advertise)}:{port}"
        start = time.monotonic()
        store = open_store(launch, timeout)  # held until the block ends: rank 0 may host it
        remaining = timeout - (time.monotonic() - start)
        addresses = exchange_addresses(
            store, launch.rank, launch.world_size, own, remaining, source
        )
        yield topology.with_addresses(addresses), f"{bind_host}:{port}"
