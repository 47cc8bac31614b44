"""gossipcomp's SGD (workload/optimizer.py): torch.optim.SGD's updates to the bit, its state
dicts both ways, its hooks and schedulers, and no torch._dynamo import (2 s of start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gossipcomp.workload.optimizer import SGD
from gossipcomp.workload.training import make_optimizer

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = [
    {"lr": 0.1},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-3},
    {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-2},
    {"lr": 0.01, "momentum": 0.5, "maximize": True},
    {"lr": torch.tensor(0.05), "momentum": 0.9},
]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, stop: int, seed: int, start: int = 0
) -> None:
    """Steps `start` to `stop` - 1 of a run on batches drawn from `seed` (the same batches
    whatever `start`); at step 2 one parameter has no gradient and is left alone."""
    data = torch.Generator().manual_seed(seed)
    for step in range(stop):
        x = torch.randn(12, 8, generator=data)
        y = torch.randint(0, 3, (12,), generator=data)
        if step < start:
            continue
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 2:
            model[0].bias.grad = None
        optimizer.step()


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_its_updates_are_torch_s_to_the_bit(options: dict) -> None:
    ours, theirs = _model(0), _model(0)
    _steps(ours, SGD(ours.parameters(), **options), 6, seed=1)
    _steps(theirs, torch.optim.SGD(theirs.parameters(), **options), 6, seed=1)
    assert _same(ours, theirs)
    assert not _same(ours, _model(0))  # it did move


def test_state_dicts_go_both_ways_and_training_continues_the_same() -> None:
    """A momentum buffer saved by torch's SGD loads into ours and ours into torch's; either
    way the next steps match a run that never switched."""
    options = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
    reference = _model(3)
    _steps(reference, torch.optim.SGD(reference.parameters(), **options), 8, seed=4)
    for first, second in ((torch.optim.SGD, SGD), (SGD, torch.optim.SGD)):
        model = _model(3)
        before = first(model.parameters(), **options)
        _steps(model, before, 4, seed=4)
        after = second(model.parameters(), **options)
        after.load_state_dict(before.state_dict())
        _steps(model, after, 8, seed=4, start=4)
        assert _same(model, reference), (first, second)


def test_hooks_and_schedulers_work_as_on_torch_s() -> None:
    model = _model(5)
    optimizer = make_optimizer(model, lr=0.1, momentum=0.9)
    assert isinstance(optimizer, SGD) and isinstance(optimizer, torch.optim.Optimizer)
    called = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: called.append(opt))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(4):
        _steps(model, optimizer, 1, seed=6)
        scheduler.step()
    assert len(called) == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


@pytest.mark.parametrize("option", ["foreach", "fused", "differentiable"])
def test_options_it_does_not_have_are_refused_by_name(option: str) -> None:
    with pytest.raises(ValueError, match=f"SGD: {option}=True: expected False or None"):
        SGD(_model(0).parameters(), lr=0.1, **{option: True})


def test_training_with_it_never_imports_torch_dynamo() -> None:
    """The reason it exists: torch.optim's methods import torch._dynamo (2.0-2.4 s here)."""
    program = (
        "import sys, torch\n"
        "from gossipcomp.workload.training import make_optimizer\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = make_optimizer(model, 0.1, 0.9, 1e-4)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.randn(3, 4)).sum().backward(); opt.step()\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
