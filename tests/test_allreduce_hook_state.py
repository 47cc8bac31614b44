"""Issue 22 finding 5: hook state across DDP's bucket rebuild, many buckets against one, and
checkpoints restored into other buckets; the momentum a hook keeps before compressing.

What holds: PowerSGD (error feedback, warm start, the optimizer's momentum 0.9) computes the same
update with many buckets as with one, step for step across DDP's rebuild after the first
iteration (on 2 gloo ranks bit for bit: each matrix is approximated on its own, with its own Q
and memory by parameter name); a state saved from a many-bucket DDP and loaded into a one-bucket
DDP (and the reverse) continues exactly as the original run; a hook with momentum outputs the
velocity of the averaged gradient and restores it; a state is not loaded into a hook that keeps
no velocity."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce import register, spawn
from gossipcomp.allreduce.launch import Session
from gossipcomp.workload.models import build_mlp

MANY, ONE = 0.005, 25.0  # bucket caps (MB): the MLP below in 4+ buckets after the rebuild, in 1
STEPS, SAVED_AT = 8, 4
MOMENTUM = 0.9


def _model() -> torch.nn.Module:
    return build_mlp(0, hidden=(48, 48, 48, 48))  # 5 Linear layers, 9 KB to 12 KB each


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.rand(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)


class _Run:
    """A DDP model with a hook and SGD, stepped on the fixed batches of this rank."""

    def __init__(self, session: Session, spec: str, bucket_mb: float, in_hook: bool) -> None:
        self.session = session
        self.model = _model()
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
        self.state = register(self.ddp, spec, momentum=MOMENTUM if in_hook else 0.0)
        momentum = 0.0 if in_hook else MOMENTUM
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=momentum)
        self.grads: list[torch.Tensor] = []

    def step(self, number: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        x, y = _batch(self.session.rank, number)
        F.cross_entropy(self.ddp(x), y).backward()
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]))
        self.optimizer.step()

    def load(self, saved: tuple[dict, list[torch.Tensor], dict]) -> None:
        state, params, optimizer = saved
        with torch.no_grad():
            for p, value in zip(self.model.parameters(), params, strict=True):
                p.copy_(value)
        self.optimizer.load_state_dict(optimizer)
        self.state.load_state_dict(state)

    def save(self) -> tuple[dict, list[torch.Tensor], dict]:
        params = [p.detach().clone() for p in self.model.parameters()]
        return self.state.state_dict(), params, copy.deepcopy(self.optimizer.state_dict())

    def close(self) -> int:
        collectives = self.state.communicator.traffic.collectives
        self.state.communicator.close()
        return collectives


def _worker(session: Session, spec: str, in_hook: bool) -> dict[str, object]:
    out: dict[str, object] = {}
    runs = {bucket_mb: _Run(session, spec, bucket_mb, in_hook) for bucket_mb in (MANY, ONE)}
    saved = {}
    for bucket_mb, run in runs.items():
        for number in range(STEPS):
            if number == SAVED_AT:
                saved[bucket_mb] = run.save()
            run.step(number)
    for bucket_mb, run in runs.items():
        out[f"grads {bucket_mb}"] = run.grads
        out[f"collectives {bucket_mb}"] = run.close()
    for source, target in ((MANY, ONE), (ONE, MANY)):  # restore into the other bucketing
        restored = _Run(session, spec, target, in_hook)
        restored.load(saved[source])
        for number in range(SAVED_AT, STEPS):
            restored.step(number)
        restored.close()
        out[f"restored {source}->{target}"] = restored.grads
    return out


# PowerSGD with the optimizer's momentum (its Qs and error memories by name); the exact hook
# keeping the momentum itself (its velocities by name). Codecs with a statistic of the whole
# bucket (sign's scale, top-k's k) compute other updates in other buckets by design.
@pytest.mark.parametrize(("spec", "in_hook"), [("powersgd:rank=2", False), ("identity", True)])
def test_many_buckets_equal_one_bucket_across_the_rebuild_and_a_restored_state(
    spec: str, in_hook: bool
) -> None:
    ranks = spawn(_worker, 2, (spec, in_hook), timeout_s=60, deadline_s=300)
    for out in ranks:
        many, one = out[f"grads {MANY}"], out[f"grads {ONE}"]
        per_step = 2 if spec.startswith("powersgd") else 1  # collectives a bucket
        assert out[f"collectives {ONE}"] == per_step * STEPS
        assert out[f"collectives {MANY}"] >= 4 * (STEPS - 1)  # 4+ buckets after the rebuild
        for step, (a, b) in enumerate(zip(many, one, strict=True)):
            assert torch.equal(a, b), (spec, step, float((a - b).norm()))
        for source in (MANY, ONE):
            target = ONE if source == MANY else MANY
            again = out[f"restored {source}->{target}"]
            original = out[f"grads {source}"][SAVED_AT:]
            for step, (a, b) in enumerate(zip(again, original, strict=True)):
                assert torch.equal(a, b), (spec, source, step)
    for a, b in zip(ranks[0][f"grads {MANY}"], ranks[1][f"grads {MANY}"], strict=True):
        assert torch.equal(a, b)  # every rank applies the same average


def _momentum_worker(session: Session) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=MANY)
    state = register(ddp, "identity", momentum=0.5)  # exact: the output is the velocity
    outputs, means = [], []
    for number in range(4):
        reference = _model()
        x, y = _batch(session.rank, number)
        F.cross_entropy(reference(x), y).backward()
        local = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        torch.distributed.all_reduce(local)
        means.append(local / session.world)
        ddp.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        outputs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    saved = state.state_dict()
    state.communicator.close()
    plain = register(DistributedDataParallel(_model(), bucket_cap_mb=ONE), "identity")
    try:
        plain.load_state_dict(saved)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    plain.communicator.close()
    return outputs, means, refusal


def test_a_hook_with_momentum_outputs_the_velocity_and_refuses_a_hook_without() -> None:
    ranks = spawn(_momentum_worker, 2, timeout_s=60, deadline_s=200)
    for outputs, means, refusal in ranks:
        velocity = torch.zeros_like(means[0])
        for output, mean in zip(outputs, means, strict=True):
            velocity = 0.5 * velocity + mean
            torch.testing.assert_close(output, velocity, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(outputs[-1], means[-1])  # the velocity is not the gradient
        assert "momentum" in refusal and "saved with" in refusal


@pytest.mark.parametrize("spec", ["sign", "ef+sign", "onebit"])
def test_a_sign_hook_without_an_explicit_momentum_is_refused(tmp_path, spec: str) -> None:
    """A sign hook left at a default momentum beside an optimizer with momentum diverges (0.16
    accuracy, issue 22 finding 4) without a word: register() makes the user say which."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(_model())
        with pytest.raises(ValueError, match="needs momentum= given") as refused:
            register(ddp, spec)
        assert spec in str(refused.value)
        assert register(DistributedDataParallel(_model()), spec, momentum=0.0).momentum == 0.0
        assert register(DistributedDataParallel(_model()), "fp16").momentum == 0.0  # others: 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("momentum", [1.0, -0.1, float("nan"), True])
