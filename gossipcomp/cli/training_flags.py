"""The training flags `simulate` and `peer` share, and the run (TrainConfig) they describe.

The optimizer and data split flags, and --report/--quiet, `allreduce` takes too: they are
declared once, in gossipcomp.inputs.arguments, with what each command sets apart.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from gossipcomp.cli.common import planner_spec
from gossipcomp.experiment.settings import MAX_LOCAL_STEPS, MAX_LR, MAX_SEED, TrainSettings
from gossipcomp.gossip.catalog import ALGORITHM_NAMES, ATTACK_NAMES, MAX_GOSSIP_STEPS
from gossipcomp.inputs.arguments import (
    OptimizerFlags,
    Setting,
    accepted,
    add_optimizer_flags,
    add_report_flags,
    integer,
    number,
)
from gossipcomp.inputs.text import quoted
from gossipcomp.peer.deadlines import MAX_ROUND_TIMEOUT
from gossipcomp.schedule.catalog import PLANNER_NAMES
from gossipcomp.workload.catalog import DATASET_NAMES, MODEL_NAMES

if TYPE_CHECKING:
    from gossipcomp.experiment import TrainConfig
    from gossipcomp.experiment.simulation import CheckpointPolicy


def _optimizer_flags(d: TrainSettings) -> OptimizerFlags:
    return OptimizerFlags(
        lr=Setting(d.lr, MAX_LR, "SGD learning rate"),
        momentum=Setting(d.momentum, 1.0, "SGD momentum (per peer), in [0, 1)"),
        batch_size=Setting(d.batch_size, None, "examples per local step"),
        partition=Setting(
            d.partition, None, "how the training data is split: iid | by-label | dirichlet:ALPHA"
        ),
        seed=Setting(d.seed, MAX_SEED, "seed of data split, model and batches"),
        momentum_below_high=True,
    )


_consensus_number = number("consensus step", 0.0, 2.0, high_closed=False)


def _consensus_step(text: str) -> float | str:
    """'auto', or a step in (0, 2); each algorithm then checks its own limit (choco: 1)."""
    return text if text == "auto" else _consensus_number(text)


# The parsers below are argparse types: each imports what it checks with (torch's modules) when
# a flag is given, not when the parser is built, so `--help` loads no torch.


def _clip_spec(text: str) -> str:
    from gossipcomp.gossip.clipping import parse_clip

    return accepted(parse_clip)(text)


def _outer_spec(text: str) -> str:
    from gossipcomp.outer.optimizers import parse_outer

    return accepted(parse_outer)(text)


def _drift_spec(text: str) -> str:
    from gossipcomp.outer.drift import parse_drift

    return accepted(parse_drift)(text)


def _algorithm_spec(text: str) -> str:
    """A registered name (its options then come from the flags), or a whole spec."""
    name = text.partition(":")[0].strip()
    if name not in ALGORITHM_NAMES:
        known = ", ".join(sorted(ALGORITHM_NAMES))
        raise argparse.ArgumentTypeError(f"unknown algorithm {quoted(name)}; known: {known}")
    if ":" in text:
        from gossipcomp.gossip.registry import ALGORITHMS
        from gossipcomp.gossip.specs import parse_options

        try:
            parse_options(text, ALGORITHMS)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_training_flags(parser: argparse.ArgumentParser, rank_is_low_rank: bool) -> None:
    """Training flags shared by simulate and peer. `--low-rank` is PowerGossip's rank; simulate
    also takes it as `--rank`, which for `peer` is the peer's own rank."""
    d = TrainSettings()
    g = parser.add_argument_group("training")
    g.add_argument(
        "--algorithm",
        default=d.algorithm,
        type=_algorithm_spec,
        help=f"gossip algorithm: {', '.join(sorted(ALGORITHM_NAMES))}, or a whole spec such as "
        "choco:compressor=sign,steps=4,gamma=0.7 (whose options then come from it, not from "
        "the flags below)",
    )
    g.add_argument(
        "--dataset",
        default=d.dataset,
        choices=sorted(DATASET_NAMES),
        help="bundled scikit-learn data: digits (8x8 images, 10 classes), wine (13 features, 3 "
        "classes), breast-cancer (30, 2), iris (4, 3); tabular features standardised; pysource: "
        "the Python standard library's source text, for model chartransformer",
    )
    g.add_argument(
        "--model",
        default=d.model,
        choices=sorted(MODEL_NAMES),
        help="mlp (two hidden layers of 256), wide-mlp (two of 1024: 1.1M parameters), resmlp (24 residual blocks with LayerNorm, 102 "
        "tensors), cnn (digits only: two convolutions with BatchNorm), chartransformer (a "
        "character-level language model, pysource only); sized for the dataset",
    )
    g.add_argument(
        "--schedule",
        type=planner_spec,
        default=d.schedule,
        help="choco, choco-edge, def, powergossip: how parameters are merged into groups: "
        f"per-tensor, single, or a planner ({', '.join(sorted(PLANNER_NAMES))}) run on a reference cost model, "
        "the same plan on every peer",
    )
    g.add_argument(
        "--rounds",
        type=integer("rounds", 1),
        default=d.rounds,
        help="local steps; a gossip round follows every --local-steps of them",
    )
    add_optimizer_flags(g, _optimizer_flags(d))
    g.add_argument(
        "--consensus-step",
        type=_consensus_step,
        default=d.consensus_step,
        help="dpsgd, powergossip, choco, choco-edge: gossip step gamma in x += gamma (W x - x), in "
        "(0, 2) (choco, choco-edge: (0, 1]); 'auto' (the default for dpsgd and powergossip) = 2/(2 - lambda_2 - "
        "lambda_min) of W; choco's and choco-edge's depend on the compressor",
    )
    g.add_argument(
        "--low-rank",
        *(["--rank"] if rank_is_low_rank else []),
        dest="low_rank",
        type=integer("powergossip rank", 1),
        default=d.rank,
        help="powergossip: rank of the power iteration (each matrix uses at most its short side)"
        + (" (--rank is the same flag here)" if rank_is_low_rank else ""),
    )
    g.add_argument(
        "--compressor",
        default=d.compressor,
        help="choco, choco-edge, def: compressor spec, e.g. sign, topk:ratio=0.01, qsgd:levels=16, "
        "ef+sign (not for choco-edge)",
    )
    g.add_argument(
        "--zeta",
        type=number("zeta", 0.0, 1.0),
        default=d.zeta,
        help="def: damping of the differential update (default: per compressor)",
    )
    g.add_argument(
        "--gamma",
        type=number("gamma", 0.0, 1.0),
        default=d.gamma,
        help="def: mixing weight of the combine step (default: per compressor)",
    )
    g.add_argument(
        "--gossip-steps",
        "--power-steps",
        dest="gossip_steps",
        type=integer("gossip steps", 1, MAX_GOSSIP_STEPS),
        default=d.gossip_steps,
        help="powergossip, choco, choco-edge: exchanges per round (PowerGossip's power steps)",
    )
    g.add_argument(
        "--eval-every",
        type=integer("eval every", 0),
        default=d.eval_every,
        help="rounds between accuracy checkpoints (0: only at the end)",
    )
    g.add_argument(
        "--round-timeout",
        type=number("round timeout (seconds)", 0.0, MAX_ROUND_TIMEOUT),
        default=d.round_timeout,
        help="seconds a round waits for neighbours before leaving them out",
    )
    g.add_argument(
        "--local-steps",
        type=integer("local steps", 1, MAX_LOCAL_STEPS),
        default=d.local_steps,
        help="local optimizer steps between gossip rounds (local SGD): H sends 1/H of the "
        "bytes of 1 over the same --rounds",
    )
    g.add_argument(
        "--outer",
        type=_outer_spec,
        default=d.outer,
        metavar="SPEC",
        help="outer optimizer after each gossip round, stepping from the phase's start by "
        "(start - mixed model): 'nesterov' (DiLoCo: lr 0.7, momentum 0.9), 'noloco', "
        "'sgd:lr=L,momentum=M'; keys lr, momentum (default: the mixed model as it is)",
    )
    g.add_argument(
        "--drift",
        type=_drift_spec,
        default=d.drift,
        metavar="SPEC",
        help="drift correction of local steps on dissimilar data: 'none', or 'tracking' / "
        "'tracking:rate=R' (gradient tracking from gossip's own move, no extra bytes)",
    )
    g.add_argument(
        "--max-failed-rounds",
        type=integer("max failed rounds", 0),
        default=d.max_failed_rounds,
        help="stop with an error (exit status 1) when a peer has heard no neighbour for this "
        "many rounds in a row, training alone (0: never stop; a warning comes after 3)",
    )
    g.add_argument(
        "--no-gossip-buffers",
        dest="gossip_buffers",
        action="store_false",
        help="keep each peer's own floating-point buffers (BatchNorm running statistics) "
        "instead of gossiping them with the parameters",
    )
    r = parser.add_argument_group("robustness")
    r.add_argument(
        "--clip",
        type=_clip_spec,
        default=d.clip,
        metavar="SPEC",
        help="clipped gossip: each neighbour's difference clipped to a radius before mixing; "
        "'adaptive' (robust to 1 lying neighbour), 'adaptive:B' (to B), or a fixed radius",
    )
    r.add_argument(
        "--byzantine",
        type=integer("byzantine rank", 0),
        nargs="+",
        default=list(d.byzantine),
        metavar="RANK",
        help="ranks that lie: they gossip an attacked model and train honestly on their own",
    )
    r.add_argument(
        "--attack", default=d.attack, choices=sorted(ATTACK_NAMES), help="what Byzantine ranks send"
    )
    r.add_argument(
        "--attack-scale",
        type=number("attack scale", 0.0),
        default=d.attack_scale,
        help="sign_flip sends -X times the model, scale sends X times it",
    )
    c = parser.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="write checkpoints here (one set per peer) and resume from the newest valid one; "
        "in `peer`, {rank} in the path is replaced by the peer's rank",
    )
    c.add_argument(
        "--checkpoint-every",
        type=integer("checkpoint every", 1),
        default=None,
        help="rounds between checkpoints (default 50 when --checkpoint-dir is given)",
    )
    c.add_argument(
        "--checkpoint-keep",
        type=integer("checkpoint keep", 1),
        default=3,
        help="newest checkpoints kept per peer",
    )
    add_report_flags(
        parser,
        "write the JSON report here (its folder is made and tried before training); in "
        "`peer`, {rank} in the path is replaced by the peer's rank (torchrun launches)",
        "no progress bar or table",
    )


