"""Ranks given different specs, options or models refuse together at the first step, with one
error naming the ranks that differ and what differs (issue 22, finding 2).

Real gloo processes: rank 2 is given a setup of its own in each scenario, one after the other in
the same job. Every rank must raise the same `SetupMismatch` (so the job stays in step: the next
scenario's collectives still line up), and an equal setup must pass and then train in step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce import (
    SSDSGD,
    Communicator,
    MarsitSync,
    MergedSync,
    Session,
    register,
    spawn,
)
from gossipcomp.allreduce.agreement import SetupMismatch, check_same_setup, options_of
from gossipcomp.allreduce.train import AllreduceConfig, train_rank
from gossipcomp.compress import parse_spec
from gossipcomp.schedule import TensorGroup

ODD = 2  # the rank given a setup of its own
WORLD = 3


def _model(extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)]
    if extra:
        layers.append(nn.Linear(4, 4))
    return nn.Sequential(*layers)


def _outcome(run) -> str:  # type: ignore[no-untyped-def]
    try:
        run()
    except SetupMismatch as error:
        assert error.ranks == (ODD,)
        return str(error)
    return "agreed"


def _hook(session: Session, spec: str, odd_spec: str, cap: float = 25.0, odd_cap: float = 25.0):  # type: ignore[no-untyped-def]
    odd = session.rank == ODD
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=odd_cap if odd else cap)
    return _outcome(lambda: register(ddp, odd_spec if odd else spec, communicator=Communicator()))


def _scenarios(session: Session) -> dict[str, str]:
    odd = session.rank == ODD
    out = {
        "same resolved spec": _hook(session, "topk:ratio=0.01", "topk"),
        "warm start": _hook(session, "powersgd:rank=2", "powersgd:rank=2,warm_start=false"),
        "compressor": _hook(session, "topk:ratio=0.01", "sign"),
        "bucket cap": _hook(session, "fp16", "fp16", cap=25.0, odd_cap=0.0001),
    }
    ddp = DistributedDataParallel(_model())
    pieces = "whole" if odd else "auto"  # auto would time all_gathers the others never join
    out["gather pieces"] = _outcome(
        lambda: register(ddp, "topk:ratio=0.25", communicator=Communicator(), gather_pieces=pieces)
    )
    comm = Communicator()
    model = _model()
    groups = [TensorGroup(tuple(n for n, _ in model.named_parameters()), "topk:ratio=0.25")]
    out["merged seed"] = _outcome(lambda: MergedSync(model, groups, comm, seed=7 if odd else 0))
    out["marsit layout"] = _outcome(lambda: MarsitSync(_model(extra=odd), comm))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["ssd k"] = _outcome(lambda: SSDSGD(model, sgd, comm, k=5 if odd else 4, warmup=2))
    odd_sgd = torch.optim.SGD(model.parameters(), lr=0.2 if odd else 0.1, momentum=0.9)
    out["ssd lr"] = _outcome(lambda: SSDSGD(model, odd_sgd, comm, k=4, warmup=2))
    config = AllreduceConfig(steps=30 if odd else 20, sync="ssd")
    out["command config"] = _outcome(lambda: train_rank(session, config))
    # after all those refusals the ranks are still in step: an agreed hook trains together
    ddp = DistributedDataParallel(_model())
    register(ddp, "identity", communicator=comm)
    x = torch.full((4, 8), float(session.rank + 1))
    F.mse_loss(ddp(x), torch.zeros(4, 4)).backward()
    grad = next(ddp.parameters()).grad
    assert grad is not None
    out["gradient"] = repr(float(grad.abs().sum()))
    comm.close()
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, str]]:
    return spawn(_scenarios, WORLD, timeout_s=60, deadline_s=240)


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("warm start", "state.warm_start is true on rank 0, false on rank 2"),
        ("compressor", 'state.compressor is "topk:ratio=0.01" on rank 0, "sign" on rank 2'),
        ("bucket cap", "ddp.bucket_bytes_cap is 26214400 on rank 0, 104 on rank 2"),
        ("gather pieces", 'gather_pieces is "auto" on rank 0, "whole" on rank 2'),
        ("merged seed", "options.states.0.seed is 0 on rank 0, 7 on rank 2"),
        ("marsit layout", 'parameters.3.weight is absent on rank 0, "(4, 4) float32" on rank 2'),
        ("ssd k", "options.k is 4 on rank 0, 5 on rank 2"),
        ("ssd lr", "options.optimizer.groups.0.lr is 0.1 on rank 0, 0.2 on rank 2"),
        ("command config", "config.steps is 20 on rank 0, 30 on rank 2"),
    ],
)
def test_a_rank_with_another_setup_is_refused_on_every_rank_naming_it(
    outcomes: list[dict[str, str]], scenario: str, expected: str
) -> None:
    for rank, out in enumerate(outcomes):
        message = out[scenario]
        assert message.startswith("ranks disagree on the setup of "), (rank, message)
        assert "rank 2 differs from ranks 0, 1" in message, (rank, message)
        assert expected in message, (rank, message)
        assert len(message) < 600
    assert len({out[scenario] for out in outcomes}) == 1  # one error, the same on every rank


def test_equal_resolved_specs_agree_and_the_ranks_stay_in_step(
    outcomes: list[dict[str, str]],
) -> None:
    assert all(out["same resolved spec"] == "agreed" for out in outcomes)
    # identity hook after the refusals: every rank holds the mean of the ranks' gradients
    assert len({out["gradient"] for out in outcomes}) == 1


def test_options_are_compared_resolved_not_as_typed() -> None:
    assert options_of(parse_spec("topk")) == options_of(parse_spec("topk:ratio=0.01"))
    assert options_of(parse_spec("qsgd")) != options_of(parse_spec("qsgd:levels=4"))


def test_a_single_rank_needs_no_collective() -> None:
    class Alone:
        world = 1

    check_same_setup(Alone(), "anything", {"x": 1})  # type: ignore[arg-type]
