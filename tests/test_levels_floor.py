"""A broadcasting peer's levels have a floor (levels/codecs.py `BroadcastLevels.floor`): the
rate controller chooses among levels whose payload is at least a third of the configured
one's, so a peer on a slow link compresses harder than configured, but not down to top-k
ratios of 1e-4 (a hundred bytes a round: no learning), where Choco's ends of the slow link
went in docs/benchmarks.md run 5."""

from __future__ import annotations

import torch

from gossipcomp.compress import parse_spec
from gossipcomp.levels.codecs import FLOOR_DIVISOR, BroadcastLevels
from gossipcomp.levels.rate import RateController

KEY = (0, 1)


def _levels(spec: str) -> BroadcastLevels:
    """The ladder of `spec` for an MLP of 64-256-256-10 (the benchmark's digits model)."""
    shapes = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
    params = [(f"p{i}", torch.zeros(shape)) for i, shape in enumerate(shapes)]
    return BroadcastLevels(params, parse_spec(spec), rank=0, neighbours=[1, 2])


def test_the_floor_is_the_lowest_level_within_a_third_of_the_configured_payload() -> None:
    levels = _levels("topk:ratio=0.05")
    ladder = levels.ladder
    assert ladder.spec(levels.floor) == "topk:ratio=0.02"
    configured = ladder.nbytes[ladder.default - 1]
    assert ladder.nbytes[levels.floor - 1] >= configured / FLOOR_DIVISOR
    assert ladder.nbytes[levels.floor - 2] < configured / FLOOR_DIVISOR
    costs = levels.costs(1)
    assert costs.levels[0] == levels.floor  # nothing below it to choose
    assert costs.levels[-1] == ladder.top  # and every level above it, identity included
    assert costs.bytes_per_round[ladder.default] == configured
    # a configured level at the bottom of its ladder is its own floor
    bottom = _levels("topk:ratio=0.0001")
    assert bottom.floor == bottom.ladder.default == 1


def test_a_link_too_slow_for_any_level_holds_the_floor_not_the_ladder_bottom() -> None:
    """A link that carries 100 KB/s, a 10 ms budget: no level fits. The controller takes the
    lowest level it may choose, which was top-k 1e-4 (the ladder's bottom) and is now 0.02."""
    levels = _levels("topk:ratio=0.05")
    controller = RateController(levels.costs(1))
    nbytes = levels.ladder.nbytes[levels.ladder.default - 1]
    sends = [(nbytes, nbytes / 100_000)] * 8
    chosen = controller.update({}, {KEY: [sends]}, 0.010)[KEY]
    assert levels.ladder.spec(chosen) == "topk:ratio=0.02"