def checkpoints(args: argparse.Namespace) -> CheckpointPolicy | None:
    """Where and how often --checkpoint-* ask to keep checkpoints; None: no checkpoints."""
    if args.checkpoint_dir is None:
        if args.checkpoint_every is not None:
            raise ValueError("--checkpoint-every needs --checkpoint-dir")
        return None
    from gossipcomp.experiment.simulation import CheckpointPolicy  # the peer stack: on use

    every = 50 if args.checkpoint_every is None else args.checkpoint_every
    return CheckpointPolicy(args.checkpoint_dir, every=every, keep=args.checkpoint_keep)


def config(args: argparse.Namespace) -> TrainConfig:
    """The run the training flags describe."""
    from gossipcomp.experiment import TrainConfig  # checks with the registries: on use

    return TrainConfig(
        algorithm=args.algorithm,
        model=args.model,
        dataset=args.dataset,
        schedule=args.schedule,
        rounds=args.rounds,
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch_size,
        partition=args.partition,
        seed=args.seed,
        consensus_step=args.consensus_step,
        rank=args.low_rank,
        gossip_steps=args.gossip_steps,
        compressor=args.compressor,
        zeta=args.zeta,
        gamma=args.gamma,
        eval_every=args.eval_every,
        round_timeout=args.round_timeout,
        clip=args.clip,
        byzantine=tuple(args.byzantine),
        attack=args.attack,
        attack_scale=args.attack_scale,
        gossip_buffers=args.gossip_buffers,
        local_steps=args.local_steps,
        outer=args.outer,
        drift=args.drift,
        max_failed_rounds=args.max_failed_rounds,
    )
