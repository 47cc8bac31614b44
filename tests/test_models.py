"""The models every peer builds from a seed: identical everywhere, global RNG untouched."""

from __future__ import annotations

import torch

from gossipcomp.workload.models import build_resmlp, model_signature


def test_resmlp_has_over_100_tensors_and_is_identical_from_a_seed() -> None:
    state = torch.get_rng_state()
    first, second, other = build_resmlp(3), build_resmlp(3), build_resmlp(4)
    assert torch.equal(state, torch.get_rng_state())  # the global generator was not used
    params = list(first.parameters())
    assert len(params) >= 100
    assert all(torch.equal(a, b) for a, b in zip(params, second.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(params, other.parameters(), strict=True))
    assert model_signature(first) == model_signature(other)
    assert first(torch.randn(5, 64)).shape == (5, 10)
