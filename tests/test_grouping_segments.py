"""Merged groups keep a scale per parameter (gossip/grouping.py with compress/segmented.py): the
wire tensor of a merged group declares the segmented codec and its exact size, and gossip over
one merged sign group computes per-tensor gossip bit for bit, where one scale for the group
would not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import build_network, gossip_round, stacked
from torch import nn

from gossipcomp.compress import bitpack, parse_spec
from gossipcomp.gossip import Choco
from gossipcomp.gossip.base import GossipAlgorithm
from gossipcomp.gossip.def_atc import DEFATC
from gossipcomp.gossip.grouping import Grouping
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import Schedule
from gossipcomp.topology import build_topology

RING4 = build_topology("ring", n=4)


def _model(seed: int) -> nn.Module:
    """Two layers whose tensors lie 1e4 apart in scale."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        model[0].weight.mul_(100.0)
        model[2].bias.mul_(0.01)
    return model


def _params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters())


def test_merged_groups_declare_the_segmented_codec_and_its_exact_size():
    params = _params(_model(0))
    names = [n for n, _ in params]
    groups = (TensorGroup(tuple(names[:3]), "sign"), TensorGroup((names[3],), "sign"))
    grouping = Grouping(params, parse_spec("sign"), groups)
    spec = grouping.spec(lambda group, data, sender, round: torch.zeros(0))
    merged = sum(p.numel() for _, p in params[:3])
    assert [s.codec for s in spec] == ["sign/segments", "sign"]
    assert spec[0].nbytes == 4 * 3 + bitpack.plane_bytes(merged)  # one scale per parameter
    assert spec[1].nbytes == 4 + bitpack.plane_bytes(params[3][1].numel())
    sparse = Grouping(params, parse_spec("sign"), (TensorGroup(tuple(names), "topk:ratio=0.5"),))
    assert [s.codec for s in sparse.spec(lambda *_: torch.zeros(0))] == ["topk"]


ALGORITHMS: dict[str, Callable[[], GossipAlgorithm]] = {
    "choco": lambda: Choco(parse_spec("sign"), consensus_step=0.4),
    "def": lambda: DEFATC(parse_spec("sign")),
    "choco-ef": lambda: Choco(parse_spec("ef+onebit"), consensus_step=0.4),
}


def _run(algorithm: str, schedule: Schedule | None, rounds: int) -> list[torch.Tensor]:
    models = [_model(7 + rank) for rank in range(4)]
    peers = build_network(RING4, models, ALGORITHMS[algorithm])
    try:
        if schedule is not None:
            for peer in peers:
                peer.apply(schedule)
        for _ in range(rounds):
            gossip_round(peers)
        return stacked(peers)
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_one_merged_group_computes_per_tensor_gossip_bit_for_bit(algorithm):
    """Same signs, the same scales per tensor: after 8 rounds (7 merged) every parameter is
    exactly where per-tensor compression put it, the 0.01-scale bias included, though the
    merged buffer's mean |x| is set by the 100-scale weight (Choco, DEF-ATC, and error
    feedback whose memory moves into the merged group at the switch)."""
    names = [n for n, _ in _params(_model(0))]
    spec = "ef+onebit" if algorithm == "choco-ef" else "sign"
    merged = Schedule(1, 1, (TensorGroup(tuple(names), spec),), planner="single")
    per_tensor, single = _run(algorithm, None, 8), _run(algorithm, merged, 8)
    initial = [[p.detach().double() for p in _model(7 + r).parameters()] for r in range(4)]
    start = [torch.stack(values) for values in zip(*initial, strict=True)]
    for before, a, b in zip(start, per_tensor, single, strict=True):
        moved = float((a - before).norm())
        assert moved > 0  # gossip did something to every parameter
        assert torch.equal(a, b)
