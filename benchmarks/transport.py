"""Moving a 64 MiB envelope between two gRPC peers on loopback vs the same bytes over raw TCP.

Run: python benchmarks/transport.py --json docs/transport.json
The receiving peer lives in its own process, as real peers do (so the two sides do not share a
GIL). Both paths are timed in the same run, interleaved trial by trial in an order
drawn afresh for each trial (this machine is noisy, and a path's place in a trial moved it),
and compared as a throughput ratio. The gRPC paths are the real transport: header validation,
the finite-values check and the mailbox, timed until the receiver acknowledges, two ways: as a
training round runs it (`exchange`: the receiver answers every round with a one-float payload)
and as a bare `send` (the receiver's rounds are opened by the same answering exchanges). At
the transport's defaults (`grpc_exchange`, `grpc_send`) the envelope goes on the bulk lane
(header by gRPC, data on a connection of the transport's own: transport/bulk_lane.py); the
stream paths (`grpc_<chunk>KiB`, `grpc_send_<chunk>KiB`, `grpc_own_reads`) are the same with
the lane off, chunked and streamed through gRPC, as envelopes below the lane's size or under
TLS go. A bare grpcio byte stream (no parsing or validation; chunks made before timing) is
timed alongside as the ceiling of the library itself.
Each trial also charges each end the CPU seconds its process spent (user and system, every
thread), so a run shows what bounds it: on a machine whose cores both ends share, the paths are
CPU-bound and the ratio is their CPU per envelope against the socket's.
Goal: grpc_vs_socket_ratio (the default exchange) >= 0.6.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import resource
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import numpy
import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.transport.allocator import keep_heap_warm
from gossipcomp.transport.base import Envelope, Identity, Payload
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport
from gossipcomp.transport.wire import header_chunk

PHASE = "bench"
MODES = ("exchange", "send")  # how the sender moves the envelope (see grpc_trial, send_trial)
ROUND_TIMEOUT = 60.0  # seconds a round may take: far above any trial, so only a failure waits


CPU_QUERY = "cpu"  # the sender asks the receiver for its CPU seconds so far


def cpu_seconds() -> float:
    """CPU seconds this process has spent so far, user and system, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _payload(mib: int) -> torch.Tensor:
    return torch.randn(mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0))


def _serve_socket(server: socket.socket, size: int) -> None:
    """Receive whole messages of `size` bytes, all into one buffer (the gRPC side reuses its
    receive buffers too), and acknowledge each one."""
    buffer = memoryview(numpy.empty(size, dtype=numpy.uint8))
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            got = 0
            while got < size:
                got += conn.recv_into(buffer[got:])
            conn.sendall(b"k")


def _ack() -> torch.Tensor:
    """The receiver's own payload each round: one float, so a round's time is the sender's."""
    return torch.zeros(1)


def _answer_rounds(transport: GrpcTransport, sender: str, rounds: int) -> None:
    """Be a peer whose neighbour sends the big envelope: exchange every round, answering with
    the one-float acknowledgement, each round opened by `exchange` and collected before its
    deadline, as in training."""
    transport.connect({0: sender}, timeout=60)
    ack = (encode_raw("ack", _ack()),)
    for round_ in range(rounds):
        transport.exchange(round_, PHASE, {0: ack}, timeout=ROUND_TIMEOUT)


def _path(mode: str, chunk: int) -> str:
    """The result key of a gRPC stream path (no bulk lane), e.g. grpc_1024KiB (exchange) or
    grpc_send_1024KiB."""
    return f"grpc_{'' if mode == 'exchange' else mode + '_'}{chunk >> 10}KiB"


DEFAULT_PATHS = {"exchange": "grpc_exchange", "send": "grpc_send"}  # the transport's defaults
GRPC_OWN_READS = "grpc_own_reads"  # the stream exchange with gRPC's own socket read sizes
NO_LANE = 0  # bulk_lane_bytes of the stream paths: the envelope goes by gRPC stream


