"""The Report of a run: every peer's outcome, the consensus distance, and the accuracy of the
network's average model.

One builder for both modes ("simulate": all peers here; "peer": one peer, which learns the
average from its neighbours), so their reports hold the same fields computed the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossipcomp.experiment import PeerOutcome, TrainConfig, build_config_model
from gossipcomp.experiment.report import Report, flat, mean_loss, merge_history, peer_reports
from gossipcomp.topology import Topology
from gossipcomp.workload.data import DigitsSplit
from gossipcomp.workload.models import gossiped_tensors
from gossipcomp.workload.training import evaluate


def _average_model_evaluation(
    average: Sequence[torch.Tensor], config: TrainConfig, data: DigitsSplit
) -> tuple[float, float]:
    """Test accuracy and loss of a model holding `average`, the network average of the
    gossiped tensors (models.gossiped_tensors, in that order)."""
    model = build_config_model(config, data)
    with torch.no_grad():
        for (_, p), value in zip(
            gossiped_tensors(model, config.gossip_buffers), average, strict=True
        ):
            p.copy_(value)
    return evaluate(model, data.x_test, data.y_test)


def _report(
    mode: str,
    config: TrainConfig,
    topology: Topology,
    outcomes: Sequence[PeerOutcome],
    distances: Sequence[float],
    average: Sequence[torch.Tensor],
    data: DigitsSplit,
    wall_seconds: float,
) -> Report:
    accuracies = [o.test_accuracy for o in outcomes]
    per_peer = peer_reports(outcomes, distances, config.byzantine)
    average_accuracy, average_loss = _average_model_evaluation(average, config, data)
    return Report(
        mode=mode,
        algorithm=config.algorithm,
        topology=topology.name,
        rounds=config.rounds,
        final_test_accuracy=sum(accuracies) / len(accuracies),
        min_test_accuracy=min(accuracies),
        consensus_distance=sum(distances) / len(distances),
        average_model_test_accuracy=average_accuracy,
        average_model_norm=float(flat(average).norm()),
        bytes_sent_total=sum(o.stats.bytes_sent_total for o in outcomes),
        wall_seconds=wall_seconds,
        per_peer=per_peer,
        history=merge_history(outcomes),
        config={**config.to_dict(), "topology_file": topology.source},
        local_steps=config.local_steps,
        gossip_rounds=max(o.stats.rounds for o in outcomes),
        final_test_loss=mean_loss([o.test_loss for o in outcomes]),
        average_model_test_loss=average_loss,
    )
