"""All-reduce DiLoCo (`--sync diloco:...`, allreduce/diloco.py) in gloo ranks: H = 1 with the
identity outer step is synchronous SGD, every rank ends each phase on the same anchor, the
compressor's error is carried into the next phase, the bytes counted are the payloads sent, a
checkpoint mid-phase continues bit for bit, and hostile specs are refused."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import benchmark

from gossipcomp.allreduce import spawn
from gossipcomp.allreduce.comm import Communicator
from gossipcomp.allreduce.command import add_arguments, run
from gossipcomp.allreduce.diloco import DiLoCoSpec, DiLoCoSync, parse_diloco
from gossipcomp.allreduce.launch import Session
from gossipcomp.compress import CompressionContext, parse_spec
from gossipcomp.compress.device import decode, encode
from gossipcomp.workload.models import build_mlp

STEPS = 8
TOPK = "topk:ratio=0.05"
PHASE = 3  # local steps per phase in the error-feedback worker


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.rand(24, 64, generator=generator), torch.randint(0, 10, (24,), generator=generator)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int):
    x, y = _batch(rank, step)
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _h1_worker(session: Session) -> dict[float, dict[str, object]]:
    """For inner momentum 0 and 0.9, what `_h1_runs` gives."""
    return {momentum: _h1_runs(session, momentum) for momentum in (0.0, 0.9)}


def _h1_runs(session: Session, momentum: float) -> dict[str, object]:
    """Synchronous SGD on the all-reduced mean gradient, and DiLoCo with H = 1, outer sgd lr 1."""
    comm = Communicator()
    model = build_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(STEPS):
        _train_step(model, optimizer, session.rank, step)
        for p in model.parameters():
            comm.all_reduce_sum(p.grad).div_(session.world)
        optimizer.step()
    synchronous, synchronous_traffic = _flat(model), comm.traffic.copy()
    comm.traffic.payload_bytes = 0
    comm.traffic.link_bytes = 0.0
    model = build_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    diloco = DiLoCoSync(model, DiLoCoSpec(1, "sgd:lr=1,momentum=0", "identity"), comm)
    ended = []
    for step in range(STEPS):
        _train_step(model, optimizer, session.rank, step)
        optimizer.step()
        ended.append(diloco.local_step())
    comm.close()
    return {
        "synchronous": synchronous,
        "diloco": _flat(model),
        "ended": ended,
        "synchronous_bytes": (synchronous_traffic.payload_bytes, synchronous_traffic.link_bytes),
        "diloco_bytes": (comm.traffic.payload_bytes, comm.traffic.link_bytes),
    }


def test_h1_with_the_identity_outer_step_is_synchronous_sgd_on_the_mean_gradient() -> None:
    """Exact in real arithmetic, momentum included (the inner velocity is linear, so the mean
    of the ranks' models is the synchronous model); in floats the mean of the models
    anchor - lr v_i rounds apart from anchor - lr mean(v_i), hence a tolerance of 1e-5."""
    by_rank = spawn(_h1_worker, 2, timeout_s=30, deadline_s=150)
    for momentum in (0.0, 0.9):
        ranks = [runs[momentum] for runs in by_rank]
        n = ranks[0]["diloco"].numel()
        for result in ranks:
            assert result["ended"] == [True] * STEPS
            difference = (result["diloco"] - result["synchronous"]).abs().max().item()
            assert difference < 1e-5, (momentum, difference)
            assert not torch.equal(result["diloco"], _flat(build_mlp(0)))  # it trained
            # the same bytes as the synchronous all-reduce: 4 bytes a parameter a step
            assert result["diloco_bytes"] == result["synchronous_bytes"]
            assert result["diloco_bytes"] == (STEPS * 4 * n, STEPS * 4.0 * n)  # ring of 2: x1
        assert torch.equal(ranks[0]["diloco"], ranks[1]["diloco"])


def _ef_worker(session: Session) -> dict[str, object]:
    """Three phases of top-k DiLoCo on by-rank batches, with what each phase end saw; then a
    checkpoint taken mid-phase restored into fresh objects and run to the same end."""
    comm = Communicator()
    spec = DiLoCoSpec(PHASE, "sgd:lr=1,momentum=0", TOPK)
    model = build_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diloco = DiLoCoSync(model, spec, comm, seed=7)
    phases = []
    saved = None
    step = 0
    for phase in range(3):
        for inner in range(PHASE):
            _train_step(model, optimizer, session.rank, step)
            optimizer.step()
            step += 1
            if inner < PHASE - 1:
                assert not diloco.local_step()
                if phase == 1 and inner == 0:  # mid-phase: the resumable state
                    saved = (
                        {k: v.clone() for k, v in model.state_dict().items()},
                        copy.deepcopy(optimizer.state_dict()),
                        diloco.state_dict(),
                        step,
                    )
                continue
            anchor = torch.cat([a.reshape(-1) for a in diloco.anchor]).clone()
            memory = diloco.hook.memory.state_dict()
            before = _flat(model)
            assert diloco.local_step()
            phases.append(
                {
                    "anchor": anchor,
                    "pseudo": anchor - before,
                    "memory_before": torch.cat([memory[n] for n in diloco.names])
                    if memory
                    else torch.zeros_like(anchor),
                    "memory_after": torch.cat(
                        [diloco.hook.memory.state_dict()[n] for n in diloco.names]
                    ),
                    "before": before,
                    "after": _flat(model),
                    "anchor_after": torch.cat([a.reshape(-1) for a in diloco.anchor]).clone(),
                    "traffic": (
                        comm.traffic.payload_bytes,
                        comm.traffic.link_bytes,
                        comm.traffic.collectives,
                    ),
                }
            )
    final = _flat(model)
    assert saved is not None
    model_state, optimizer_state, diloco_state, resume_at = saved
    model = build_mlp(0)
    model.load_state_dict(model_state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(optimizer_state)
    restored = DiLoCoSync(model, spec, comm, seed=7)
    restored.load_state_dict(diloco_state)
    for step in range(resume_at, 3 * PHASE):
        _train_step(model, optimizer, session.rank, step)
        optimizer.step()
        restored.local_step()
    comm.close()
    refused = []
    hostile = [
        {**diloco_state, "steps_in_phase": PHASE},
        {**diloco_state, "phases": -1},
        {
            **diloco_state,
            "anchor": [torch.full_like(a, float("nan")) for a in diloco_state["anchor"]],
        },
        {**diloco_state, "hook": {**diloco_state["hook"], "memory": {"nope": torch.zeros(3)}}},
    ]
    anchor_now = [a.clone() for a in restored.anchor]
    for state in hostile:
        with pytest.raises(ValueError) as error:
            restored.load_state_dict(state)
        refused.append(str(error.value))
    unchanged = all(torch.equal(a, b) for a, b in zip(anchor_now, restored.anchor, strict=True))
    return {
        "phases": phases,
        "final": final,
        "resumed": _flat(model),
        "refused": refused,
        "unchanged": unchanged,
        "rank": dist.get_rank(),
    }


def test_error_feedback_carries_the_compressed_error_and_every_rank_ends_on_one_anchor() -> None:
    ranks = spawn(_ef_worker, 3, timeout_s=30, deadline_s=150)
    world = len(ranks)
    codec = parse_spec(TOPK)
    n = ranks[0]["final"].numel()
    for phase in range(3):
        seen = [r["phases"][phase] for r in ranks]
        # before the phase ends the ranks differ (their own batches); after, they agree exactly
        assert not torch.equal(seen[0]["before"], seen[1]["before"])
        for s in seen[1:]:
            assert torch.equal(s["after"], seen[0]["after"])
            assert torch.equal(s["anchor_after"], seen[0]["anchor_after"])
        sent = []
        for rank, s in enumerate(seen):
            x = s["pseudo"] + s["memory_before"]  # the error carried from the last phase
            ctx = CompressionContext(7, rank, -1, phase, 0)
            own = decode(codec, encode(codec, x.clone(), ctx), x.shape, ctx)
            sent.append(own)
            assert torch.allclose(s["memory_after"], x - own, atol=1e-7)
            assert s["memory_after"].abs().sum() > 0
            if phase:
                assert s["memory_before"].abs().sum() > 0
        mean = torch.stack(sent).mean(0)
        assert torch.allclose(seen[0]["anchor_after"], seen[0]["anchor"] - mean, atol=1e-6)
        if phase:  # without the memory the step would have been another one
            plain = torch.stack(
                [
                    decode(codec, encode(codec, s["pseudo"].clone(), c), s["pseudo"].shape, c)
                    for s, c in (
                        (s, CompressionContext(7, r, -1, phase, 0)) for r, s in enumerate(seen)
                    )
                ]
            ).mean(0)
            assert (seen[0]["anchor"] - plain - seen[0]["anchor_after"]).abs().max() > 1e-4
        # bytes: one all-gather of one top-k payload a phase, counted as the ring sends it
        wire = codec.wire_bytes(n)
        for s in seen:
            assert s["traffic"] == ((phase + 1) * wire, (phase + 1) * (world - 1) * wire, phase + 1)
    for r in ranks:
        assert torch.equal(r["resumed"], r["final"])  # restored mid-phase: bit for bit
        assert r["unchanged"]
        steps, phases, anchor, memory = r["refused"]
        assert f"steps_in_phase: expected an integer in [0, {PHASE - 1}], got {PHASE}" in steps
        assert "phases" in phases
        assert "NaN/Inf" in anchor
        assert "no parameter named 'nope'" in memory


def _command(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize(
    ("sync", "expected"),
    [
        ("diloco:steps=0", "steps: expected an integer in [1, 1000000], got '0'"),
        ("diloco:steps=-4", "steps: expected an integer in [1, 1000000], got '-4'"),
        ("diloco:steps=99999999", "steps: expected an integer in [1, 1000000]"),
        ("diloco:steps=1e3", "got '1e3'"),
        ("diloco:steps=41", "diloco steps=41 exceeds --steps 40"),
        (
            "diloco:outer=(nesterov:lr=1e9)",
            "outer optimizer lr: expected a finite number in (0, 10]",
        ),
        ("diloco:outer=(sgd:lr=nan)", "outer optimizer lr"),
        ("diloco:outer=(sgd:momentum=1)", "momentum: expected a finite number in [0, 1)"),
        ("diloco:outer=(adam)", "unknown outer optimizer 'adam'"),
        ("diloco:compressor=(topk:ratio=0)", "ratio"),
        ("diloco:compressor=(powersgd:rank=0)", "powersgd rank: expected an integer >= 1, got 0"),
        ("diloco:compressor=(torch:fp16)", "torch's own hooks work on DDP buckets only"),
        ("diloco:compressor=(topk:ratio=0.1", "a '(' is never closed"),
        ("diloco:compressor=topk:ratio=0.1)", "a ')' closes no '('"),
        ("diloco:steps=2,steps=3", "steps given twice"),
        ("diloco:window=3", "expected key=value with key in steps, outer, compressor"),
        ("diloco" + "x" * 5000, "expected one of ddp-hook"),
        ("diloco:" + "s" * 5000, "at most 400 characters"),
    ],
)
def test_hostile_diloco_specs_are_refused_before_any_rank_starts(
    sync: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(_command("--nproc", "2", "--steps", "40", "--sync", sync)) == 2
    error = capsys.readouterr().err
    assert expected in error and len(error) < 600 and error.count("\n") == 1


def test_a_compressor_flag_with_diloco_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_command("--nproc", "2", "--sync", "diloco", "--compressor", "sign")) == 2
    assert "diloco takes its compressor in its spec" in capsys.readouterr().err


def test_the_spec_grammar() -> None:
    assert parse_diloco("diloco") == DiLoCoSpec()
    assert parse_diloco(
        "diloco:steps=8,outer=(noloco:lr=0.5,momentum=0.3),compressor=(powersgd:rank=2)"
    ) == DiLoCoSpec(8, "noloco:lr=0.5,momentum=0.3", "powersgd:rank=2")
    assert parse_diloco(" diloco : compressor=sign , steps=4 ") == DiLoCoSpec(4, compressor="sign")


def test_the_command_reports_one_model_and_the_payload_bytes(tmp_path: Path) -> None:
    """`gossipcomp allreduce --sync diloco:...` end to end: 20 steps of H = 8 are three phases
    (the last one shorter), each one all-gather of a sign payload, and the ranks agree."""
    out = tmp_path / "report.json"
    sync = "diloco:steps=8,outer=(nesterov:lr=0.7,momentum=0.9),compressor=(sign)"
    flags = ("--nproc", "2", "--steps", "20", "--eval-every", "0", "--quiet")
    assert run(_command(*flags, "--sync", sync, "--report", str(out))) == 0
    report = json.loads(out.read_text())
    assert report["algorithm"] == sync and report["consensus_distance"] == 0.0
    n = sum(p.numel() for p in build_mlp(0).parameters())
    wire = parse_spec("sign").wire_bytes(n)
    assert [p["bytes_sent"] for p in report["per_peer"]] == [3 * wire, 3 * wire]
    assert report["config"]["payload_bytes_per_step"] == 3 * wire / 20
    assert report["min_test_accuracy"] == report["final_test_accuracy"] > 0.3


def test_the_benchmark_in_a_tiny_configuration() -> None:
    result = benchmark("allreduce_diloco").allreduce_runs(
        nproc=2, steps=16, seeds=(0,), variants=((4, "sign"), (16, "identity")), budget=0.05
    )
    table = result["configurations"]
    assert set(table) == {"ddp", "diloco H=4 sign", "diloco H=16 identity"}
    assert table["diloco H=16 identity"]["bytes_ratio"] == pytest.approx(1 / 16)
    assert result["best"] == "diloco H=4 sign"  # the only one within 1/20 of the bytes
    n = sum(p.numel() for p in build_mlp(0).parameters())
    sign = parse_spec("sign").wire_bytes(n)
    assert result["allreduce_bytes_ratio"] == pytest.approx(4 * sign / (16 * 4 * n))
    assert len(result["runs"]) == 3
    assert result["allreduce_gap_points"] == pytest.approx(table["diloco H=4 sign"]["gap_points"])
