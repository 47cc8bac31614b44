"""The model every peer trains, built identically from a shared seed, plus its identity hash.

Decentralized algorithms (PowerGossip, Choco) need identical initial models on all peers; building
from a seed with a private ``torch.Generator`` gives that without a broadcast and without touching
torch's global RNG.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch
from torch import nn


def build_mlp(
    seed: int,
    input_dim: int = 64,
    hidden: Sequence[int] = (256, 256),
    num_classes: int = 10,
) -> nn.Module:
    """A ReLU MLP ``input_dim -> hidden... -> num_classes``, initialised only from ``seed``.

    Weights and biases follow torch's default ``nn.Linear`` scheme, U(-1/sqrt(fan_in),
    +1/sqrt(fan_in)), drawn from a private generator, so the same seed gives bitwise identical
    parameters on every peer and the global RNG is left alone.
    """
    widths = [input_dim, *hidden, num_classes]
    if any(int(w) < 1 for w in widths):
        raise ValueError(f"all layer widths must be >= 1, got {widths}")
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        # Built on the meta device: no default init runs, so the global RNG is not consumed.
        layers.append(nn.Linear(int(fan_in), int(fan_out), device="meta"))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
    return model


def model_signature(model: nn.Module) -> str:
    """Hex sha256 of the (name, shape, dtype) of every parameter, in registration order.

    Peers compare it in the handshake: equal signatures mean the flat parameter layouts agree.
    Values are not hashed, so training does not change the signature.
    """
    layout = [[name, list(p.shape), str(p.dtype)] for name, p in model.named_parameters()]
    blob = json.dumps(layout, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def parameter_vector(model: nn.Module, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A detached, flattened copy of all parameters (float64 by default), for metrics."""
    params = [p.detach().reshape(-1).to(dtype=dtype) for p in model.parameters()]
    if not params:
        return torch.empty(0, dtype=dtype)
    return torch.cat(params)
