"""Issue 22 finding 4: every sign method of the all-reduce mode trains at the printed default
momentum (0.9), close to plain all-reduce on digits: within 2.5 points on the mean of six seeds
(measured within 2: docs/benchmarks.md "Sign methods at the default momentum"), no seed
collapsed.

Before, the optimizer's momentum was applied after the error-fed sign update and replayed its
delayed remainder: `gossipcomp allreduce --sync marsit` ended at 0.19, the sign hook at 0.35.
Now the sign codecs and Marsit keep the momentum before compressing and the optimizer has none
(hooks.takes_momentum, train.sync_takes_momentum)."""

from __future__ import annotations

from dataclasses import replace

from gossipcomp.allreduce import spawn
from gossipcomp.allreduce.hooks import takes_momentum
from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.train import AllreduceConfig, sync_takes_momentum, train_rank

DEFAULTS = AllreduceConfig(steps=300)  # the CLI's lr 0.1, momentum 0.9, batch 32
SIGN_METHODS = {
    "sign hook": replace(DEFAULTS, compressor="sign"),
    "ef+sign hook": replace(DEFAULTS, compressor="ef+sign"),
    "onebit hook": replace(DEFAULTS, compressor="onebit"),
    "marsit": replace(DEFAULTS, sync="marsit"),
    "merged sign": replace(DEFAULTS, sync="merged", compressor="sign", planner="threshold"),
}


SEEDS = tuple(range(6))


def _accuracies(session: Session, configs: dict[str, AllreduceConfig]) -> dict[str, float]:
    return {name: train_rank(session, config).test_accuracy for name, config in configs.items()}


def test_the_sign_methods_take_the_momentum_and_the_others_leave_it_to_the_optimizer() -> None:
    assert DEFAULTS.momentum == 0.9 and DEFAULTS.lr == 0.1
    for config in SIGN_METHODS.values():
        assert sync_takes_momentum(config)
    for spec in ("sign", "ef+sign", "onebit", "ef+onebit"):
        assert takes_momentum(spec)
    for spec in ("identity", "topk:ratio=0.01", "powersgd:rank=2", "fp16", "torch:fp16"):
        assert not takes_momentum(spec)
    assert not sync_takes_momentum(replace(DEFAULTS, sync="ssd"))


def test_every_sign_method_trains_at_the_default_momentum_near_plain_all_reduce() -> None:
    """Mean test accuracy over seeds 0-5: one seed of a method moves by 2-9 points (360 test
    images, and a CPU with other vector units sums in another order: merged sign was 0.944
    against plain 0.972 on seed 0 on one machine, within a point on another), while the bug
    this guards against left the sign hook at 0.35 and Marsit at 0.19."""
    configs = {
        f"{name} s{seed}": replace(config, seed=seed)
        for seed in SEEDS
        for name, config in {
            "plain": replace(DEFAULTS, compressor="identity"),
            **SIGN_METHODS,
        }.items()
    }
    ranks = spawn(_accuracies, 2, (configs,), timeout_s=60, deadline_s=900)
    for name in configs:
        assert ranks[1][name] == ranks[0][name], name  # every rank applies the same update

    def mean(name: str) -> float:
        return sum(ranks[0][f"{name} s{seed}"] for seed in SEEDS) / len(SEEDS)

    plain = mean("plain")
    assert plain >= 0.9, plain
    for name in SIGN_METHODS:
        assert mean(name) >= plain - 0.025, (name, mean(name), plain)
        assert min(ranks[0][f"{name} s{seed}"] for seed in SEEDS) >= 0.85, name
