"""TrainConfig: every setting that decides a training run, each checked when it is made.

The same on every peer (a checkpoint records it, and a restart must agree with it), so a
setting that could not train is refused here, naming it, before any peer starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from gossipcomp.compress import parse_spec
from gossipcomp.experiment.settings import MAX_LOCAL_STEPS, MAX_LR, MAX_SEED, TrainSettings
from gossipcomp.gossip import ALGORITHMS, make_attack, parse_clip
from gossipcomp.gossip.catalog import MAX_GOSSIP_STEPS
from gossipcomp.gossip.specs import canonical_spec, parse_options
from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.outer import DriftTracker, OuterSGD, parse_drift, parse_outer
from gossipcomp.peer import MAX_ROUND_TIMEOUT
from gossipcomp.schedule import make_planner
from gossipcomp.transport.base import MAX_WIRE_ROUND
from gossipcomp.workload.data import DATASETS, parse_partition
from gossipcomp.workload.models import MODELS
from gossipcomp.workload.pairing import check_pairing

# the algorithms whose payload follows tensor groups (PowerGossip merges its raw payload only)
GROUPED_ALGORITHMS = ("choco", "choco-edge", "def", "powergossip")


@dataclass(frozen=True)
class TrainConfig(TrainSettings):
    """Everything that decides a training run (the same on every peer): the fields and defaults
    of TrainSettings, checked."""

    def __post_init__(self) -> None:
        """Refuse any setting that could not train, naming it, before anything runs."""
        checked_integer("rounds", self.rounds, 1, MAX_WIRE_ROUND - 1)
        checked_integer("batch_size", self.batch_size, 1)
        checked_integer("eval_every", self.eval_every, 0)
        checked_integer("seed", self.seed, 0, MAX_SEED)
        checked_integer("rank", self.rank, 1)
        checked_integer("gossip_steps", self.gossip_steps, 1, MAX_GOSSIP_STEPS)
        checked_integer("local_steps", self.local_steps, 1, MAX_LOCAL_STEPS)
        checked_integer("max_failed_rounds", self.max_failed_rounds, 0, MAX_WIRE_ROUND - 1)
        checked_number("lr", self.lr, 0.0, MAX_LR, closed_low=False)
        checked_number("momentum", self.momentum, 0.0, 1.0, closed_high=False)
        checked_number(
            "round_timeout", self.round_timeout, 0.0, MAX_ROUND_TIMEOUT, closed_low=False
        )
        if not isinstance(self.gossip_buffers, bool):
            raise ValueError(
                f"gossip_buffers must be True or False, got {quoted(self.gossip_buffers)}"
            )
        for name in ("zeta", "gamma"):
            if getattr(self, name) is not None:
                checked_number(name, getattr(self, name), 0.0, 1.0, closed_low=False)
        if isinstance(self.consensus_step, str):
            if self.consensus_step != "auto":
                raise ValueError(
                    f"consensus_step must be a number or 'auto', got {self.consensus_step!r}"
                )
        elif self.consensus_step is not None:  # the algorithm checks its own upper limit
            checked_number(
                "consensus_step",
                self.consensus_step,
                0.0,
                math.inf,
                closed_low=False,
                closed_high=False,
            )
        if ":" in self.algorithm:  # a whole spec: its options are not given twice
            defaults = TrainConfig()
            name = parse_options(self.algorithm, ALGORITHMS)[0]
            for option in ALGORITHMS[name].OPTIONS.values():
                flag = option.flag
                if flag is not None and getattr(self, flag) != getattr(defaults, flag):
                    raise ValueError(
                        f"{flag}: given both in the algorithm spec {quoted(self.algorithm)} "
                        "and on its own; expected one of them"
                    )
        self.algorithm_options()  # a complete, valid spec (a required compressor given)
        parse_partition(self.partition)
        if self.compressor is not None:
            parse_spec(self.compressor)  # fail early on a bad spec, naming what exists
        if self.clip is not None:
            parse_clip(self.clip)
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.byzantine):
            raise ValueError(f"byzantine ranks must be integers >= 0, got {self.byzantine!r}")
        object.__setattr__(self, "byzantine", tuple(sorted(self.byzantine)))  # a list is welcome
        if len(set(self.byzantine)) != len(self.byzantine):
            raise ValueError(f"byzantine ranks must differ, got {self.byzantine!r}")
        make_attack(self.attack, self.attack_scale)
        if self.model not in MODELS:
            raise ValueError(f"unknown model {quoted(self.model)}; known: {sorted(MODELS)}")
        if not isinstance(self.dataset, str) or self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {quoted(self.dataset)}; known: {sorted(DATASETS)}")
        check_pairing(self.model, self.dataset, self.partition)  # e.g. cnn on digits only
        if self.outer is not None:
            parse_outer(self.outer)
        parse_drift(self.drift)
        make_planner(self.schedule)  # fails naming the planners that exist
        if self.schedule != "per-tensor" and self.algorithm_name not in GROUPED_ALGORITHMS:
            raise ValueError(
                f"schedule {quoted(self.schedule)}: only {', '.join(GROUPED_ALGORITHMS)} "
                f"send tensor groups; {self.algorithm_name} takes schedule 'per-tensor'"
            )

    def outer_optimizer(self) -> OuterSGD | None:
        """A fresh outer optimizer for one peer (None: none)."""
        return None if self.outer is None else parse_outer(self.outer)

    def drift_correction(self) -> DriftTracker | None:
        """A fresh drift correction for one peer (None: none)."""
        return parse_drift(self.drift)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def gossip_rounds(self) -> int:
        """Gossip rounds a peer runs: one after every `local_steps` local steps (the last
        after what is left of `rounds`)."""
        return -(-self.rounds // self.local_steps)

    def steps_at(self, gossip_round: int) -> int:
        """Local steps done when a peer has finished `gossip_round` gossip rounds."""
        return min(gossip_round * self.local_steps, self.rounds)

    @property
    def algorithm_name(self) -> str:
        return self.algorithm.partition(":")[0].strip()

    def algorithm_spec(self) -> str:
        """The algorithm as one spec string: `algorithm` when it is one, else its name with
        the options the fields give (each algorithm option names its field)."""
        if ":" in self.algorithm:
            return self.algorithm
        cls = ALGORITHMS.get(self.algorithm)
        if cls is None:
            parse_options(self.algorithm, ALGORITHMS)  # raises, naming those that exist
            raise AssertionError("unreachable")
        options = {
            key: getattr(self, option.flag) if option.flag else None
            for key, option in cls.OPTIONS.items()
        }
        return canonical_spec(self.algorithm, options)

    def algorithm_options(self) -> dict[str, Any]:
        """Every option of the algorithm, given or defaulted (ValueError when not valid)."""
        return parse_options(self.algorithm_spec(), ALGORITHMS)[1]

    @property
    def group_compressor(self) -> str | None:
        """The compressor spec a schedule's groups get: the algorithm's own, "identity" for
        PowerGossip (whose groups only merge its raw payload), None for algorithms whose
        payload follows no groups."""
        if self.algorithm_name not in GROUPED_ALGORITHMS:
            return None
        return self.algorithm_options().get("compressor", "identity")
