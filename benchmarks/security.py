"""What security costs: plaintext vs mutual TLS vs TLS with signed messages, side by side.

Run: python benchmarks/security.py --json docs/security.json
Two measurements, each interleaving the three set-ups trial by trial (this machine is noisy):

- per envelope: one peer sends envelopes of a small (gossip-sized) and a large size to another
  over loopback gRPC, timed until the receiver acknowledges (so the receiver's checks, the
  signature and the streamed SHA-256 included, are inside the time);
- per round: `simulate` on ring8 (8 peers in this process, D-PSGD on digits), wall time per round.

Reported: medians, and each set-up's time as a multiple of plaintext's and of TLS's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console
from rich.table import Table

from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.security import PeerKeys, throwaway_certificates
from gossipcomp.topology import load_topology
from gossipcomp.transport.base import Envelope, Identity
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.grpc_transport import GrpcOptions, GrpcTransport

SETUPS = ("plaintext", "tls", "tls+signed")
TOPOLOGY = Path(__file__).resolve().parents[1] / "topologies" / "ring8.yaml"


def _pair(setup: str, files: dict, keys: list[PeerKeys]) -> tuple[GrpcTransport, GrpcTransport]:
    options = [
        GrpcOptions(
            tls=files[f"peer{r}"] if setup != "plaintext" else None,
            keys=keys[r] if setup == "tls+signed" else None,
        )
        for r in (0, 1)
    ]
    sender = GrpcTransport(Identity(0, "bench", "m"), [1], options=options[0])
    receiver = GrpcTransport(Identity(1, "bench", "m"), [0], options=options[1])
    sender.connect({1: receiver.address}, timeout=10)
    return sender, receiver


def envelope_times(sizes_kib: list[int], trials: int) -> dict[str, dict[str, float]]:
    """Median seconds to deliver one envelope of each size, per set-up."""
    private = [Ed25519PrivateKey.generate() for _ in range(2)]
    keys = [PeerKeys(k, {r: p.public_key() for r, p in enumerate(private)}) for k in private]
    results: dict[str, dict[str, float]] = {}
    with throwaway_certificates(["peer0", "peer1"]) as files:
        pairs = {setup: _pair(setup, files, keys) for setup in SETUPS}
        try:
            round = 0  # the mailbox only moves forward: one round per envelope over all sizes
            for kib in sizes_kib:
                x = torch.randn(kib * 256, generator=torch.Generator().manual_seed(kib))
                for _, receiver in pairs.values():
                    receiver.inbox.expect("b", (tensor_spec("x", x),))
                times: dict[str, list[float]] = {setup: [] for setup in SETUPS}
                for trial in range(trials + 1):  # the first is a warm-up
                    round += 1
                    for setup, (sender, receiver) in pairs.items():
                        receiver.inbox.open_round(round)
                        envelope = Envelope(0, round, "b", (encode_raw("x", x),))
                        start = time.perf_counter()
                        sender.send(1, envelope, time.monotonic() + 60)
                        if trial:
                            times[setup].append(time.perf_counter() - start)
                results[f"{kib} KiB"] = {s: statistics.median(t) for s, t in times.items()}
        finally:
            for sender, receiver in pairs.values():
                sender.close()
                receiver.close()
    return results


def round_times(rounds: int, trials: int) -> dict[str, float]:
    """Median wall seconds per round of `simulate` on ring8, per set-up."""
    topology = load_topology(TOPOLOGY)
    config = TrainConfig(algorithm="dpsgd", rounds=rounds, eval_every=0)
    runs: dict[str, Callable[[], object]] = {
        "plaintext": lambda: run_simulation(config, topology),
        "tls": lambda: run_simulation(config, topology, tls=True),
        "tls+signed": lambda: run_simulation(config, topology, tls=True, authenticate=True),
    }
    times: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    for _ in range(trials):
        for setup, run in runs.items():
            report = run()
            times[setup].append(report.wall_seconds / rounds)  # type: ignore[attr-defined]
    return {setup: statistics.median(t) for setup, t in times.items()}


def _ratios(medians: dict[str, float]) -> dict[str, float]:
    return {
        "tls_vs_plaintext": medians["tls"] / medians["plaintext"],
        "signed_vs_tls": medians["tls+signed"] / medians["tls"],
        "signed_vs_plaintext": medians["tls+signed"] / medians["plaintext"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[16, 16384])
    parser.add_argument("--trials", type=int, default=30, help="envelopes per size and set-up")
    parser.add_argument("--rounds", type=int, default=100, help="simulate rounds per run")
    parser.add_argument("--round-trials", type=int, default=3, help="simulate runs per set-up")
    args = parser.parse_args()
    torch.set_num_threads(1)
    envelopes = envelope_times(args.sizes_kib, args.trials)
    rounds = round_times(args.rounds, args.round_trials)
    table = Table(title="security overhead (medians; ratios in the same run)")
    for column in ("what", *SETUPS, "TLS / plain", "signed / TLS", "signed / plain"):
        table.add_column(column, justify="right")
    rows = {**{f"envelope {k}": v for k, v in envelopes.items()}, "ring8 dpsgd round": rounds}
    for what, medians in rows.items():
        ratios = _ratios(medians)
        table.add_row(
            what,
            *(f"{medians[s] * 1e3:.2f} ms" for s in SETUPS),
            *(f"{r:.2f}x" for r in ratios.values()),
        )
    Console().print(table)
    if args.json:
        result = {
            "command": "python benchmarks/security.py "
            + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items()
                if v is not None
            ),
            "seconds": {what: medians for what, medians in rows.items()},
            "ratios": {what: _ratios(medians) for what, medians in rows.items()},
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
