"""DDP hooks of gossipcomp.allreduce on gloo, in real processes: exact means, PowerSGD against
torch's own hook, state across bucket rebuilds and checkpoints, bytes of every compressor."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce import Communicator, half_wrapper, register, spawn
from gossipcomp.allreduce.hooks import PowerSGDState, powersgd_hook
from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.reference import counted, register_reference
from gossipcomp.allreduce.train import AllreduceConfig, train_rank
from gossipcomp.compress import parse_spec
from gossipcomp.workload.models import build_mlp

TINY_BUCKETS_MB = 0.001  # every weight matrix of the digits MLP starts a bucket of its own


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.rand(24, 64, generator=generator), torch.randint(0, 10, (24,), generator=generator)


def _local_grads(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _ddp_grads(
    ddp: DistributedDataParallel, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    ddp.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(batch[0]), batch[1]).backward()
    return torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])


def _identity_worker(session: Session) -> dict[float, list[tuple[torch.Tensor, torch.Tensor, int]]]:
    out = {}
    for bucket_mb in (25.0, TINY_BUCKETS_MB):
        reference, model = build_mlp(0), build_mlp(0)
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        state = register(ddp, "identity")
        steps = []
        for step in range(3):  # DDP rebuilds its buckets before the second
            batch = _batch(session.rank, step)
            before = state.communicator.traffic.collectives
            hooked = _ddp_grads(ddp, batch)
            buckets = state.communicator.traffic.collectives - before
            steps.append((_local_grads(reference, batch), hooked, buckets))
        state.communicator.close()
        out[bucket_mb] = steps
    return out


def test_identity_hook_is_exactly_the_mean_gradient_with_one_and_many_buckets() -> None:
    ranks = spawn(_identity_worker, 2, timeout_s=30, deadline_s=120)
    for bucket_mb in (25.0, TINY_BUCKETS_MB):
        buckets = []
        for step in range(3):
            (local0, hooked0, count), (local1, hooked1, _) = (r[bucket_mb][step] for r in ranks)
            mean = (local0 + local1) / 2
            assert not torch.equal(local0, local1)
            assert torch.equal(hooked0, mean) and torch.equal(hooked1, mean)
            buckets.append(count)
        assert buckets[-1] == 1 if bucket_mb == 25.0 else buckets[-1] >= 3


def _powersgd_worker(session: Session) -> dict[str, tuple[float, float, list[torch.Tensor]]]:
    """Relative error of the averaged approximation and bytes a step, for each hook."""
    results = {}
    variants = ("ours", "torch", "ours-buckets", "ours-fp16")
    for variant in variants:
        model = build_mlp(0, hidden=(64, 64))  # 36 KB: one bucket
        bucket_mb = TINY_BUCKETS_MB if variant == "ours-buckets" else 25.0
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        reference = build_mlp(0, hidden=(64, 64))
        comm = Communicator()
        if variant == "torch":
            register_reference(ddp, "torch:powersgd:rank=2", error_feedback=False, warm_start=False)
        elif variant == "ours-fp16":
            named = list(model.named_parameters())
            state = PowerSGDState(
                {id(p): n for n, p in named},
                {n: i for i, (n, _) in enumerate(named)},
                comm,
                rank=2,
                error_feedback=False,
                warm_start=False,
            )
            ddp.register_comm_hook(state, half_wrapper(powersgd_hook))
        else:
            register(
                ddp, "powersgd:rank=2,warm_start=false", error_feedback=False, communicator=comm
            )
        errors, grads = [], []
        counting = counted(comm.traffic, session.world) if variant == "torch" else nullcontext()
        with counting:
            for step in range(12):
                batch = _batch(session.rank, step)
                local = _local_grads(reference, batch)
                dist.all_reduce(local)
                mean = local / session.world
                before = comm.traffic.payload_bytes
                hooked = _ddp_grads(ddp, batch)
                if step >= 2:  # torch's hook starts compressing at its second step
                    errors.append(float((hooked - mean).norm() / mean.norm()))
                    nbytes = comm.traffic.payload_bytes - before
                grads.append(hooked)
        comm.close()
        results[variant] = (sum(errors) / len(errors), nbytes, grads)
    return results


def test_powersgd_matches_torch_bytes_and_error_and_runs_on_many_buckets() -> None:
    ranks = spawn(_powersgd_worker, 2, timeout_s=30, deadline_s=150)
    ours, theirs = ranks[0]["ours"], ranks[0]["torch"]
    assert ours[1] == theirs[1] > 0  # same bytes a step
    matrices = 4 * 2 * ((64 + 64) + (64 + 64) + (10 + 64))  # rank-2 P and Q of every weight
    whole = 4 * (64 + 64 + 10)  # the biases go whole
    assert ours[1] == matrices + whole
    assert ours[0] <= 1.1 * theirs[0], (ours[0], theirs[0])
    many = ranks[0]["ours-buckets"]
    assert many[1] == ours[1] and many[0] <= 1.1 * theirs[0]
    assert ranks[0]["ours-fp16"][1] == ours[1] / 2  # P, Q and whole tensors travel in fp16
    for variant in ("ours", "ours-buckets", "ours-fp16"):  # every rank applies the same average
        for a, b in zip(ranks[0][variant][2], ranks[1][variant][2], strict=True):
            assert torch.equal(a, b)


def _checkpoint_worker(session: Session) -> tuple[list[str], float, torch.Tensor, torch.Tensor]:
    model = build_mlp(0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=TINY_BUCKETS_MB)
    state = register(ddp, "fp16")  # element-wise: the result cannot depend on bucket layout
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):  # across DDP's bucket rebuild
        _ddp_grads(ddp, _batch(session.rank, step))
        optimizer.step()
    saved = state.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    expected = _ddp_grads(ddp, _batch(session.rank, 3))
    state.communicator.close()
    fresh = build_mlp(0)
    with torch.no_grad():
        for p, value in zip(fresh.parameters(), params, strict=True):
            p.copy_(value)
    restored_ddp = DistributedDataParallel(fresh, bucket_cap_mb=25.0)  # other buckets entirely
    restored = register(restored_ddp, "fp16")
    restored.load_state_dict(saved)
    again = _ddp_grads(restored_ddp, _batch(session.rank, 3))
    restored.communicator.close()
    energy = sum(float(m.norm()) for m in saved["memory"].values())
    return sorted(saved["memory"]), energy, expected, again


def test_error_memory_survives_bucket_rebuild_and_checkpoint() -> None:
    ranks = spawn(_checkpoint_worker, 2, timeout_s=30, deadline_s=120)
    names = sorted(n for n, _ in build_mlp(0).named_parameters())
    for memory_names, energy, expected, again in ranks:
        assert memory_names == names and energy > 0
        assert torch.equal(expected, again)


# Digits, 2 ranks, 150 steps of SGD lr 0.1 without momentum (sign-based updates overshoot under
# momentum 0.9 with error feedback, and qsgd:levels=16 on one 85k-element bucket diverges: its
# variance bound there is 18x the input). Measured 2026-11-23: 0.88-0.89 for qsgd:levels=127,
# terngrad, sign and onebit; the floors below leave about 3 points for other seeds and machines.
# terngrad varies most: 0.825, 0.842, 0.878, 0.864 over seeds 0-3 (2026-11-25, the versions in
# constraints.txt), so its floor sits under that spread.
DENSE = {
    "identity": 0.85,
    "fp16": 0.85,
    "bf16": 0.85,
    "randomk:ratio=0.1": 0.75,
    "topk:ratio=0.01": 0.85,
}
QUANTISED = {
    "dgc:ratio=0.01": 0.85,
    "qsgd:levels=127": 0.85,
    "terngrad": 0.80,
    "sign": 0.85,
    "onebit": 0.85,
}


def _every_compressor_worker(session: Session, specs: list[str]) -> dict[str, tuple[float, float]]:
    out = {}
    for spec in specs:
        config = AllreduceConfig(compressor=spec, steps=150, momentum=0.0, lr=0.1)
        result = train_rank(session, config)
        out[spec] = (result.test_accuracy, result.traffic.payload_bytes / result.steps)
    return out


@pytest.mark.parametrize("floors", [DENSE, QUANTISED], ids=["dense-sparse", "quantised"])
def test_every_compressor_through_the_hook_sends_wire_bytes_and_learns(
    floors: dict[str, float],
) -> None:
    ranks = spawn(_every_compressor_worker, 2, (list(floors),), timeout_s=30, deadline_s=170)
    numel = sum(p.numel() for p in build_mlp(0).parameters())
    for spec, least in floors.items():
        accuracy, per_step = ranks[0][spec]
        assert per_step == parse_spec(spec).wire_bytes(numel), spec  # one bucket a step
        assert accuracy >= least, (spec, accuracy)
        assert ranks[1][spec][0] == accuracy  # the replicas stay identical
