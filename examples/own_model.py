"""Your own model, optimizer and data on the Peer API: six peers on a 2x3 torus, real gRPC.

Run: python examples/own_model.py [--steps 300] [--local-steps 1]
The model has BatchNorm and Dropout, each peer trains it with Adam on its own torch DataLoader
over its share of scikit-learn's breast cancer data (standardised), and gossips with PowerGossip
rank 2 after every `--local-steps` steps. BatchNorm's running statistics are buffers: the Peer
gossips them with the parameters (`gossip_buffers=True`, the default), so every peer evaluates
with the same statistics. The same model trained centrally, on all the data, is the yardstick.
"""

from __future__ import annotations

import argparse
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gossipcomp.gossip import PowerGossip
from gossipcomp.peer import Peer
from gossipcomp.topology import build_topology
from gossipcomp.workload.data import load_split, parse_partition, partition_indices
from gossipcomp.workload.training import evaluate_accuracy

SEED = 0


def build_model() -> nn.Module:
    """Any torch module works; every peer must start from the same weights (a shared seed)."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(30, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, 2),
    )


def batches(loader: DataLoader, steps: int):
    """`steps` minibatches, going round the loader as often as needed."""
    done = 0
    while True:
        for batch in loader:
            if done == steps:
                return
            yield batch
            done += 1


def train(model: nn.Module, loader: DataLoader, steps: int, peer: Peer | None = None) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for x, y in batches(loader, steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if peer is not None:
            peer.after_local_step()  # gossips after every `local_steps` of these


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--local-steps", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_split("breast-cancer", seed=SEED)
    topology = build_topology("torus", rows=2, cols=3)
    parts = partition_indices(data.y_train.numpy(), topology.n, parse_partition("iid"), SEED)
    peers = [
        Peer.over_grpc(
            build_model(),
            topology,
            rank,
            PowerGossip(rank=2, consensus_step=topology.optimal_consensus_step),
            bind="127.0.0.1:0",
            local_steps=args.local_steps,
        )
        for rank in range(topology.n)
    ]
    try:
        addresses = {p.rank: p.address for p in peers}
        for peer in peers:
            peer.start(timeout=30, addresses=addresses)
        workers = []
        for peer in peers:
            index = torch.as_tensor(parts[peer.rank])
            own = TensorDataset(data.x_train[index], data.y_train[index])
            loader = DataLoader(
                own, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(peer.rank)
            )
            workers.append(
                threading.Thread(target=train, args=(peer.model, loader, args.steps, peer))
            )
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for peer in peers:
            stats = peer.stats
            accuracy = evaluate_accuracy(peer.model, data.x_test, data.y_test)
            print(
                f"peer {peer.rank}: test accuracy {accuracy:.3f}, {stats.local_steps} local "
                f"steps, {stats.rounds} gossip rounds, {stats.bytes_sent_total / 1e6:.2f} MB sent"
            )
        means = torch.stack([p.model[1].running_mean for p in peers])
        weights = torch.stack([p.model[0].weight.detach().reshape(-1) for p in peers])
        print(
            f"largest difference between peers: BatchNorm running mean "
            f"{float((means - means.mean(0)).abs().max()):.4f}, first layer weights "
            f"{float((weights - weights.mean(0)).abs().max()):.4f}"
        )
    finally:
        for peer in peers:
            peer.close()
    central = build_model()
    everything = TensorDataset(data.x_train, data.y_train)
    loader = DataLoader(
        everything, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )
    train(central, loader, args.steps)
    print(f"central: test accuracy {evaluate_accuracy(central, data.x_test, data.y_test):.3f}")


if __name__ == "__main__":
    main()
