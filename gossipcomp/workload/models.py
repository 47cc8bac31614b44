"""The model every peer trains, built identically from a shared seed, plus its identity hash.

Decentralized algorithms (PowerGossip, Choco) need identical initial models on all peers; building
from a seed with a private ``torch.Generator`` gives that without a broadcast and without touching
torch's global RNG.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gossipcomp.inputs.text import quoted
from gossipcomp.workload.catalog import MODEL_NAMES


def on_cpu_uninitialised(model: nn.Module) -> nn.Module:
    """`model`, built on the meta device (so no default initialisation ran and torch's global
    RNG was not drawn from), with every parameter and buffer given uninitialised CPU storage of
    its shape and dtype, for the builder to fill from its own generator. What
    `to_empty(device="cpu")` does, without its path through torch's reference operators, which
    imports sympy (0.3 s of every process's start-up)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            storage = torch.empty(param.shape, dtype=param.dtype)
            setattr(module, name, nn.Parameter(storage, requires_grad=param.requires_grad))
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype))
    return model


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
    model = on_cpu_uninitialised(nn.Sequential(*layers))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
    return model


class ResidualBlock(nn.Module):
    """x + Linear(ReLU(LayerNorm(x))): a pre-normalised residual block of constant width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, device="meta")
        self.linear = nn.Linear(width, width, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(torch.relu(self.norm(x)))


class ResidualMLP(nn.Module):
    """input -> Linear -> `depth` residual blocks -> LayerNorm -> Linear -> classes.

    Four parameter tensors per block (norm weight and bias, linear weight and bias): many small
    tensors of mixed sizes, the case merged compression is for.
    """

    def __init__(self, input_dim: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(input_dim, width, device="meta")
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width, device="meta")
        self.head = nn.Linear(width, num_classes, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x))))


def build_resmlp(
    seed: int,
    input_dim: int = 64,
    width: int = 64,
    depth: int = 24,
    num_classes: int = 10,
) -> nn.Module:
    """A deep residual MLP (4 x depth + 6 parameter tensors: 102 by default), initialised only
    from `seed` like `build_mlp`. Each block's output layer starts at a tenth of torch's
    default scale so that the residual stream stays near the identity at initialisation."""
    if min(input_dim, width, num_classes) < 1 or depth < 0:
        raise ValueError(
            f"widths must be >= 1 and depth >= 0, got input_dim={input_dim}, width={width}, "
            f"depth={depth}, num_classes={num_classes}"
        )
    model = on_cpu_uninitialised(ResidualMLP(input_dim, width, depth, num_classes))
    generator = torch.Generator().manual_seed(seed)
    block_outputs = {block.linear for block in model.blocks}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                bound = 1.0 / math.sqrt(module.in_features)
                if module in block_outputs:
                    bound *= 0.1
                module.weight.uniform_(-bound, bound, generator=generator)
                module.bias.uniform_(-bound, bound, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
    return model


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions with BatchNorm over the 8x8 digits image, a pooling, a classifier.

    Its input is the flat 64-pixel row the data sets give; BatchNorm's running statistics are
    buffers, which peers gossip with the parameters (models.gossiped_tensors)."""

    side = 8  # digits images are 8 x 8

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, device="meta"),
            nn.BatchNorm2d(channels, device="meta"),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, device="meta"),
            nn.BatchNorm2d(2 * channels, device="meta"),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        pooled = 2 * channels * (self.side // 2) ** 2
        self.head = nn.Linear(pooled, num_classes, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = x.reshape(x.shape[0], 1, self.side, self.side)
        return self.head(self.features(image).flatten(1))


def build_cnn(
    seed: int, input_dim: int = 64, num_classes: int = 10, channels: int = 16
) -> nn.Module:
    """A small CNN for the 8x8 digits (input_dim 64 only), initialised only from `seed` like
    `build_mlp` (torch's default bound 1/sqrt(fan_in) for convolutions and the classifier;
    BatchNorm at scale 1, shift 0, running mean 0 and variance 1)."""
    if input_dim != DigitsCNN.side**2:
        raise ValueError(
            f"model cnn reads 8x8 images (64 features), got {input_dim} features; expected the "
            "digits data set, or model mlp or resmlp for tabular data"
        )
    if min(num_classes, channels) < 1:
        raise ValueError(f"num_classes and channels must be >= 1, got {num_classes}, {channels}")
    model = on_cpu_uninitialised(DigitsCNN(channels, num_classes))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                fan_in = module.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                module.weight.uniform_(-bound, bound, generator=generator)
                assert module.bias is not None
                module.bias.uniform_(-bound, bound, generator=generator)
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()  # scale 1, shift 0, running statistics reset
    return model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only.

    The causal mask is a boolean buffer registered non-persistent: not in the state_dict, so
    never gossiped, never checkpointed and not a constant buffer (models.gossiped_tensors); a
    peer's copy is rebuilt with the model. Boolean, so no -inf value exists to be averaged."""

    def __init__(self, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, device="meta")
        self.out = nn.Linear(width, width, device="meta")
        self.register_buffer("mask", causal_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            part.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=-1)
        )
        mask = self.mask[:length, :length]
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(mixed.transpose(1, 2).reshape(batch, length, width))


def causal_mask(context: int) -> torch.Tensor:
    """[context, context] booleans, True where a query position may attend to a key position
    (the key is not later)."""
    return torch.ones(context, context, dtype=torch.bool).tril()


class TransformerBlock(nn.Module):
    """Pre-normalised: x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)) (4x wide, GELU)."""

    def __init__(self, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, device="meta")
        self.attention = CausalSelfAttention(width, heads, context)
        self.norm2 = nn.LayerNorm(width, device="meta")
        self.up = nn.Linear(width, 4 * width, device="meta")
        self.down = nn.Linear(4 * width, width, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CharTransformer(nn.Module):
    """A character-level language model: ids [B, T] (T <= context) to next-character logits
    [B, T, vocabulary]. Token embedding plus a learned position embedding, `depth` blocks, a
    final LayerNorm, and the output layer tied to the token embedding (its transpose: one
    tensor, trained and gossiped once)."""

    def __init__(self, vocabulary: int, context: int, width: int, depth: int, heads: int):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocabulary, width, device="meta")
        self.position = nn.Parameter(torch.empty(context, width, device="meta"))
        self.blocks = nn.Sequential(
            *(TransformerBlock(width, heads, context) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(width, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.ndim != 2 or ids.shape[1] > self.context or ids.is_floating_point():
            raise ValueError(
                f"chartransformer reads integer character ids [batch, at most {self.context}], "
                f"got {ids.dtype} of shape {tuple(ids.shape)}; expected a text data set "
                "(pysource)"
            )
        h = self.embed(ids) + self.position[: ids.shape[1]]
        return F.linear(self.norm(self.blocks(h)), self.embed.weight)


def build_chartransformer(
    seed: int,
    input_dim: int = 64,
    num_classes: int = 101,
    width: int = 48,
    depth: int = 2,
    heads: int = 4,
) -> nn.Module:
    """A small character-level transformer (about 64 thousand parameters by default) for a
    context of `input_dim` characters and a vocabulary of `num_classes`, initialised only from
    `seed` (private generator, as `build_mlp`): embeddings and linear weights N(0, 0.02), the
    residual branches' output layers N(0, 0.02 / sqrt(2 depth)) as in GPT-2, biases 0,
    LayerNorm at scale 1, shift 0."""
    if min(input_dim, num_classes, width, depth, heads) < 1 or width % heads:
        raise ValueError(
            f"context, vocabulary, width, depth and heads must be >= 1 and heads must divide "
            f"width, got context={input_dim}, vocabulary={num_classes}, width={width}, "
            f"depth={depth}, heads={heads}"
        )
    model = on_cpu_uninitialised(CharTransformer(num_classes, input_dim, width, depth, heads))
    generator = torch.Generator().manual_seed(seed)
    branch_outputs = {m for block in model.blocks for m in (block.attention.out, block.down)}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                std = 0.02 / math.sqrt(2 * depth) if module in branch_outputs else 0.02
                module.weight.normal_(0.0, std, generator=generator)
                module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, CausalSelfAttention):  # left uninitialised
                module.mask.copy_(causal_mask(input_dim))
        model.position.normal_(0.0, 0.02, generator=generator)
    return model


#: The models that read text (integer character ids, next-character targets); every other
#: model reads rows of float features with one label each.
LANGUAGE_MODELS = frozenset({"chartransformer"})


def gossiped_tensors(
    model: nn.Module, gossip_buffers: bool = True, constant_buffers: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """What gossip averages: every parameter, then (with `gossip_buffers`) the floating-point
    buffers training changes, such as BatchNorm's running mean and variance, so that peers
    evaluate with the same statistics. Left out, each peer keeping its own: integer buffers
    (BatchNorm's num_batches_tracked counts steps), non-persistent buffers (not part of the
    model's state: register_buffer(..., persistent=False)) and, with `constant_buffers`, the
    buffers that are not a normalisation layer's running statistics (`constant_tensors`)."""
    tensors = list(model.named_parameters())
    if gossip_buffers:
        constant = {name for name, _ in constant_tensors(model, gossip_buffers, constant_buffers)}
        tensors += [
            (name, b) for name, b in _persistent_float_buffers(model) if name not in constant
        ]
    return tensors


def constant_tensors(
    model: nn.Module, gossip_buffers: bool = True, constant_buffers: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """The buffers taken as constant: equal on every peer and never changed by training (a
    causal mask, a positional table), so gossiping them would only cost bytes. With
    `gossip_buffers` and `constant_buffers`, every persistent floating-point buffer but the
    running statistics of normalisation layers (modules with `track_running_stats` set). The
    model signature holds their values, so peers whose copies differ are refused at the
    handshake; Peer checks every round that training left them unchanged."""
    if not (gossip_buffers and constant_buffers):
        return []
    statistics = {
        name
        for prefix, module in model.named_modules()
        if getattr(module, "track_running_stats", False) is True
        for name, _ in module.named_buffers(prefix=prefix, recurse=False)
    }
    return [(name, b) for name, b in _persistent_float_buffers(model) if name not in statistics]


def _persistent_float_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The floating-point buffers in the model's state_dict (non-persistent ones are not)."""
    state = model.state_dict(keep_vars=True)
    return [(n, b) for n, b in model.named_buffers() if b.is_floating_point() and n in state]


def model_signature(
    model: nn.Module, gossip_buffers: bool = True, constant_buffers: bool = True
) -> str:
    """Hex sha256 of the (name, shape, dtype) of every parameter, in registration order, then of
    every buffer with whether it is gossiped, kept local, or constant (with a sha256 of its
    values: peers whose constant buffers differ would never agree, so they are refused).

    Peers compare it in the handshake: equal signatures mean the flat layouts of what they
    exchange agree. Other values are not hashed, so training does not change the signature; a
    model without buffers has the signature of its parameters alone.
    """
    layout = [[name, list(p.shape), str(p.dtype)] for name, p in model.named_parameters()]
    gossiped = {name for name, _ in gossiped_tensors(model, gossip_buffers, constant_buffers)}
    constant = dict(constant_tensors(model, gossip_buffers, constant_buffers))
    layout += [
        [name, list(b.shape), str(b.dtype), _buffer_role(name, gossiped, constant)]
        for name, b in model.named_buffers()
    ]
    blob = json.dumps(layout, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _buffer_role(name: str, gossiped: set[str], constant: dict[str, torch.Tensor]) -> str:
    if name in gossiped:
        return "gossiped"
    if name in constant:
        return f"constant:{tensor_digest(constant[name])}"
    return "local"


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex sha256 of a tensor's values (its bytes in row-major order)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def parameter_vector(model: nn.Module, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A detached, flattened copy of all parameters (float64 by default), for metrics."""
    params = [p.detach().reshape(-1).to(dtype=dtype) for p in model.parameters()]
    if not params:
        return torch.empty(0, dtype=dtype)
    return torch.cat(params)


ModelFactory = Callable[..., nn.Module]  # (seed, input_dim=, num_classes=) -> model


def build_wide_mlp(seed: int, input_dim: int = 64, num_classes: int = 10) -> nn.Module:
    """Two hidden layers of 1024: about 1.1M parameters on digits, big enough that sending the
    whole model over a 10 Mbit/s link takes seconds (the bandwidth-adaptive benchmark)."""
    return build_mlp(seed, input_dim, (1024, 1024), num_classes)


MODELS: dict[str, ModelFactory] = dict(
    zip(
        MODEL_NAMES,
        (build_mlp, build_wide_mlp, build_cnn, build_resmlp, build_chartransformer),
        strict=True,
    )
)


def build_model(name: str, seed: int, input_dim: int = 64, num_classes: int = 10) -> nn.Module:
    """A registered model for `input_dim` features and `num_classes` classes (by default
    digits': 8x8 images, 10 classes), initialised only from `seed`."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {quoted(name)}; known: {sorted(MODELS)}") from None
    return factory(seed, input_dim=input_dim, num_classes=num_classes)
