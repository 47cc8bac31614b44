"""DDP communication hooks built from gossipcomp's compressors, and PowerSGD.

`register(ddp, "topk:ratio=0.01")` installs a hook on a DistributedDataParallel model and
returns its state. For every bucket the hook compresses (gradient + error memory) into one
payload of exactly `wire_bytes` bytes (compress.device, so it stays on the accelerator) and:
- summable payloads (identity, fp16, bf16, random-k with indices shared through the context)
  go through one all-reduce: the summed payload decodes to the sum, divided by the world size
  (16-bit payloads carry the input already divided, so that their sum cannot overflow);
- the others (top-k, DGC, QSGD, TernGrad, sign, one-bit) go through one all-gather of the
  fixed-size payloads (no size exchange): every rank decodes all of them and averages.
Error feedback (on by default): memory <- input - what this rank's payload decodes to.

Momentum before compression (`momentum=beta`, default 0): the hook keeps this rank's velocity
u <- beta u + g per parameter and compresses u (plus the error memory) instead of g, so the
averaged output is the momentum step itself: build the optimizer WITHOUT momentum then. This is
where sign methods need it (Signum; EF-SGD with momentum, Karimireddy et al. 2019; DGC's
momentum correction): the optimizer's momentum applied to an error-fed sign output replays the
delayed memory ten times over at beta 0.9 and diverges (digits, 2 ranks, lr 0.1: 0.25 accuracy,
0.96 with the momentum in the hook; docs/benchmarks.md).

`register(ddp, "powersgd:rank=R")` installs PowerSGD (Vogels et al. 2019): per bucket, matrices
M (a parameter viewed as [shape[0], -1], worth compressing when (n + m) r * 2 < n m, as torch's
min_compression_rate 2) are approximated by P Q^T: P = M Q summed over ranks, orthonormalised
(Gram-Schmidt, eps 1e-8), Q = M^T P summed and divided by the world size; other tensors are
averaged whole, in the same all-reduce as the Ps (two collectives a bucket; torch's hook issues
three, the whole tensors on their own). Q starts from a random draw shared through the seed, then (warm start)
continues from the previous step. Error feedback: memory <- input - the averaged approximation.

State (error memories, velocities, PowerSGD's Qs) is keyed by parameter names (memory.py),
so it survives DDP's bucket rebuild after the first iteration and goes into checkpoints
(`state_dict` / `load_state_dict`) that apply to whatever buckets the restoring DDP makes. All collectives
run on one communication thread in the order DDP calls the hook (bucket order, the same on every
rank), never chained from future callbacks: any number of buckets is safe.
`half_wrapper(hook)` makes any hook receive a float16 (or bfloat16) bucket, as torch's
fp16_compress_wrapper does; PowerSGD then sends P and Q in that type.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gossipcomp.allreduce.agreement import check_ddp_hook
from gossipcomp.allreduce.comm import Communicator, torch_future
from gossipcomp.allreduce.memory import Names, ParameterMemory
from gossipcomp.allreduce.pieces import set_gather_pieces
from gossipcomp.allreduce.settings import GATHER_AUTO
from gossipcomp.compress import CompressionContext, ErrorFeedback, parse_spec
from gossipcomp.compress.codec import Codec
from gossipcomp.compress.device import decode, encode, summable_dtype, summable_view
from gossipcomp.inputs.numbers import checked_integer, checked_number

POWERSGD = "powersgd"
MIN_COMPRESSION_RATE = 2.0  # torch's default: compress a matrix only if it shrinks 2x or more
ORTHOGONALIZATION_EPS = 1e-8
SIGN_CODECS = frozenset({"sign", "onebit"})  # take the momentum before compression

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class _Bucket:
    """What a hook needs of a GradBucket, read on the calling thread."""

    buffer: torch.Tensor
    names: Names
    shapes: tuple[tuple[int, ...], ...]
    first_index: int
    round: int

    @property
    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]


@dataclass
class HookState:
    """What every hook keeps: names of the parameters, the communicator, the iteration."""

    names: dict[int, str]  # id(parameter) -> name
    order: dict[str, int]  # name -> position in the model's parameter list
    communicator: Communicator
    seed: int = 0
    round: int = 0  # iterations completed (the last bucket of each ends one)
    memory: ParameterMemory = field(default_factory=ParameterMemory)
    momentum: float = 0.0  # velocity kept before compression (module docstring); 0: none
    velocity: ParameterMemory = field(default_factory=ParameterMemory)

    def __post_init__(self) -> None:
        checked_number("hook momentum", self.momentum, 0.0, 1.0, closed_high=False)

    def bucket(self, bucket: dist.GradBucket) -> _Bucket:
        parameters = bucket.parameters()
        names = tuple(self.names[id(p)] for p in parameters)
        shapes = tuple(tuple(p.shape) for p in parameters)
        buffer = bucket.buffer()
        if buffer.numel() != sum(math.prod(s) for s in shapes):
            raise ValueError(
                f"bucket {bucket.index()}: buffer of {buffer.numel()} elements does not match "
                "its parameters"
            )
        view = _Bucket(buffer, names, shapes, min(self.order[n] for n in names), self.round)
        if bucket.is_last():
            self.round += 1
        return view

    def submit(self, work: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        return torch_future(self.communicator.submit(work))

    def accumulate(self, x: torch.Tensor, names: Names, numels: Sequence[int]) -> None:
        """With momentum: velocity <- momentum * velocity + x, then x <- velocity (in place)."""
        if self.momentum:
            velocity = self.velocity.flat(names, numels, x.device)
            velocity.mul_(self.momentum).add_(x)
            x.copy_(velocity)

    def base_state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "memory": self.memory.state_dict(),
            "velocity": self.velocity.state_dict(),
        }

    def load_base_state_dict(self, state: dict[str, Any]) -> None:
        round_ = checked_integer("hook state round", state["round"], 0)
        velocity = state.get("velocity", {})
        if not isinstance(velocity, Mapping):
            raise ValueError("hook state velocity: expected a mapping of parameter names")
        if round_ > 0 and bool(velocity) != bool(self.momentum):
            saved, now = ("with", "without") if velocity else ("without", "with")
            raise ValueError(
                f"hook state: saved {saved} a momentum velocity, this hook runs {now} one "
                f"(momentum {self.momentum}); give register() the momentum it was saved with"
            )
        self.memory.load_state_dict(state["memory"])
        self.velocity.load_state_dict(velocity)
        self.round = round_


@dataclass
class CompressedState(HookState):
    """State of `compressed_hook`: the compressor and whether error feedback is on."""

    compressor: Codec = field(default_factory=lambda: parse_spec("identity"))  # type: ignore[arg-type]
    error_feedback: bool = True

    def state_dict(self) -> dict[str, Any]:
        return self.base_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_base_state_dict(state)

    def sync(self, bucket: _Bucket) -> torch.Tensor:
        """Average the bucket's gradients through its compressed payloads (module docstring)."""
        x = bucket.buffer.to(torch.float32, copy=True)
        mean = self.average(x, bucket.names, bucket.numels, bucket.first_index, bucket.round)
        bucket.buffer.copy_(mean)
        return bucket.buffer

    def average(
        self, x: torch.Tensor, names: Names, numels: Sequence[int], first_index: int, round_: int
    ) -> torch.Tensor:
        """The mean over ranks of the flat float32 `x` (this rank's gradients of `names`, which
        may be overwritten) through compressed payloads, with error feedback."""
        comm, compressor = self.communicator, self.compressor
        self.accumulate(x, names, numels)
        memory = None
        if self.error_feedback:
            memory = self.memory.flat(names, numels, x.device)
            x += memory
        if compressor.summable:
            # 16-bit sums could overflow: those payloads carry x / N, float32 ones carry x
            # (then the identity hook's result is exactly the sum divided by N)
            before = comm.world if summable_dtype(compressor).itemsize < 4 else 1
            after = comm.world / before
            ctx = CompressionContext(self.seed, -1, -1, round_, first_index)
            if before != 1:
                x /= before
            payload = encode(compressor, x, ctx)
            if memory is not None:
                sent = decode(compressor, payload, x.shape, ctx)
                torch.sub(x, sent, out=memory).mul_(before)
            comm.all_reduce_sum(summable_view(compressor, payload))
            return decode(compressor, payload, x.shape, ctx).div_(after)
        ctx = CompressionContext(self.seed, comm.rank, -1, round_, first_index)
        parts = comm.all_gather(encode(compressor, x, ctx))
        mean = torch.zeros_like(x)
        for sender, part in enumerate(parts):
            sender_ctx = CompressionContext(self.seed, sender, -1, round_, first_index)
            decoded = decode(compressor, part, x.shape, sender_ctx)
            mean += decoded
            if memory is not None and sender == comm.rank:
                torch.sub(x, decoded, out=memory)
        return mean.div_(comm.world)


