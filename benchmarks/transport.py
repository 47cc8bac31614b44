"""Moving a 64 MiB envelope between two gRPC peers on loopback vs the same bytes over raw TCP.

Run: python benchmarks/transport.py --json docs/transport.json
Both are timed in the same run, interleaved trial by trial (this machine is noisy), and compared
as a throughput ratio; a bare grpcio byte stream (no parsing or validation) is timed alongside as
the ceiling of the library itself. The gRPC side is the real transport path: chunking, streaming, header
validation, reassembly, the finite-values check and the mailbox. Goal: grpc_vs_socket_ratio >= 0.6.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch
from rich.console import Console
from rich.table import Table

from gossipcomp.transport.base import Envelope, Identity
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport


def grpc_trial(sender: GrpcTransport, receiver: GrpcTransport, envelope: Envelope) -> float:
    receiver._inbox.mailbox.open_round(envelope.round)  # drop the previous trial's envelope
    start = time.perf_counter()
    sender.send(1, envelope, time.monotonic() + 120)
    return time.perf_counter() - start


def socket_trial(data: memoryview) -> float:
    """Send `data` over a fresh loopback TCP connection into a preallocated buffer."""
    server = socket.create_server(("127.0.0.1", 0))
    size = len(data)

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            buffer = memoryview(bytearray(size))
            got = 0
            while got < size:
                got += conn.recv_into(buffer[got:])
            conn.sendall(b"k")

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        start = time.perf_counter()
        client.sendall(data)
        client.recv(1)  # acknowledged once every byte is in the receiver's buffer
        elapsed = time.perf_counter() - start
    thread.join()
    server.close()
    return elapsed


def raw_grpc_server() -> tuple[grpc.Server, str]:
    """A bare gRPC service that reads a stream of byte messages and discards them: the ceiling
    of what grpcio itself moves, with no chunk parsing, reassembly or validation."""

    def drain(requests, context) -> bytes:
        return sum(len(r) for r in requests).to_bytes(8, "little")

    options = GrpcOptions().channel_options()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Raw", {"Drain": grpc.stream_unary_rpc_method_handler(drain)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def raw_grpc_trial(drain, data: memoryview, chunk: int) -> float:
    pieces = [bytes(data[i : i + chunk]) for i in range(0, len(data), chunk)]  # made before timing
    start = time.perf_counter()
    drain(iter(pieces), timeout=120)
    return time.perf_counter() - start


def run(mib: int, trials: int, chunk_sizes: list[int]) -> dict:
    tensor = torch.randn(mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0))
    wire = encode_raw("payload", tensor)
    spec = (tensor_spec("payload", tensor),)
    nbytes = wire.nbytes
    results: dict[str, list[float]] = {"socket": [], "grpc_raw_ceiling": []}
    raw_server, raw_address = raw_grpc_server()
    raw_channel = grpc.insecure_channel(raw_address, options=GrpcOptions().channel_options())
    drain = raw_channel.stream_unary("/bench.Raw/Drain")
    pairs = {}
    for chunk in chunk_sizes:
        options = GrpcOptions(chunk_bytes=chunk)
        a = GrpcTransport(Identity(0, "bench", "bench"), [1], options=options)
        b = GrpcTransport(Identity(1, "bench", "bench"), [0], options=options)
        b.expect("bench", spec)
        a.connect({1: b.address}, timeout=10)
        pairs[chunk] = (a, b)
        results[f"grpc_{chunk >> 10}KiB"] = []
    try:
        for trial in range(trials + 1):  # trial 0 warms up and is discarded
            socket_time = socket_trial(memoryview(wire.data).cast("B"))
            raw_time = raw_grpc_trial(
                drain, memoryview(wire.data).cast("B"), GrpcOptions().chunk_bytes
            )
            grpc_times = {
                chunk: grpc_trial(a, b, Envelope(0, trial, "bench", (wire,)))
                for chunk, (a, b) in pairs.items()
            }
            if trial:
                results["socket"].append(socket_time)
                results["grpc_raw_ceiling"].append(raw_time)
                for chunk, elapsed in grpc_times.items():
                    results[f"grpc_{chunk >> 10}KiB"].append(elapsed)
    finally:
        for a, b in pairs.values():
            a.close()
            b.close()
        raw_channel.close()
        raw_server.stop(0)
    medians = {k: statistics.median(v) for k, v in results.items()}
    throughput = {k: nbytes / t / 1e9 for k, t in medians.items()}
    default_key = f"grpc_{GrpcOptions().chunk_bytes >> 10}KiB"
    return {
        "envelope_bytes": nbytes,
        "trials": trials,
        "median_seconds": medians,
        "throughput_gb_per_s": throughput,
        "ratio_to_socket": {k: throughput[k] / throughput["socket"] for k in throughput},
        "grpc_vs_socket_ratio": throughput[default_key] / throughput["socket"],
        "grpc_vs_raw_grpc_ratio": throughput[default_key] / throughput["grpc_raw_ceiling"],
        "default_chunk_bytes": GrpcOptions().chunk_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--mib", type=int, default=64, help="envelope size in MiB")
    parser.add_argument("--trials", type=int, default=7, help="timed trials per method")
    parser.add_argument(
        "--chunk-kib", type=int, nargs="+", default=[256, 1024, 4096], help="gRPC chunk sizes"
    )
    args = parser.parse_args()
    result = run(args.mib, args.trials, [k << 10 for k in args.chunk_kib])
    table = Table(title=f"{args.mib} MiB envelope, loopback, median of {args.trials}")
    for column in ("path", "median s", "GB/s", "x socket"):
        table.add_column(column, justify="right")
    for key, seconds in result["median_seconds"].items():
        table.add_row(
            key,
            f"{seconds:.4f}",
            f"{result['throughput_gb_per_s'][key]:.2f}",
            f"{result['ratio_to_socket'][key]:.2f}",
        )
    Console().print(table)
    print(f"grpc_vs_socket_ratio = {result['grpc_vs_socket_ratio']:.3f}")
    print(f"grpc_vs_raw_grpc_ratio = {result['grpc_vs_raw_grpc_ratio']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
