"""Every rank runs the same synchroniser: a check, before its first collective, that the ranks
agree on the spec, its resolved options and the parameter layout.

Ranks given different specs do not fail cleanly by themselves: payloads of different sizes make
gloo abort ("Received data size doesn't match"), a different all-gather hangs until the timeout,
and equal sizes with different meanings (powersgd with and without warm start, another seed for
random-k) train silently worse. So `register()`, `MergedSync`, `MarsitSync` and `SSDSGD` (and
`gossipcomp allreduce` for its whole configuration) describe their setup as plain data and call
`check_same_setup` before anything else is exchanged:

1. one all-gather of a fixed size on every rank whatever its setup (a SHA-256 digest of the
   canonical JSON of the description, and its length), so a mismatch cannot abort or hang;
2. only when the digests differ: one all-gather of the descriptions (padded to the longest, whose
   length every rank now knows), so that every rank raises the same `SetupMismatch` naming the
   ranks that differ from the majority and the first few entries that differ, with both values.

Options are described resolved (a compressor by its canonical spec with every parameter, a hook
state by all of its option fields), never by the string the user typed: `powersgd:rank=2` and
`powersgd:rank=2,warm_start=false` differ, `topk:ratio=0.01` and `topk` with that default do not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossipcomp.allreduce.comm import Communicator
from gossipcomp.allreduce.liveness import name_ranks

DIGEST_BYTES = 32
HEADER_BYTES = DIGEST_BYTES + 8  # digest, then the description's length (little-endian)
MAX_DESCRIPTION_BYTES = 8 << 20  # longer descriptions are compared by digest only
MAX_LISTED = 6  # differing entries named in the error
MAX_VALUE_CHARS = 80
MAX_RANKS_DETAILED = 3  # differing ranks whose entries are listed (all of them are named)

Setup = Mapping[str, Any]


class SetupMismatch(ValueError):
    """Ranks disagree on a synchroniser's setup; `ranks` are those that differ from the rest."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