def _paths(chunk_sizes: list[int]) -> dict[str, tuple[str, GrpcOptions]]:
    """Every gRPC path timed: its mode and the options both of its ends use. The defaults
    (`DEFAULT_PATHS`: a large envelope on the bulk lane), then gRPC streams of each chunk
    size, as the transport sends envelopes below the lane's size or under TLS."""
    paths = {key: (mode, GrpcOptions()) for mode, key in DEFAULT_PATHS.items()}
    for mode in MODES:
        for chunk in chunk_sizes:
            paths[_path(mode, chunk)] = (
                mode,
                GrpcOptions(chunk_bytes=chunk, bulk_lane_bytes=NO_LANE),
            )
    paths[GRPC_OWN_READS] = ("exchange", GrpcOptions(read_chunk_bytes=0, bulk_lane_bytes=NO_LANE))
    return paths


def receiver(mib: int, chunk_sizes: list[int], rounds: int, pipe: Connection) -> None:
    """The receiving peer: gRPC transports (one per mode and chunk size), a bare gRPC sink, a
    socket."""
    torch.set_num_threads(1)
    spec = (tensor_spec("payload", _payload(mib)),)
    transports = {}
    for path, (_, options) in _paths(chunk_sizes).items():
        transport = GrpcTransport(Identity(1, "bench", "bench"), [0], options=options)
        transport.inbox.expect(PHASE, spec)
        transports[path] = transport

    def drain(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return sum(len(r) for r in requests).to_bytes(8, "little")

    raw = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), options=GrpcOptions().channel_options()
    )
    raw.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Raw", {"Drain": grpc.stream_unary_rpc_method_handler(drain)}
            ),
        )
    )
    raw_port = raw.add_insecure_port("127.0.0.1:0")
    raw.start()
    sock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_socket, args=(sock, mib << 20), daemon=True).start()
    pipe.send(
        {
            "grpc": {path: t.address for path, t in transports.items()},
            "raw": f"127.0.0.1:{raw_port}",
            "socket": sock.getsockname(),
        }
    )
    senders = pipe.recv()  # path -> the sending peer's address
    peers = [
        threading.Thread(target=_answer_rounds, args=(t, senders[path], rounds), daemon=True)
        for path, t in transports.items()
    ]
    for peer in peers:
        peer.start()
    while pipe.recv() == CPU_QUERY:  # until the sender is done
        pipe.send(cpu_seconds())
    for peer in peers:
        peer.join(timeout=ROUND_TIMEOUT)
    for transport in transports.values():
        transport.close()
    sock.close()
    raw.stop(0)


def socket_trial(address, data: memoryview) -> float:
    with socket.create_connection(address) as client:
        start = time.perf_counter()
        client.sendall(data)
        client.recv(1)  # acknowledged once every byte is in the receiver's buffer
        return time.perf_counter() - start


def raw_grpc_trial(drain, pieces: list[bytes]) -> float:
    """The bare grpcio stream of ready-made pieces (see run)."""
    start = time.perf_counter()
    drain(iter(pieces), timeout=120)
    return time.perf_counter() - start


def _on_lane(round_: int, payload: Payload, sent: int) -> bool:
    """Whether `sent` bytes are what the bulk lane moves for this envelope (its header chunk
    and the data, unframed), not what a stream moves (every chunk framed)."""
    header = header_chunk(Envelope(0, round_, PHASE, payload))
    return sent == len(header) + sum(wire.nbytes for wire in payload)


def grpc_trial(
    sender: GrpcTransport, round_: int, *, payload: Payload, lane_trials: list[bool]
) -> float:
    """One round of the real exchange: push the envelope, collect the receiver's acknowledgement
    payload; raises if the receiver refused anything (the benchmark must not time failures).
    Whether the envelope went on the bulk lane is added to `lane_trials`."""
    start = time.perf_counter()
    result = sender.exchange(round_, PHASE, {1: payload}, timeout=ROUND_TIMEOUT)
    elapsed = time.perf_counter() - start
    if result.failed or 1 not in result.received:
        raise RuntimeError(f"round {round_} failed: {result.failed}")
    lane_trials.append(_on_lane(round_, payload, result.bytes_sent[1]))
    return elapsed


def send_trial(
    sender: GrpcTransport, round_: int, *, payload: Payload, lane_trials: list[bool]
) -> float:
    """One envelope by `send`, timed until the receiver has stored it; the receiver's answering
    exchange opens its rounds and collects it (and its acknowledgement payload, arriving here
    within the mailbox's window of open rounds, is simply dropped later). Whether it went on
    the bulk lane is added to `lane_trials`."""
    sender.inbox.open_round(round_)
    start = time.perf_counter()
    sent = sender.send(1, Envelope(0, round_, PHASE, payload), time.monotonic() + ROUND_TIMEOUT)
    elapsed = time.perf_counter() - start
    lane_trials.append(_on_lane(round_, payload, sent))
    return elapsed