def test_a_momentum_outside_0_1_is_refused_by_a_hook_and_by_marsit(tmp_path, momentum) -> None:
    import torch.distributed as dist

    from gossipcomp.allreduce.comm import Communicator
    from gossipcomp.allreduce.marsit import MarsitSync

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        expected = r"momentum: expected a finite number in \[0, 1\), got "
        with pytest.raises(ValueError, match=rf"^hook {expected}"):
            register(DistributedDataParallel(_model()), "fp16", momentum=momentum)
        with pytest.raises(ValueError, match=rf"^marsit {expected}"):
            MarsitSync(_model(), Communicator(), momentum=momentum)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("round_", [-1, True, 1.0])
def test_a_saved_round_that_is_not_an_integer_from_0_is_refused(tmp_path, round_) -> None:
    import torch.distributed as dist

    from gossipcomp.allreduce.comm import Communicator
    from gossipcomp.allreduce.merged import MergedSync
    from gossipcomp.schedule.groups import TensorGroup

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        state = register(DistributedDataParallel(_model()), "fp16")
        with pytest.raises(ValueError, match=r"^hook state round: expected an integer >= 0, got "):
            state.load_base_state_dict({"round": round_})
        model = _model()
        names = tuple(n for n, _ in model.named_parameters())
        sync = MergedSync(model, [TensorGroup(names, "fp16")], Communicator())
        with pytest.raises(ValueError, match=r"^merged sync round: expected an integer >= 0, got "):
            sync.load_state_dict({"round": round_})
        assert sync.round == 0
    finally:
        dist.destroy_process_group()
