"""DiLoCo over the all-reduce collectives: phases of local steps ended by an outer step.

`gossipcomp allreduce --sync diloco:steps=H,outer=(SPEC),compressor=(SPEC)`. Every rank trains
H steps with its own inner optimizer (its state stays on the rank; no gradient is averaged
during the phase). Then the phase's pseudo-gradient, anchor - local model, goes through one of
the DDP hooks' compressors with its error-feedback memory (hooks.sync_flat: the whole model as
one bucket, so the summable codecs take one all-reduce, the others one all-gather, PowerSGD two
all-reduces) and comes back as the ranks' mean; the outer optimizer (gossipcomp.outer: sgd,
nesterov as DiLoCo, noloco) moves the shared anchor by it, and every rank restarts from that
anchor, so all ranks hold the same model after each phase. The bytes go through the same
Communicator as every other synchroniser, so the reports count them alike.

Spec grammar: "diloco" then optionally ":" and comma-separated key=value items; a value that
holds commas is put in parentheses:
- steps: local steps per phase, an integer in [1, MAX_PHASE_STEPS] (default 16);
- outer: an outer optimizer spec (default "nesterov:lr=0.7,momentum=0.9", DiLoCo's);
- compressor: a compressor spec ("qsgd:levels=127", "topk:ratio=0.01", "sign", ...) or
  "powersgd:rank=R" (default "identity": the exact mean).
Only the model's parameters take part; buffers stay each rank's own (the all-reduce models
have none). Streaming DiLoCo's fragments overlapped with compute are not implemented: a phase
ends with one synchronous exchange.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gossipcomp.allreduce.comm import Communicator
from gossipcomp.allreduce.hooks import (
    POWERSGD,
    CompressedState,
    PowerSGDState,
    make_state,
    parse_hook_spec,
    powersgd_options,
    sync_flat,
)
from gossipcomp.compress import parse_spec
from gossipcomp.gossip.state import require_keys
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.inputs.text import quoted, split_top_level
from gossipcomp.outer.optimizers import OuterSGD, checked_finite, parse_outer

NAME = "diloco"
MAX_SPEC_CHARS = 400
MAX_PHASE_STEPS = 1_000_000
STATE_KEYS = {"phases", "steps_in_phase", "anchor", "outer", "hook"}


@dataclass(frozen=True)
class DiLoCoSpec:
    """A parsed `--sync diloco:...` (module docstring)."""

    steps: int = 16
    outer: str = "nesterov:lr=0.7,momentum=0.9"
    compressor: str = "identity"


def is_diloco(sync: str) -> bool:
    """Whether a --sync value names DiLoCo (with or without arguments)."""
    return isinstance(sync, str) and sync.strip().partition(":")[0].strip() == NAME


def _unwrapped(value: str, spec: str, key: str) -> str:
    if value.startswith("(") and value.endswith(")"):
        value = value[1:-1].strip()
    if "(" in value or ")" in value or not value:
        raise ValueError(
            f"--sync {quoted(spec)}: {key} expected a spec, in one pair of parentheses when it "
            f"holds commas, got {quoted(value)}"
        )
    return value


def check_compressor(spec: str) -> None:
    """Refuse a pseudo-gradient compressor the hooks cannot build (ValueError naming it)."""
    if spec.strip().startswith("torch:"):
        raise ValueError(
            f"{quoted(spec)}: torch's own hooks work on DDP buckets only; expected a "
            "gossipcomp compressor spec or powersgd:rank=R"
        )
    name, values = parse_hook_spec(spec)
    if name == POWERSGD:
        powersgd_options(values)
    else:
        parse_spec(spec)


def parse_diloco(spec: str) -> DiLoCoSpec:
    """Parse and check "diloco[:steps=H,outer=(...),compressor=(...)]" (module docstring)."""
    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS:
        raise ValueError(
            f"--sync: expected a diloco spec of at most {MAX_SPEC_CHARS} characters, "
            f"got {quoted(spec)}"
        )
    name, _, arguments = spec.strip().partition(":")
    if name.strip() != NAME:
        raise ValueError(f"--sync {quoted(spec)}: expected a spec starting with {NAME!r}")
    values: dict[str, str] = {}
    for item in split_top_level(arguments, f"--sync {quoted(spec)}"):
        key, equals, raw = (piece.strip() for piece in item.partition("="))
        if not equals or key not in ("steps", "outer", "compressor"):
            raise ValueError(
                f"--sync {quoted(spec)}: expected key=value with key in steps, outer, "
                f"compressor, got {quoted(item)}"
            )
        if key in values:
            raise ValueError(f"--sync {quoted(spec)}: {key} given twice")
        values[key] = raw
    default = DiLoCoSpec()
    steps = default.steps
    if "steps" in values:
        raw = values["steps"]
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_PHASE_STEPS:
            raise ValueError(
                f"--sync diloco steps: expected an integer in [1, {MAX_PHASE_STEPS}], "
                f"got {quoted(raw)}"
            )
        steps = int(raw)
    outer = _unwrapped(values["outer"], spec, "outer") if "outer" in values else default.outer
    compressor = (
        _unwrapped(values["compressor"], spec, "compressor")
        if "compressor" in values
        else default.compressor
    )
    for key, check, value in (
        ("outer", parse_outer, outer),
        ("compressor", check_compressor, compressor),
    ):
        try:
            check(value)
        except ValueError as error:
            raise ValueError(f"--sync diloco {key}: {error}") from None
    return DiLoCoSpec(steps, outer, compressor)


class DiLoCoSync:
    """One rank's DiLoCo: anchor, outer optimizer, and the compressor's hook state (memory).

    Call `local_step()` after each inner optimizer step: it ends the phase (`synchronize`) every
    `steps` steps. `synchronize()` may also be called early (the last, shorter phase of a run);
    every rank must call it at the same points.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: DiLoCoSpec,
        communicator: Communicator,
        *,
        seed: int = 0,
        error_feedback: bool = True,
    ) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.parameters = [p for _, p in named]
        self.names = tuple(name for name, _ in named)
        self.shapes = tuple(tuple(p.shape) for p in self.parameters)
        self.spec = spec
        self.outer = parse_outer(spec.outer)
        state, _ = make_state(
            spec.compressor,
            {id(p): name for name, p in named},
            {name: index for index, name in enumerate(self.names)},
            communicator,
            seed,
            error_feedback,
        )
        assert isinstance(state, CompressedState | PowerSGDState)
        self.hook = state
        self.anchor = [p.detach().clone() for p in self.parameters]
        self.phases = 0  # phases ended (the compressor's round)
        self.steps_in_phase = 0
        self.wait_seconds = 0.0  # time in synchronize (collectives and outer step)

    def local_step(self) -> bool:
        """Count one inner step; end the phase after `steps` of them. Whether it ended."""
        self.steps_in_phase += 1
        if self.steps_in_phase < self.spec.steps:
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        """End the phase: average the compressed pseudo-gradients, step the anchor, restart."""
        start = time.perf_counter()
        with torch.no_grad():
            pseudo = torch.cat(
                [(a - p).reshape(-1) for a, p in zip(self.anchor, self.parameters, strict=True)]
            ).to(torch.float32)
            mean = sync_flat(self.hook, pseudo, self.names, self.shapes, self.phases)
            parts = mean.split([a.numel() for a in self.anchor])
            mixed = [a - m.view_as(a).to(a.dtype) for a, m in zip(self.anchor, parts, strict=True)]
            self.outer.step(self.anchor, mixed)
            for p, a in zip(self.parameters, self.anchor, strict=True):
                p.copy_(a)
        self.phases += 1
        self.steps_in_phase = 0
        self.wait_seconds += time.perf_counter() - start

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the model and the inner optimizer (the caller's)."""
        return {
            "phases": self.phases,
            "steps_in_phase": self.steps_in_phase,
            "anchor": [a.clone() for a in self.anchor],
            "outer": self.outer.state_dict(),
            "hook": self.hook.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore after checking every part; ValueError (and nothing changed) otherwise."""
        require_keys(state, STATE_KEYS, "diloco")
        for key, high in (("phases", None), ("steps_in_phase", self.spec.steps - 1)):
            checked_integer(f"diloco state {key}", state[key], 0, high)
        anchor = checked_finite("diloco anchor", self.parameters, state["anchor"])
        outer = OuterSGD(self.outer.lr, self.outer.momentum, self.outer.nesterov, self.outer.name)
        outer.load_state_dict(state["outer"], self.parameters)
        hook = state["hook"]
        if not isinstance(hook, Mapping):
            raise ValueError("diloco state hook: expected a mapping")
        self._check_memory(hook.get("memory"))
        self.hook.load_state_dict(dict(hook))
        self.anchor, self.outer = anchor, outer
        self.phases, self.steps_in_phase = state["phases"], state["steps_in_phase"]

    def _check_memory(self, memory: Any) -> None:
        if not isinstance(memory, Mapping):
            raise ValueError("diloco state hook memory: expected a mapping of parameter names")
        sizes = dict(zip(self.names, (p.numel() for p in self.parameters), strict=True))
        for name, tensor in memory.items():
            if name not in sizes:
                raise ValueError(f"diloco error memory: no parameter named {quoted(name)}")
            if (
                not isinstance(tensor, torch.Tensor)
                or not tensor.is_floating_point()
                or tensor.numel() != sizes[name]
            ):
                raise ValueError(
                    f"diloco error memory of {name}: expected {sizes[name]} float elements"
                )
            if not torch.isfinite(tensor).all():
                raise ValueError(f"diloco error memory of {name}: holds NaN/Inf")