def run(mib: int, trials: int, chunk_sizes: list[int]) -> dict:
    """Time every path `trials` times (after one discarded warm-up), interleaved trial by trial."""
    torch.set_num_threads(1)
    wire = encode_raw("payload", _payload(mib))
    data = memoryview(wire.data).cast("B")
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=receiver, args=(mib, chunk_sizes, trials + 1, theirs), daemon=True
    )
    process.start()
    addresses = ours.recv()
    senders, modes = {}, {}
    for path, (mode, options) in _paths(chunk_sizes).items():
        sender = GrpcTransport(Identity(0, "bench", "bench"), [1], options=options)
        sender.inbox.expect(PHASE, (tensor_spec("ack", _ack()),))
        senders[path], modes[path] = sender, mode
    ours.send({path: sender.address for path, sender in senders.items()})
    for path, sender in senders.items():
        sender.connect({1: addresses["grpc"][path]}, timeout=60)
    raw_channel = grpc.insecure_channel(addresses["raw"], options=GrpcOptions().channel_options())
    drain = raw_channel.stream_unary("/bench.Raw/Drain")
    default_chunk = GrpcOptions().chunk_bytes
    # the bare stream's pieces, made once before any timing (so neither its time nor its CPU
    # counts a copy)
    pieces = [bytes(data[i : i + default_chunk]) for i in range(0, len(data), default_chunk)]
    results: dict[str, list[float]] = {"socket": [], "grpc_raw_ceiling": []}
    results.update({path: [] for path in senders})
    cpu: dict[str, dict[str, list[float]]] = {
        path: {"sender": [], "receiver": []} for path in results
    }
    orders: list[list[str]] = []  # each timed trial's order of paths (the same every run)
    lane: dict[str, list[bool]] = {path: [] for path in senders}  # per trial: on the lane?
    try:
        timed: dict[str, Callable[[int], float]] = {
            "socket": lambda _: socket_trial(tuple(addresses["socket"]), data),
            "grpc_raw_ceiling": lambda _: raw_grpc_trial(drain, pieces),
        }
        for path, sender in senders.items():
            trial_of = send_trial if modes[path] == "send" else grpc_trial
            timed[path] = partial(trial_of, sender, payload=(wire,), lane_trials=lane[path])
        order = list(timed)
        for trial in range(trials + 1):  # trial 0 warms up and is discarded
            # a fresh order every trial: a path timed after another big transfer ran
            # measurably faster or slower than one timed first, whichever path it was
            random.Random(trial).shuffle(order)
            for path in order:
                ours.send(CPU_QUERY)
                receiver_before, sender_before = ours.recv(), cpu_seconds()
                elapsed = timed[path](trial)
                sender_spent = cpu_seconds() - sender_before
                ours.send(CPU_QUERY)
                receiver_spent = ours.recv() - receiver_before
                if trial:
                    results[path].append(elapsed)
                    cpu[path]["sender"].append(sender_spent)
                    cpu[path]["receiver"].append(receiver_spent)
            if trial:
                orders.append(list(order))
    finally:
        ours.send("done")  # the receiver finishes its rounds and closes first
        process.join(timeout=30)
        if process.is_alive():
            process.terminate()
        for sender in senders.values():
            sender.close()
        raw_channel.close()
    nbytes = len(data)
    medians = {k: statistics.median(v) for k, v in results.items()}
    throughput = {k: nbytes / t / 1e9 for k, t in medians.items()}
    cpu_ms = {
        path: {end: 1e3 * statistics.median(spent) for end, spent in ends.items()}
        for path, ends in cpu.items()
    }
    socket_cpu = sum(cpu_ms["socket"].values())
    defaults = set(DEFAULT_PATHS.values())
    default_key, send_key = DEFAULT_PATHS["exchange"], DEFAULT_PATHS["send"]
    stream_key = _path("exchange", default_chunk)
    return {
        "envelope_bytes": nbytes,
        "trials": trials,
        "median_seconds": medians,
        "throughput_gb_per_s": throughput,
        "ratio_to_socket": {k: throughput[k] / throughput["socket"] for k in throughput},
        "grpc_vs_socket_ratio": throughput[default_key] / throughput["socket"],
        "grpc_vs_raw_grpc_ratio": throughput[default_key] / throughput["grpc_raw_ceiling"],
        "send_vs_socket_ratio": throughput[send_key] / throughput["socket"],
        # whether every trial of the default paths went on the bulk lane, and the default
        # exchange's gain over the same envelope as a gRPC stream of default chunks
        "on_bulk_lane": {path: all(lane[path]) for path in DEFAULT_PATHS.values()},
        # every trial of the stream paths went as a stream
        "streams_off_lane": not any(any(lane[path]) for path in senders if path not in defaults),
        "lane_over_stream": throughput[default_key] / throughput[stream_key],
        # the stream exchange over the same with gRPC's own socket read sizes
        "read_chunk_gain": throughput[stream_key] / throughput[GRPC_OWN_READS],
        "default_chunk_bytes": default_chunk,
        "trial_orders": orders,
        # CPU milliseconds per envelope on each end (medians over trials), both ends together
        # over the socket's, and the cores a path kept busy (both ends' CPU over its time)
        "cpu_ms_per_envelope": cpu_ms,
        "cpu_over_socket": {k: sum(ends.values()) / socket_cpu for k, ends in cpu_ms.items()},
        "cores_busy": {k: sum(cpu_ms[k].values()) / 1e3 / medians[k] for k in medians},
    }