def parameter_layout(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Each parameter by name, in order: its shape, dtype and whether it trains."""
    return {
        name: f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
        + ("" if p.requires_grad else " frozen")
        for name, p in named
    }


def options_of(value: object) -> object:
    """`value` as plain JSON data that is equal on two ranks exactly when their options are:
    a compressor by its canonical spec, a dataclass by its option fields (numbers, strings,
    flags, dtypes, compressors; runtime state such as tensors, dictionaries and communicators
    is left out), an optimizer by its class and hyper-parameters, a function by its name."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    spec = getattr(value, "spec", None)
    if isinstance(spec, str):  # a compressor: its canonical spec names every parameter
        return spec
    if isinstance(value, torch.optim.Optimizer):
        return {
            "class": type(value).__qualname__,
            "groups": [
                {k: options_of(v) for k, v in sorted(g.items()) if k != "params"}
                for g in value.param_groups
            ],
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        described = {"class": type(value).__qualname__}
        for f in dataclasses.fields(value):
            field_value = getattr(value, f.name)
            if _is_option(field_value):
                described[f.name] = options_of(field_value)  # type: ignore[assignment]
        return described
    if isinstance(value, Mapping):
        return {str(k): options_of(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [options_of(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return options_of(value.item())
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return type(value).__qualname__


def _is_option(value: object) -> bool:
    return (
        value is None
        or isinstance(value, bool | int | float | str | torch.dtype)
        or isinstance(getattr(value, "spec", None), str)
    )


def check_same_setup(communicator: Communicator, entry: str, setup: Setup) -> None:
    """Raise `SetupMismatch` on every rank unless all ranks of `communicator` passed an equal
    `setup` (module docstring). Runs on the communicator's thread, after anything queued."""
    if communicator.world == 1:
        return
    text = json.dumps(options_of(setup), sort_keys=True, separators=(",", ":"))
    communicator.submit(lambda: _compare(communicator, entry, text.encode())).result()


def check_model_sync(
    communicator: Communicator, entry: str, model: nn.Module, **options: object
) -> None:
    """`check_same_setup` for a synchroniser of a whole model: its trainable parameters' layout
    and `options` (resolved with `options_of`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    setup = {"options": options_of(options), "parameters": parameter_layout(named)}
    check_same_setup(communicator, entry, setup)


def check_ddp_hook(
    communicator: Communicator,
    ddp: nn.Module,
    state: object,
    hook: Callable[..., object],
    half: torch.dtype | None,
    gather_pieces: str,
) -> None:
    """`check_same_setup` for `register()`: the hook, its state's options, the 16-bit wrapper,
    how all_gathers are split (auto times them together), DDP's bucketing options (they decide
    which parameters share a hook call) and the layout."""
    module = ddp.module
    assert isinstance(module, nn.Module)
    bucketing = {
        name: options_of(getattr(ddp, name, None))
        for name in (
            "bucket_bytes_cap",
            "find_unused_parameters",
            "gradient_as_bucket_view",
            "static_graph",
            "broadcast_buffers",
        )
    }
    setup = {
        "hook": options_of(hook),
        "state": options_of(state),
        "half": options_of(half),
        "gather_pieces": options_of(gather_pieces),
        "ddp": bucketing,
        "parameters": parameter_layout(module.named_parameters()),
    }
    check_same_setup(communicator, "register() (DDP hook)", setup)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_bytes(
    data: bytes, size: int, group: dist.ProcessGroup | None, world: int
) -> list[bytes]:
    device = _device(group)
    mine = torch.zeros(size, dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [bytes(part.cpu().numpy().tobytes()) for part in parts]


def _compare(communicator: Communicator, entry: str, text: bytes) -> None:
    group, world = communicator.group, communicator.world
    header = hashlib.sha256(text).digest() + len(text).to_bytes(8, "little")
    headers = _all_gather_bytes(header, HEADER_BYTES, group, world)
    digests = [h[:DIGEST_BYTES] for h in headers]
    if len(set(digests)) == 1:
        return
    lengths = [int.from_bytes(h[DIGEST_BYTES:], "little") for h in headers]
    reference, differing = _majority(digests)
    described = "ranks disagree on the setup of " + entry + ": "
    described += f"{name_ranks(differing)} {'differs' if len(differing) == 1 else 'differ'} from "
    described += f"{name_ranks(reference)}"
    longest = max(lengths)
    if longest > MAX_DESCRIPTION_BYTES:  # too long to gather; every rank knows the digests
        raise SetupMismatch(described + " (descriptions too long to compare in detail)", differing)
    texts = _all_gather_bytes(text, longest, group, world)
    setups = [_decode(texts[r][: lengths[r]]) for r in range(world)]
    details = _differences(setups, reference[0], differing)
    raise SetupMismatch(f"{described}: {details}; every rank needs the same", differing)


def _majority(digests: list[bytes]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks of the most common digest (ties: the one of the lowest rank), and the rest."""
    groups: dict[bytes, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    best = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    return tuple(best), tuple(r for r in range(len(digests)) if r not in best)


def _decode(text: bytes) -> object:
    try:
        return json.loads(text.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "<unreadable description>"


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    """Leaves of nested dicts and lists by dotted path ("options.states.0.seed")."""
    if isinstance(value, dict):
        items: Iterable[tuple[object, object]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix or "setup": value}
    flat: dict[str, object] = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _differences(setups: list[object], reference: int, differing: tuple[int, ...]) -> str:
    """The first entries in which each differing rank's setup differs from `reference`'s."""
    base = _flatten(setups[reference])
    parts = []
    for rank in differing[:MAX_RANKS_DETAILED]:
        other = _flatten(setups[rank])
        keys = [k for k in dict.fromkeys([*base, *other]) if base.get(k, ...) != other.get(k, ...)]
        shown = [
            f"{key} is {_shown(base, key)} on rank {reference}, {_shown(other, key)} on rank {rank}"
            for key in keys[:MAX_LISTED]
        ]
        more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
        parts.append("; ".join(shown) + more)
    return "; ".join(parts)


def _shown(flat: dict[str, object], key: str) -> str:
    if key not in flat:
        return "absent"
    text = json.dumps(flat[key])
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."
