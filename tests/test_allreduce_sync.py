"""Synchronisers of gossipcomp.allreduce on gloo, in real processes: merged groups against
per-tensor sync, SSD-SGD against synchronous SGD, Marsit's unbiased sign ring, dead ranks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce import (
    SSDSGD,
    Communicator,
    LaunchError,
    MergedSync,
    marsit_allreduce,
    spawn,
    threshold_groups,
)
from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.merged import make_plan, measure_backward
from gossipcomp.allreduce.train import AllreduceConfig, train_rank
from gossipcomp.schedule import TensorGroup, TensorInfo, check_cover
from gossipcomp.workload.models import build_mlp, build_resmlp


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.rand(24, 64, generator=generator), torch.randint(0, 10, (24,), generator=generator)


def _merged_worker(session: Session) -> dict[str, list[torch.Tensor]]:
    """Final parameters after 4 SGD steps under several groupings, identity compressor."""
    out = {}
    names = [n for n, _ in build_resmlp(0, depth=4).named_parameters()]
    layouts = {
        "per-tensor": tuple(TensorGroup((n,), "identity") for n in names),
        "single": (TensorGroup(tuple(names), "identity"),),
        "threshold": threshold_groups(
            [TensorInfo(n, p.numel()) for n, p in build_resmlp(0, depth=4).named_parameters()],
            "identity",
            threshold_bytes=20_000,
        ),
    }
    for label, groups in layouts.items():
        model = build_resmlp(0, depth=4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        comm = Communicator()
        sync = MergedSync(model, groups, comm)
        for step in range(4):
            x, y = _batch(session.rank, step)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            sync.synchronize()
            optimizer.step()
        sync.close()
        comm.close()
        out[label] = [p.detach().clone() for p in model.parameters()]
        out[label + ":groups"] = [torch.tensor(len(sync.groups))]
    return out


def test_merged_groups_equal_per_tensor_sync_exactly_with_identity() -> None:
    ranks = spawn(_merged_worker, 2, timeout_s=30, deadline_s=120)
    assert int(ranks[0]["threshold:groups"][0]) > 2  # a real middle ground
    for rank in ranks:
        for label in ("single", "threshold"):
            for a, b in zip(rank["per-tensor"], rank[label], strict=True):
                assert torch.equal(a, b), label
    for a, b in zip(ranks[0]["per-tensor"], ranks[1]["per-tensor"], strict=True):
        assert torch.equal(a, b)  # one model on every rank


def _planned_worker(session: Session, planner: str) -> tuple[tuple[str, ...], ...]:
    model = build_resmlp(0, depth=6)
    x, y = _batch(session.rank, 0)

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    tensors, _ = measure_backward(model, backward, repeats=1)
    comm = Communicator()
    groups = make_plan(planner, tensors, "sign", comm, compute_s=0.01).groups
    check_cover(groups, [t.name for t in tensors])
    sync = MergedSync(model, groups, comm)
    backward()
    sync.synchronize()
    comm.close()
    return tuple(g.names for g in groups)


@pytest.mark.parametrize("planner", ["mergecomp", "mgwfbp"])
def test_planned_groups_cover_the_model_and_agree_on_every_rank(planner: str) -> None:
    plans = spawn(_planned_worker, 2, (planner,), timeout_s=30, deadline_s=120)
    assert plans[0] == plans[1]
    assert sum(len(g) for g in plans[0]) == len(list(build_resmlp(0, depth=6).parameters()))


def _ssd_worker(session: Session) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    results = []
    for wrapped in (False, True):
        model = build_mlp(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        comm = Communicator()
        forward = model if wrapped else DistributedDataParallel(model)
        ssd = SSDSGD(model, optimizer, comm, k=1, warmup=0) if wrapped else None
        for step in range(6):
            x, y = _batch(session.rank, step)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), y).backward()
            if ssd is not None:
                ssd.step()
            else:
                optimizer.step()
        comm.close()
        results.append([p.detach().clone() for p in model.parameters()])
    return results[0], results[1]


def test_ssd_with_k_1_is_synchronous_sgd_bit_for_bit() -> None:
    ranks = spawn(_ssd_worker, 2, timeout_s=30, deadline_s=120)
    for ddp, ssd in ranks:
        for a, b in zip(ddp, ssd, strict=True):
            assert torch.equal(a, b)


def _accuracy_worker(session: Session, configs: list[AllreduceConfig]) -> list[float]:
    return [train_rank(session, config).test_accuracy for config in configs]


def test_ssd_with_k_5_learns_digits_within_a_point_of_synchronous_sgd() -> None:
    """4 ranks, 300 steps at lr 0.1, momentum 0.9; SSD pulls every 5 steps after 50 synchronous."""
    configs = [
        AllreduceConfig(steps=300),
        AllreduceConfig(sync="ssd", steps=300, ssd_k=5, ssd_warmup=50),
    ]
    plain, ssd = spawn(_accuracy_worker, 4, (configs,), timeout_s=30, deadline_s=170)[0]
    assert plain > 0.95
    assert ssd >= plain - 0.01, (ssd, plain)


def test_marsit_learns_digits_within_two_points_of_plain_allreduce() -> None:
    """4 ranks, 300 steps at lr 0.1 without momentum for both (sign updates overshoot under
    momentum 0.9 with compensation: 0.19 accuracy, docs/benchmarks.md). Plain SGD without
    momentum is short of converged at 300 steps: over seeds 0-4 it reached 0.911-0.964 (Marsit
    0.928-0.961, within two points of it every time), so its own floor here is 0.9."""
    configs = [
        AllreduceConfig(steps=300, momentum=0.0),
        AllreduceConfig(sync="marsit", steps=300, momentum=0.0),
    ]
    plain, marsit = spawn(_accuracy_worker, 4, (configs,), timeout_s=30, deadline_s=170)[0]
    assert plain > 0.9
    assert marsit >= plain - 0.02, (marsit, plain)


def _marsit_worker(
    session: Session, trials: int, numel: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    comm = Communicator()
    chosen = torch.Generator().manual_seed(5)
    # element i is negative on each rank with probability i / numel: every mean from -1 to 1
    negatives = torch.rand(session.world, numel, generator=chosen) < torch.linspace(0, 1, numel)
    generator = torch.Generator().manual_seed(100 + session.rank)
    total = torch.zeros(numel)
    for _ in range(trials):
        bits = marsit_allreduce(negatives[session.rank], comm, generator)
        total += torch.where(bits, -1.0, 1.0)
    comm.close()
    sent_per_trial = comm.traffic.payload_bytes / trials
    return total / trials, torch.where(negatives, -1.0, 1.0).mean(0), sent_per_trial


def test_marsit_aggregate_is_an_unbiased_mean_sign_on_one_bit_per_element() -> None:
    trials, numel, world = 160, 203, 3
    ranks = spawn(_marsit_worker, world, (trials, numel), timeout_s=30, deadline_s=120)
    estimate, mean, sent = ranks[0]
    for other in ranks[1:]:
        assert torch.equal(other[0], estimate)  # every rank ends with the same bits
    standard_error = ((1 - mean**2) / trials).sqrt()
    z = (estimate - mean).abs() / standard_error.clamp(min=1e-12)
    exact = standard_error == 0
    assert torch.equal(estimate[exact], mean[exact])  # unanimous signs come through exactly
    assert float(z[~exact].max()) < 3.0 + 1.0  # 3 standard errors, Bonferroni-safe over 200
    assert float((z[~exact] > 3.0).float().mean()) < 0.02
    assert sent <= 2 * (world - 1) / world * (numel / 8 + world)  # one bit per element per hop


def _dying_worker(session: Session, victim: int, folder: Path) -> None:
    model = build_mlp(0)
    ddp = DistributedDataParallel(model)
    try:
        for step in range(1000):
            if step == 3 and session.rank == victim:
                (folder / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = _batch(session.rank, step)
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            dist.barrier()
    except BaseException:
        (folder / f"failed{session.rank}").write_text(repr(time.time()))
        raise


def test_a_killed_rank_fails_the_others_within_the_timeout_naming_it(tmp_path: Path) -> None:
    timeout = 4.0
    with pytest.raises(LaunchError) as failure:
        spawn(_dying_worker, 3, (2, tmp_path), timeout_s=timeout, deadline_s=90)
    message = str(failure.value)
    for survivor in (0, 1):
        assert f"rank {survivor}: RankFailure: rank 2 stopped" in message
    assert "rank 2: exited with status -9" in message
    killed = float((tmp_path / "killed").read_text())
    for survivor in (0, 1):
        failed = float((tmp_path / f"failed{survivor}").read_text())
        assert failed - killed < timeout + 3.0  # the timeout, then naming it (busy cores: +3 s)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL"
)
def test_hooks_on_nccl() -> None:
    result = spawn(
        _accuracy_worker,
        1,
        ([AllreduceConfig(steps=50, compressor="topk:ratio=0.05")],),
        backend="nccl",
    )
    assert result[0][0] > 0.5
