"""One rank's collectives: issued in one deterministic order, with the bytes they move counted.

Every rank must issue the same collectives in the same order, or gloo and NCCL mismatch sizes or
hang (torch's own powerSGD_hook chains collectives in future callbacks, which run in different
orders on different ranks once a model spans two buckets). A `Communicator` therefore runs all
of its collectives on one worker thread, in the order they were submitted: code that submits in
the same order on every rank (DDP calls hooks bucket by bucket; the merged synchroniser submits
groups in plan order) gets the same collective order everywhere, while backward goes on.

Bytes: `Traffic.payload_bytes` is what this rank hands to collectives and sends point to point
(for a compressor, the sum of its `wire_bytes`). A collective's wire traffic is inside gloo or
NCCL and cannot be observed from here, so `link_bytes` counts what the bandwidth-optimal ring
algorithm (gloo's and NCCL's) sends from this rank for it: 2 (N - 1) / N of the buffer for an
all-reduce, (N - 1) times the rank's part for an all-gather; point-to-point sends count exactly.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from gossipcomp.allreduce.liveness import first_line

T = TypeVar("T")


@dataclass
class Traffic:
    """Bytes one rank put on the network, counted as they are submitted (module docstring)."""

    payload_bytes: int = 0
    link_bytes: float = 0.0
    collectives: int = 0

    def copy(self) -> Traffic:
        return Traffic(self.payload_bytes, self.link_bytes, self.collectives)


class CommunicatorFailed(RuntimeError):
    """Work not run because an earlier collective of the same communicator failed."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Communicator:
    """Collectives of one rank on a process group, run by a single worker thread in order.

    `submit(fn)` queues work (which calls the collective methods) and returns a
    concurrent.futures.Future; the methods themselves may also be called directly from one
    thread when nothing is queued (SSD-SGD, Marsit).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.traffic = Traffic()
        # all_gather in pieces of at most this many bytes (None: whole); pieces.py chooses it
        self.gather_piece_bytes: int | None = None
        self._failure: str | None = None  # the first failed collective's error (submit)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "gossipcomp-comm")

    def submit(self, work: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `work` on the communication thread after everything submitted before it.

        Once a collective has failed (a RuntimeError: a timeout, a closed connection) the ranks
        are out of step for good: work queued after it fails at once with `CommunicatorFailed`
        instead of waiting out a timeout of its own, so a rank whose peer hangs exits promptly.
        """
        return self._worker.submit(self._run, work)

    def _run(self, work: Callable[[], T]) -> T:
        if self._failure is not None:
            raise CommunicatorFailed(f"not sent: an earlier collective failed ({self._failure})")
        try:
            return work()
        except RuntimeError as error:
            self._failure = first_line(error)
            raise

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        self._count_all_reduce(tensor_bytes(tensor))
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start an in-place sum over the ranks; wait on the returned handle."""
        self._count_all_reduce(tensor_bytes(tensor))
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        assert work is not None
        return work

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all the same size), in rank order; with `gather_piece_bytes`
        set, as all_gathers of at most that many bytes each, one after the other (counted as
        one collective: the same bytes)."""
        nbytes = tensor_bytes(tensor)
        self.traffic.payload_bytes += nbytes
        self.traffic.link_bytes += (self.world - 1) * nbytes
        self.traffic.collectives += 1
        piece = self.gather_piece_bytes
        if piece is None or nbytes <= piece:
            parts = [torch.empty_like(tensor) for _ in range(self.world)]
            dist.all_gather(parts, tensor, group=self.group)
            return parts
        flat = tensor.contiguous().view(-1)
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        step = max(1, piece // flat.element_size())
        for start in range(0, flat.numel(), step):
            end = start + step
            outputs = [part[start:end] for part in gathered]
            dist.all_gather(outputs, flat[start:end], group=self.group)
        return [part.view(tensor.shape) for part in gathered]

    def exchange(
        self, send: torch.Tensor, to: int, receive: torch.Tensor, source: int
    ) -> torch.Tensor:
        """Send `send` to rank `to` while receiving `receive` from rank `source` (ring hop)."""
        nbytes = tensor_bytes(send)
        self.traffic.payload_bytes += nbytes
        self.traffic.link_bytes += nbytes
        self.traffic.collectives += 1
        ops = [
            dist.P2POp(dist.isend, send, self._global(to), self.group),
            dist.P2POp(dist.irecv, receive, self._global(source), self.group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return receive

    def close(self) -> None:
        """Finish queued work and stop the thread."""
        self._worker.shutdown(wait=True)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _count_all_reduce(self, nbytes: int) -> None:
        self.traffic.payload_bytes += nbytes
        self.traffic.link_bytes += 2 * (self.world - 1) / self.world * nbytes
        self.traffic.collectives += 1


def torch_future(future: concurrent.futures.Future[T]) -> torch.futures.Future[T]:
    """A torch Future completed with `future`'s result or exception (what DDP hooks return)."""
    result: torch.futures.Future[T] = torch.futures.Future()

    def finish(done: concurrent.futures.Future[T]) -> None:
        error = done.exception()
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(done.result())

    future.add_done_callback(finish)
    return result
