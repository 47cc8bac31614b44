"""A peer's parts built from a TrainConfig: its gossip algorithm, static schedule, data, model
and share of the training examples.

Both ways of running (every peer in one process, or one peer per process) build them here, so
every peer of a network gets the same ones from the same configuration.
"""

from __future__ import annotations

import logging

import torch

from gossipcomp.compress import parse_spec
from gossipcomp.experiment.config import TrainConfig
from gossipcomp.gossip import (
    Byzantine,
    GossipAlgorithm,
    NamedParams,
    make_algorithm,
    make_attack,
    parse_clip,
)
from gossipcomp.gossip.clipping import AdaptiveRadius, ClipRadius
from gossipcomp.gossip.specs import BuildContext
from gossipcomp.schedule import CompressorCost, CostModel, LinkCost, TensorInfo, make_planner
from gossipcomp.schedule.schedule import Schedule
from gossipcomp.topology import Topology
from gossipcomp.workload.data import DigitsSplit, load_split, parse_partition, partition_indices
from gossipcomp.workload.models import build_model

log = logging.getLogger("gossipcomp.experiment")  # the package's logger, as before the split

# Static schedules (--schedule without a coordinator) are planned from one reference cost model,
# the same on every peer, so every peer computes the same plan without a word exchanged: a
# compressor call costs 60 us plus 2 ns an element, a loopback envelope 0.4 ms plus 1 ns a
# byte (the order measured on this project's 2-core machine, docs/benchmarks.md). A
# coordinator plans from what the peers measured instead.
REFERENCE_COMPRESSION = CompressorCost(fixed_s=60e-6, per_element_s=2e-9)
REFERENCE_LINK = LinkCost(latency_s=4e-4, seconds_per_byte=1e-9)


def build_algorithm(config: TrainConfig, topology: Topology, rank: int) -> GossipAlgorithm:
    """The configured gossip algorithm of peer `rank`, with step sizes resolved against the
    topology, clipped gossip when configured, and wrapped as a liar when `rank` is Byzantine."""
    outside = [r for r in config.byzantine if r >= topology.n]
    if outside:
        raise ValueError(
            f"byzantine rank {outside[0]} out of range for topology {topology.name} "
            f"(ranks 0 to {topology.n - 1})"
        )
    if len(config.byzantine) == topology.n:  # distinct ranks, all in range: every one
        raise ValueError(
            f"no honest peer left to measure: --byzantine lists every rank of topology "
            f"{topology.name} (0 to {topology.n - 1})"
        )
    clipping = None if config.clip is None else parse_clip(config.clip)
    degree = len(topology.neighbors(rank))
    if isinstance(clipping, AdaptiveRadius) and clipping.b >= degree:
        log.warning(
            "peer %d has %d neighbours and --clip %s assumes up to %d of them lie: it will "
            "never mix (a fixed radius, or a smaller B, lets it)",
            rank,
            degree,
            config.clip,
            clipping.b,
        )
    algorithm = _honest_algorithm(config, topology, clipping)
    if rank in config.byzantine:
        return Byzantine(algorithm, make_attack(config.attack, config.attack_scale))
    return algorithm


def _honest_algorithm(
    config: TrainConfig, topology: Topology, clipping: ClipRadius | None
) -> GossipAlgorithm:
    context = BuildContext(config.seed, topology.optimal_consensus_step, clipping)
    return make_algorithm(config.algorithm_spec(), context)


def static_schedule(config: TrainConfig, params: NamedParams) -> Schedule | None:
    """The schedule `config.schedule` names, planned from the reference cost model and in
    force from round 1 (None for 'per-tensor', what a peer runs without a schedule)."""
    if config.schedule == "per-tensor":
        return None
    spec = parse_spec(config.group_compressor or "identity").spec
    costs = CostModel(
        {s: REFERENCE_COMPRESSION for s in {spec, "identity", "fp16"}},
        REFERENCE_LINK,
        compute_s=0.0,
    )
    tensors = [TensorInfo(name, p.numel()) for name, p in params]
    groups = make_planner(config.schedule).plan(tensors, costs, spec)
    return Schedule(1, 1, tuple(groups), planner=config.schedule)


def load_data(config: TrainConfig) -> DigitsSplit:
    """The configured data set, split by the configured seed (the same on every peer)."""
    return load_split(config.dataset, seed=config.seed)


def build_config_model(config: TrainConfig, data: DigitsSplit) -> torch.nn.Module:
    """The configured model, sized for `data` and initialised from the configured seed."""
    return build_model(config.model, config.seed, data.num_features, data.num_classes)


def peer_examples(
    data: DigitsSplit, topology: Topology, rank: int, config: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training examples that `rank` holds under the configured partition."""
    parts = partition_indices(
        data.y_train.numpy(), topology.n, parse_partition(config.partition), config.seed
    )
    index = torch.as_tensor(parts[rank], dtype=torch.int64)
    return data.x_train[index], data.y_train[index]