def machine_settings() -> dict[str, object]:
    """What differs between machines and moves the receiver's cost of fresh memory: the
    kernel's transparent huge pages (a fresh 64 MiB buffer is zeroed as 2 MiB pages or
    faulted as 4 KiB ones), the C library (transport/allocator.py sets glibc's thresholds
    only), the cores gRPC's threads share."""
    hugepages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {
        "transparent_hugepage": hugepages.read_text().strip() if hugepages.exists() else None,
        "libc": " ".join(platform.libc_ver()),
        "heap_thresholds_set": keep_heap_warm(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--mib", type=int, default=64, help="envelope size in MiB")
    parser.add_argument("--trials", type=int, default=9, help="timed trials per path")
    parser.add_argument(
        "--chunk-kib", type=int, nargs="+", default=[256, 1024, 4096], help="gRPC chunk sizes"
    )
    args = parser.parse_args()
    chunk_sizes = [k << 10 for k in args.chunk_kib]
    if GrpcOptions().chunk_bytes not in chunk_sizes:
        chunk_sizes.append(GrpcOptions().chunk_bytes)
    load_before = os.getloadavg()[0]
    result = run(args.mib, args.trials, chunk_sizes)
    result["load_average_1min"] = [load_before, os.getloadavg()[0]]  # others on the machine
    result["machine"] = machine_settings()
    table = Table(title=f"{args.mib} MiB envelope, loopback, median of {args.trials}")
    columns = ("path", "median s", "GB/s", "x socket", "CPU ms send", "CPU ms recv", "cores")
    for column in columns:
        table.add_column(column, justify="right")
    for key, seconds in result["median_seconds"].items():
        cpu_ms = result["cpu_ms_per_envelope"][key]
        table.add_row(
            key,
            f"{seconds:.4f}",
            f"{result['throughput_gb_per_s'][key]:.2f}",
            f"{result['ratio_to_socket'][key]:.2f}",
            f"{cpu_ms['sender']:.1f}",
            f"{cpu_ms['receiver']:.1f}",
            f"{result['cores_busy'][key]:.2f}",
        )
    Console(width=max(Console().width, 110)).print(table)
    print(f"grpc_vs_socket_ratio = {result['grpc_vs_socket_ratio']:.3f}")
    print(f"grpc_vs_raw_grpc_ratio = {result['grpc_vs_raw_grpc_ratio']:.3f}")
    print(f"send_vs_socket_ratio = {result['send_vs_socket_ratio']:.3f}")
    print(f"lane_over_stream = {result['lane_over_stream']:.3f}")
    print(f"on the bulk lane, every trial: {result['on_bulk_lane']}")
    print(
        f"read_chunk_gain = {result['read_chunk_gain']:.3f} (streams: megabyte reads over gRPC's own)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
