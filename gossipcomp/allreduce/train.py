"""One rank's training on digits in all-reduce mode: what `gossipcomp allreduce` and the
benchmarks run, with every synchroniser of the package.

sync:
- ddp-hook: DistributedDataParallel with the hook of `compressor` (hooks.make_state: any
  compressor spec or "powersgd:rank=R"; or torch's own "torch:allreduce", "torch:fp16",
  "torch:powersgd:rank=R" from reference.py);
- merged: MergedSync with groups from `planner` (per-tensor, single, mgwfbp, mergecomp, strategy,
  or "threshold");
- marsit: MarsitSync (the compressor is Marsit's sign ring);
- ssd: SSDSGD over plain all-reduce, k = ssd_k, warm-up ssd_warmup steps;
- diloco[:steps=H,outer=(SPEC),compressor=(SPEC)]: DiLoCoSync (diloco.py), H local steps with
  this rank's own optimizer, then the compressed, error-fed pseudo-gradients averaged and an
  outer step; a last, shorter phase ends the run when H does not divide the steps.
Every rank builds the same model from the seed and trains on its share of the data; ranks
given different configurations refuse together before the first collective (agreement.py).
Where ddp-hook's or merged's compressor all-gathers its payloads (top-k, random-k, ...), the
all_gathers go whole or in pieces as `gather_pieces` says (auto: timed at the start, pieces.py).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce import reference
from gossipcomp.allreduce.agreement import check_same_setup
from gossipcomp.allreduce.calibrate import (
    MAX_STEPS,
    MIN_STEPS,
    PROBES,
    StepParts,
    calibrate,
    calibrated_plan,
)
from gossipcomp.allreduce.comm import Communicator, Traffic
from gossipcomp.allreduce.diloco import DiLoCoSync, is_diloco, parse_diloco
from gossipcomp.allreduce.hooks import register, takes_momentum
from gossipcomp.allreduce.launch import Session
from gossipcomp.allreduce.marsit import MarsitSync
from gossipcomp.allreduce.merged import (
    MergedSync,
    Plan,
    make_plan,
    measure_backward,
    plan_specs,
    threshold_groups,
)
from gossipcomp.allreduce.pieces import set_gather_pieces
from gossipcomp.allreduce.settings import (
    DATASETS,
    MODEL_NAMES,
    SYNCS,
    THRESHOLD,
    AllreduceSettings,
    parse_gather_pieces,
)
from gossipcomp.allreduce.ssd import SSDSGD
from gossipcomp.compress import parse_spec
from gossipcomp.inputs.text import quoted
from gossipcomp.schedule import TensorGroup
from gossipcomp.workload.data import load_split, parse_partition, partition_indices
from gossipcomp.workload.models import build_chartransformer, build_mlp, build_resmlp
from gossipcomp.workload.pairing import check_pairing
from gossipcomp.workload.text import DEFAULT_CONTEXT, VOCABULARY_SIZE
from gossipcomp.workload.training import (
    BatchStream,
    evaluate,
    evaluate_accuracy,
    make_optimizer,
    prediction_loss,
)

MODELS: dict[str, Callable[[int], nn.Module]] = dict(
    zip(
        MODEL_NAMES,
        (
            build_mlp,
            build_resmlp,
            lambda seed: build_resmlp(seed, width=256),
            # windows of 64 characters, 101 character ids (workload/text.py)
            lambda seed: build_chartransformer(seed, DEFAULT_CONTEXT, VOCABULARY_SIZE),
        ),
        strict=True,
    )
)
TIMED_AFTER = 5  # steps left out of the step-time median (start-up, DDP's bucket rebuild)


@dataclass(frozen=True)
class AllreduceConfig(AllreduceSettings):
    """One all-reduce training run (module docstring for sync): AllreduceSettings, checked."""

    def __post_init__(self) -> None:
        if is_diloco(self.sync):
            steps = parse_diloco(self.sync).steps
            if steps > self.steps:
                raise ValueError(
                    f"--sync diloco steps={steps} exceeds --steps {self.steps}: no phase would "
                    "end before the run does"
                )
            if self.compressor != AllreduceConfig.compressor:
                raise ValueError(
                    f"--compressor {quoted(self.compressor)} with --sync diloco: diloco takes "
                    "its compressor in its spec (diloco:compressor=(SPEC))"
                )
        elif self.sync not in SYNCS:
            raise ValueError(
                f"sync {quoted(self.sync)}: expected one of {', '.join(SYNCS)} "
                "(diloco with its spec: diloco:steps=H,outer=(SPEC),compressor=(SPEC))"
            )
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r}: expected one of {', '.join(MODELS)}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch size must be >= 1")
        if self.dataset not in DATASETS:
            raise ValueError(
                f"dataset {quoted(self.dataset)}: expected one of {', '.join(DATASETS)}"
            )
        check_pairing(self.model, self.dataset, self.partition)  # the partition parsed too
        calibration = self.calibration_steps
        if (
            isinstance(calibration, bool)
            or not isinstance(calibration, int)
            or not (calibration == 0 or MIN_STEPS <= calibration <= MAX_STEPS)
        ):
            raise ValueError(
                f"calibration steps {quoted(calibration)}: expected 0 or an int in "
                f"[{MIN_STEPS}, {MAX_STEPS}]"
            )
        parse_gather_pieces(self.gather_pieces)
        if self.calibrated_steps() >= self.steps:
            raise ValueError(
                f"--steps {self.steps}: expected more than the {self.calibrated_steps()} "
                f"calibration steps ({calibration} per probe plan) a merged run takes"
            )

    def calibrated_steps(self) -> int:
        """Steps of the run spent calibrating the plan (merged with a planner), else 0."""
        if self.sync != "merged" or self.planner == THRESHOLD:
            return 0
        return len(PROBES) * self.calibration_steps


@dataclass
class RankResult:
    """What one rank reports after training."""

    rank: int
    test_accuracy: float
    average_model_test_accuracy: float
    average_model_norm: float
    consensus_distance: float
    traffic: Traffic
    steps: int
    compute_seconds: float
    comm_seconds: float
    step_seconds: float  # median wall time of a step after the first TIMED_AFTER
    groups: int  # collectives' groups (DDP buckets, planned groups, 1)
    # bytes a step after the first TIMED_AFTER (torch's PowerSGD starts with plain all-reduce)
    steady_payload_bytes_per_step: float
    steady_link_bytes_per_step: float
    history: list[tuple[int, float, float]] = field(default_factory=list)  # step, acc, link bytes
    predicted_step_seconds: float = 0.0  # merged with a planner: its cost model's step time
    # test loss (mean cross-entropy, nats a prediction: a language model's validation loss)
    test_loss: float | None = None
    average_model_test_loss: float | None = None
    # steps trained while calibrating the merged plan, before the timed loop: compute_seconds
    # and comm_seconds cover the other steps - calibration_steps
    calibration_steps: int = 0
    planned_latency_s: float = 0.0  # merged with a planner: the cost of one more collective
    planned_contention: float = 0.0  # and how much slower communication runs beside backward
    gather_piece_bytes: int = 0  # the pieces its all_gathers went in (0: whole)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def shard_sizes(config: AllreduceConfig, world: int) -> list[int]:
    """Training examples each of `world` ranks holds under `config` (rank order)."""
    split = load_split(config.dataset, config.seed)
    return [len(part) for part in _shards(config, split.y_train, world)]


def _shards(config: AllreduceConfig, labels: torch.Tensor, world: int) -> list[np.ndarray]:
    """Each rank's training indices: one dealing for training and for `shard_sizes`."""
    return partition_indices(labels.numpy(), world, parse_partition(config.partition), config.seed)