def compressed_hook(
    state: CompressedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket's mean gradient through compressed payloads (module docstring)."""
    view = state.bucket(bucket)
    return state.submit(lambda: state.sync(view))


@dataclass
class PowerSGDState(HookState):
    """State of `powersgd_hook`: rank, options, and the Q of every compressed matrix by name."""

    rank: int = 1
    error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = MIN_COMPRESSION_RATE
    q: dict[str, torch.Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {**self.base_state_dict(), "q": {n: t.clone() for n, t in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_base_state_dict(state)
        self.q = {name: tensor.detach().clone() for name, tensor in state["q"].items()}

    def compressed(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """(n, m, r) when a tensor of `shape` is approximated, None when it goes whole."""
        if len(shape) < 2:
            return None
        n, m = shape[0], math.prod(shape[1:])
        r = min(self.rank, n, m)
        return (n, m, r) if (n + m) * r * self.min_compression_rate < n * m else None

    def sync(self, bucket: _Bucket) -> torch.Tensor:
        comm, dtype = self.communicator, bucket.buffer.dtype
        x = bucket.buffer.to(torch.float32, copy=True)
        self.accumulate(x, bucket.names, bucket.numels)
        memory = None
        if self.error_feedback:
            memory = self.memory.flat(bucket.names, bucket.numels, x.device)
            x += memory
        views = x.split(bucket.numels)
        result = torch.empty_like(x)
        outputs = result.split(bucket.numels)
        plans = [self.compressed(shape) for shape in bucket.shapes]
        whole = [i for i, plan in enumerate(plans) if plan is None]
        matrices = {i: plan for i, plan in enumerate(plans) if plan is not None}
        ms = {i: views[i].view(n, m) for i, (n, m, _) in matrices.items()}
        # one all-reduce carries the whole tensors and every P, a second every Q
        first = [views[i] for i in whole]
        first += [
            (ms[i] @ self._start_q(bucket, i, plan)).reshape(-1) for i, plan in matrices.items()
        ]
        summed = comm.all_reduce_sum(torch.cat(first).to(dtype)).to(torch.float32)
        sizes = [bucket.numels[i] for i in whole] + [n * r for n, _, r in matrices.values()]
        parts = summed.split(sizes)
        for i, part in zip(whole, parts, strict=False):
            torch.div(part, comm.world, out=outputs[i].view(-1))
        ps = {
            i: orthonormalise(part.view(n, r))
            for (i, (n, _, r)), part in zip(matrices.items(), parts[len(whole) :], strict=True)
        }
        if not matrices:
            return self._finish(bucket, x, result, memory)
        q_all = torch.cat([(ms[i].T @ ps[i]).reshape(-1) for i in matrices]).to(dtype)
        q_all = comm.all_reduce_sum(q_all).to(torch.float32).div_(comm.world)
        q_parts = q_all.split([m * r for _, m, r in matrices.values()])
        for (i, (_, m, r)), q in zip(matrices.items(), q_parts, strict=True):
            q = q.view(m, r)
            torch.mm(ps[i], q.T, out=outputs[i].view(ms[i].shape))
            if self.warm_start:
                self.q[bucket.names[i]] = q.clone()
        return self._finish(bucket, x, result, memory)

    def _finish(
        self,
        bucket: _Bucket,
        x: torch.Tensor,
        result: torch.Tensor,
        memory: torch.Tensor | None,
    ) -> torch.Tensor:
        if memory is not None:
            torch.sub(x, result, out=memory)
        bucket.buffer.copy_(result)
        return bucket.buffer

    def _start_q(self, bucket: _Bucket, i: int, plan: tuple[int, int, int]) -> torch.Tensor:
        _, m, r = plan
        name = bucket.names[i]
        previous = self.q.get(name) if self.warm_start else None
        if previous is not None and previous.shape == (m, r):
            return previous.to(bucket.buffer.device)
        round_ = 0 if self.warm_start else bucket.round
        ctx = CompressionContext(self.seed, -1, -1, round_, self.order[name])
        return torch.randn(m, r, generator=ctx.generator("cpu")).to(bucket.buffer.device)


def orthonormalise(matrix: torch.Tensor, eps: float = ORTHOGONALIZATION_EPS) -> torch.Tensor:
    """Gram-Schmidt on the columns of `matrix` (a new tensor): each column minus its
    projections on the earlier ones, divided by its norm + eps. Works on the transposed copy,
    where the columns are contiguous rows (strided column updates cost ten times more)."""
    rows = matrix.T.contiguous()
    for j in range(rows.shape[0]):
        if j:
            earlier = rows[:j]
            rows[j] -= earlier.T @ (earlier @ rows[j])
        rows[j] /= torch.linalg.vector_norm(rows[j]) + eps
    return rows.T


def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: PowerSGD on the bucket (module docstring)."""
    view = state.bucket(bucket)
    return state.submit(lambda: state.sync(view))


def half_wrapper(hook: Hook, dtype: torch.dtype = torch.float16) -> Hook:
    """`hook` run on the bucket cast to `dtype` (float16 or bfloat16); the result is cast back."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"half_wrapper casts to float16 or bfloat16, got {dtype}")

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        full = bucket.buffer()
        bucket.set_buffer(full.to(dtype))
        future = hook(state, bucket)

        def widen(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = done.value()
            full.copy_(value[0] if isinstance(value, list) else value)
            return full

        return future.then(widen)

    return wrapped


def parse_hook_spec(spec: str) -> tuple[str, dict[str, str]]:
    name, _, arguments = spec.strip().partition(":")
    values = {}
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, equals, raw = (piece.strip() for piece in item.partition("="))
        if not equals:
            raise ValueError(f"hook spec {spec!r}: expected key=value, got {item!r}")
        values[key] = raw
    return name.strip(), values


def powersgd_options(values: Mapping[str, str]) -> tuple[int, bool]:
    """PowerSGD's rank and warm start from a hook spec's key=value pairs, checked."""
    known = {"rank", "warm_start"}
    if set(values) - known:
        raise ValueError(f"powersgd takes {sorted(known)}, got {sorted(values)}")
    try:
        rank = int(values.get("rank", "1"))
    except ValueError:
        raise ValueError(f"powersgd rank: expected an integer, got {values['rank']!r}") from None
    checked_integer("powersgd rank", rank, 1)
    warm = values.get("warm_start", "true").lower()
    if warm not in ("true", "false"):
        raise ValueError(f"powersgd warm_start: expected true or false, got {warm!r}")
    return rank, warm == "true"


def make_state(
    spec: str,
    names: dict[int, str],
    order: dict[str, int],
    communicator: Communicator,
    seed: int = 0,
    error_feedback: bool = True,
    momentum: float = 0.0,
) -> tuple[HookState, Hook]:
    """A hook and its state from a spec: "powersgd:rank=R[,warm_start=false]" or any
    compressor spec (an "ef+" prefix is the same as error_feedback=True); `momentum` is kept
    before compression (module docstring)."""
    name, values = parse_hook_spec(spec)
    if name == POWERSGD:
        rank, warm = powersgd_options(values)
        state: HookState = PowerSGDState(
            names,
            order,
            communicator,
            seed,
            momentum=momentum,
            rank=rank,
            error_feedback=error_feedback,
            warm_start=warm,
        )
        return state, powersgd_hook  # type: ignore[return-value]
    compressor = parse_spec(spec)
    if isinstance(compressor, ErrorFeedback):
        compressor, error_feedback = compressor.inner, True
    assert isinstance(compressor, Codec)
    exact = compressor.name == "identity"
    state = CompressedState(
        names,
        order,
        communicator,
        seed,
        momentum=momentum,
        compressor=compressor,
        error_feedback=error_feedback and not exact,
    )
    return state, compressed_hook  # type: ignore[return-value]


def sync_flat(
    state: CompressedState | PowerSGDState,
    buffer: torch.Tensor,
    names: Names,
    shapes: Sequence[tuple[int, ...]],
    round_: int,
) -> torch.Tensor:
    """Outside DDP: average the flat float32 `buffer` (this rank's values of the parameters
    `names`, shaped `shapes`, in order) over the ranks through `state`'s compressor and error
    feedback, as the hook does a bucket, in place; returns it. `round_` seeds the compressor's
    randomness (the same on every rank). Called from one thread with nothing submitted."""
    first = min(state.order[name] for name in names)
    return state.sync(_Bucket(buffer, names, tuple(tuple(s) for s in shapes), first, round_))


def takes_momentum(spec: str) -> bool:
    """Whether the hook of `spec` needs the optimizer's momentum kept before compression
    (`register(..., momentum=beta)` with an optimizer without momentum): the sign codecs,
    whose error-fed output the optimizer's momentum makes diverge (module docstring)."""
    name = spec.strip().partition(":")[0].strip()  # torch's "torch:fp16" included
    return name.removeprefix("ef+") in SIGN_CODECS


def register(
    ddp: DistributedDataParallel,
    spec: str,
    *,
    seed: int = 0,
    error_feedback: bool = True,
    half: torch.dtype | None = None,
    communicator: Communicator | None = None,
    momentum: float | None = None,
    gather_pieces: str = GATHER_AUTO,
) -> HookState:
    """Install the hook of `spec` (see make_state) on `ddp`, once; returns its state.

    A compressor whose payloads are all-gathered (top-k, sign, ...) sends them whole or in
    pieces as `gather_pieces` says: auto times both on this job's link now, a collective
    every rank takes part in (pieces.py: the model's payload, at most 1 MiB, at least 2
    timed rounds and more while under 5 s); whole; or the KiB of a piece.

    `half` (torch.float16 or torch.bfloat16) wraps it in `half_wrapper`. `momentum`: the hook
    keeps the velocity before compressing (module docstring); the optimizer must then have
    none. Sign codecs need it (`takes_momentum`): with the optimizer's momentum they diverge,
    so for them it must be given (0.0 for plain SGD), never left to a default; other codecs
    default to 0.0.
    """
    named = list(ddp.module.named_parameters())
    names = {id(p): name for name, p in named}
    order = {name: index for index, (name, _) in enumerate(named)}
    comm = communicator or Communicator(ddp.process_group)
    given = momentum is not None
    state, hook = make_state(spec, names, order, comm, seed, error_feedback, momentum or 0.0)
    check_ddp_hook(comm, ddp, state, hook, half, gather_pieces)  # every rank the same
    if not given and takes_momentum(spec):  # after agreeing: every rank refuses alike
        raise ValueError(
            f"register(ddp, {spec[:64]!r}): a sign-based hook needs momentum= given: move "
            "the optimizer's momentum into the hook (e.g. momentum=0.9 with "
            "torch.optim.SGD(..., momentum=0)), or pass momentum=0.0 for plain SGD; the sign "
            "of an update under the optimizer's momentum diverges"
        )
    if isinstance(state, CompressedState):
        numel = sum(p.numel() for _, p in named)
        device = next(ddp.module.parameters()).device
        set_gather_pieces(comm, gather_pieces, [state.compressor], numel, device)
    ddp.register_comm_hook(state, half_wrapper(hook, half) if half is not None else hook)
    return state
