"""A custom training loop on the Peer API: four peers on a ring, one thread each, real gRPC.

Run: python examples/custom_loop.py
Each peer trains its own copy of the model on its share of digits with its own optimizer and
calls `peer.gossip()` after every step; the Peer does the rest (handshake, exchange, mixing,
accounting). The peers share this process, so they take turns computing (ComputeTurns: two at
once, about one per core; each gives its turn up while gossip waits for its neighbours). In a real deployment each peer is its own process on its own machine, built the
same way with its rank and the topology file's addresses (then `peer.start()` without addresses).
"""

from __future__ import annotations

import threading

import torch

from gossipcomp.gossip import DPSGD
from gossipcomp.gossip.turns import ComputeTurns
from gossipcomp.peer import Peer
from gossipcomp.topology import build_topology
from gossipcomp.workload.data import load_digits_split, parse_partition, partition_indices
from gossipcomp.workload.models import build_mlp
from gossipcomp.workload.training import BatchStream, evaluate_accuracy, local_step, make_optimizer

STEPS = 300
SEED = 0


def train(
    peer: Peer, stream: BatchStream, test: tuple[torch.Tensor, torch.Tensor], turns: ComputeTurns
) -> None:
    optimizer = make_optimizer(peer.model, lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        with turns.turn():
            local_step(peer.model, optimizer, stream.next_batch())
            peer.gossip()
    accuracy = evaluate_accuracy(peer.model, *test)
    stats = peer.stats
    print(
        f"peer {peer.rank}: test accuracy {accuracy:.3f}, "
        f"{stats.bytes_sent_total / 1e6:.1f} MB sent to {sorted(stats.bytes_sent)}, "
        f"compute {stats.compute_seconds:.1f} s, communication {stats.comm_seconds:.1f} s"
    )


def main() -> None:
    torch.set_num_threads(1)
    topology = build_topology("ring", n=4)
    data = load_digits_split(seed=SEED)
    parts = partition_indices(data.y_train.numpy(), topology.n, parse_partition("iid"), SEED)
    turns = ComputeTurns(slots=2)
    peers = [
        Peer.over_grpc(build_mlp(SEED), topology, rank, DPSGD(), bind="127.0.0.1:0", turns=turns)
        for rank in range(topology.n)
    ]
    try:
        addresses = {p.rank: p.address for p in peers}
        for peer in peers:  # every server already listens: handshakes can run one by one
            peer.start(timeout=30, addresses=addresses)
        workers = []
        for peer in peers:
            index = torch.as_tensor(parts[peer.rank])
            stream = BatchStream(data.x_train[index], data.y_train[index], 32, SEED, peer.rank)
            workers.append(
                threading.Thread(
                    target=train, args=(peer, stream, (data.x_test, data.y_test), turns)
                )
            )
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for peer in peers:
            peer.close()


if __name__ == "__main__":
    main()