def _data(
    config: AllreduceConfig, rank: int, world: int
) -> tuple[BatchStream, torch.Tensor, torch.Tensor]:
    split = load_split(config.dataset, config.seed)
    index = torch.from_numpy(_shards(config, split.y_train, world)[rank])
    stream = BatchStream(
        split.x_train[index], split.y_train[index], config.batch_size, config.seed, rank
    )
    return stream, split.x_test, split.y_test


def sync_takes_momentum(config: AllreduceConfig) -> bool:
    """Whether `config`'s synchroniser keeps the momentum itself (Marsit, the sign codecs)."""
    if config.sync == "marsit":
        return True
    return config.sync in ("ddp-hook", "merged") and takes_momentum(config.compressor)


def train_rank(session: Session, config: AllreduceConfig) -> RankResult:
    """Train on this rank (module docstring); every rank of the job calls it."""
    rank, world = session.rank, session.world
    device = session.device
    model = MODELS[config.model](config.seed).to(device)
    stream, x_test, y_test = _data(config, rank, world)
    x_test, y_test = x_test.to(device), y_test.to(device)
    # sign methods keep the momentum before compressing (hooks.py, marsit.py): not the optimizer
    in_sync = config.momentum if sync_takes_momentum(config) else 0.0
    optimizer = make_optimizer(model, config.lr, config.momentum - in_sync)
    comm = Communicator()
    check_same_setup(comm, "gossipcomp allreduce", {"config": asdict(config)})
    forward: nn.Module = model
    after_backward: Callable[[], None] = lambda: None  # noqa: E731
    step: Callable[[], None] = optimizer.step
    waited: Callable[[], float] = lambda: 0.0  # noqa: E731
    counting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    groups = 1
    predicted_s = latency_s = contention = 0.0
    if config.sync == "ddp-hook":
        ddp = DistributedDataParallel(
            model,
            bucket_cap_mb=config.bucket_cap_mb,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        forward = ddp
        if config.compressor.startswith("torch:"):
            reference.register_reference(ddp, config.compressor)
            counting = reference.counted(comm.traffic, world)
        else:
            register(
                ddp,
                config.compressor,
                seed=config.seed,
                error_feedback=config.error_feedback,
                communicator=comm,
                momentum=in_sync,
                gather_pieces=config.gather_pieces,
            )
    elif config.sync == "merged":
        numel = sum(p.numel() for p in model.parameters())
        specs = plan_specs(config.planner, config.compressor)  # a plan may use any of them
        compressors = [parse_spec(spec) for spec in specs]
        set_gather_pieces(comm, config.gather_pieces, compressors, numel, device)
        merged, plan = _merged(model, config, comm, stream, optimizer)
        predicted_s = plan.predicted_s
        latency_s = plan.link.latency_s if plan.link is not None else 0.0
        contention = plan.contention
        groups = len(merged.groups)
        after_backward, waited = merged.synchronize, lambda: merged.wait_seconds
    elif config.sync == "marsit":
        marsit = MarsitSync(model, comm, config.seed, momentum=in_sync)
        after_backward, waited = marsit.synchronize, lambda: marsit.wait_seconds
    elif is_diloco(config.sync):
        diloco = DiLoCoSync(
            model,
            parse_diloco(config.sync),
            comm,
            seed=config.seed,
            error_feedback=config.error_feedback,
        )

        def local_step() -> None:
            optimizer.step()
            diloco.local_step()

        step, waited = local_step, lambda: diloco.wait_seconds
    else:
        ssd = SSDSGD(model, optimizer, comm, config.ssd_k, config.ssd_warmup)
        step, waited = ssd.step, lambda: ssd.wait_seconds
    history: list[tuple[int, float, float]] = []
    durations: list[float] = []
    steady_from = (0, Traffic())
    calibrated = config.calibrated_steps()  # steps _merged trained while calibrating
    with counting:
        for number in range(calibrated + 1, config.steps + 1):
            start = time.perf_counter()
            x, y = (t.to(device, non_blocking=True) for t in stream.next_batch())
            model.train()
            optimizer.zero_grad(set_to_none=True)
            prediction_loss(forward(x), y).backward()
            after_backward()
            step()
            durations.append(time.perf_counter() - start)
            if number == min(calibrated + TIMED_AFTER, config.steps - 1):
                steady_from = (number, comm.traffic.copy())
            if config.eval_every and number % config.eval_every == 0:
                accuracy = evaluate_accuracy(model, x_test, y_test)
                history.append((number, accuracy, comm.traffic.link_bytes))
    if config.sync == "ssd":
        ssd.pull()
    if is_diloco(config.sync) and diloco.steps_in_phase:
        start = time.perf_counter()
        diloco.synchronize()  # the last, shorter phase: every rank ends on the same model
        durations[-1] += time.perf_counter() - start
    comm.close()
    total = sum(durations)
    comm_s = min(total, waited())
    mean_model = _mean_model(model, world)
    params = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    distance = float(((params - mean_model) ** 2).sum())
    average = MODELS[config.model](config.seed).to(device)
    with torch.no_grad():
        offset = 0
        for p in average.parameters():
            p.copy_(mean_model[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    if config.sync == "ddp-hook":
        groups = max(1, comm.traffic.collectives // max(1, config.steps))
    timed = durations[TIMED_AFTER:] or durations
    steady_steps = max(1, config.steps - steady_from[0])  # after calibration
    steady = comm.traffic
    accuracy, loss = evaluate(model, x_test, y_test)
    average_accuracy, average_loss = evaluate(average, x_test, y_test)
    return RankResult(
        rank=rank,
        test_accuracy=accuracy,
        average_model_test_accuracy=average_accuracy,
        average_model_norm=float(mean_model.norm()),
        consensus_distance=distance,
        traffic=comm.traffic.copy(),
        steps=config.steps,
        compute_seconds=total - comm_s,
        comm_seconds=comm_s,
        step_seconds=statistics.median(timed),
        groups=groups,
        steady_payload_bytes_per_step=(steady.payload_bytes - steady_from[1].payload_bytes)
        / steady_steps,
        steady_link_bytes_per_step=(steady.link_bytes - steady_from[1].link_bytes) / steady_steps,
        history=history,
        predicted_step_seconds=predicted_s,
        test_loss=loss,
        average_model_test_loss=average_loss,
        calibration_steps=calibrated,
        planned_latency_s=latency_s,
        planned_contention=contention,
        gather_piece_bytes=comm.gather_piece_bytes or 0,
    )


def _mean_model(model: nn.Module, world: int) -> torch.Tensor:
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    dist.all_reduce(flat)
    return flat / world


def _merged(
    model: nn.Module,
    config: AllreduceConfig,
    comm: Communicator,
    stream: BatchStream,
    optimizer: torch.optim.Optimizer,
) -> tuple[MergedSync, Plan]:
    """The merged synchroniser of `config`'s planner, and its plan. With
    calibration steps, the first `config.calibrated_steps()` training steps run here under the
    probe plans and price the plan (calibrate.py)."""
    device = next(model.parameters()).device
    momentum = config.momentum if sync_takes_momentum(config) else 0.0

    def sync(groups: Sequence[TensorGroup], timed: bool = False) -> MergedSync:
        return MergedSync(
            model,
            groups,
            comm,
            seed=config.seed,
            error_feedback=config.error_feedback,
            momentum=momentum,
            timed=timed,
        )

    if config.planner != THRESHOLD and config.calibration_steps:

        def loss() -> torch.Tensor:
            x, y = (t.to(device, non_blocking=True) for t in stream.next_batch())
            model.train()
            optimizer.zero_grad(set_to_none=True)
            return prediction_loss(model(x), y)

        parts = StepParts(loss, optimizer.step)
        calibration = calibrate(
            model,
            parts,
            lambda groups: sync(groups, timed=True),
            config.compressor,
            config.calibration_steps,
        )
        plan = calibrated_plan(config.planner, calibration, comm)
        return sync(plan.groups), plan
    x, y = (t.to(device) for t in stream.next_batch())

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        prediction_loss(model(x), y).backward()

    tensors, compute_s = measure_backward(model, backward)
    model.zero_grad(set_to_none=True)
    if config.planner == THRESHOLD:
        plan = Plan(threshold_groups(tensors, config.compressor), 0.0)
    else:
        plan = make_plan(config.planner, tensors, config.compressor, comm, compute_s, device)
    comm.traffic = Traffic()  # the link measurements are not training traffic
    return sync(plan.groups), plan
