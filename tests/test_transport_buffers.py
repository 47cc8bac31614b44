"""Receive buffers reused only when nothing refers to them, and the warm-heap allocator setting."""

from __future__ import annotations

import numpy
import torch
from conftest import run_in_threads

from gossipcomp.transport.allocator import keep_heap_warm
from gossipcomp.transport.buffers import MIN_POOLED_BYTES, BufferPool
from gossipcomp.transport.codec import decode_raw, encode_raw, tensor_spec

MIB = 1 << 20


def _address(view: memoryview) -> int:
    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


def test_an_idle_buffer_is_reused_and_a_referenced_one_never_is():
    pool = BufferPool(64 * MIB)
    first = pool.take(4 * MIB)
    where = _address(first)
    assert _address(pool.take(4 * MIB)) != where  # `first` still holds it
    views = {
        "memoryview slice": lambda v: v[10:20],
        "numpy view": lambda v: numpy.frombuffer(v, dtype=numpy.float32)[3:],
        "torch tensor": lambda v: torch.frombuffer(v, dtype=torch.float32).reshape(2, -1),
    }
    for name, make in views.items():
        held = make(first)
        del first
        assert all(_address(pool.take(4 * MIB)) != where for _ in range(3)), name
        del held
        first = pool.take(4 * MIB)
        assert _address(first) == where, f"not reused once the {name} was dropped"


def test_the_pool_keeps_at_most_its_bytes_and_leaves_small_buffers_to_malloc():
    pool = BufferPool(8 * MIB)
    held = [pool.take(4 * MIB) for _ in range(3)]
    assert pool.pooled_bytes == 8 * MIB  # the third is served but not kept
    del held[0]
    assert len(pool.take(6 * MIB)) == 6 * MIB  # the idle 4 MiB is dropped, the busy one stays
    assert pool.pooled_bytes == 4 * MIB
    pool.take(MIN_POOLED_BYTES - 1)
    assert pool.pooled_bytes == 4 * MIB
    assert BufferPool(0).take(2 * MIB).nbytes == 2 * MIB


def test_an_envelope_held_by_the_algorithm_is_not_overwritten_by_the_next(grpc_pair):
    a, b = grpc_pair()
    values = [torch.randn(MIB, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    spec = (tensor_spec("x", values[0]),)
    a.inbox.expect("p", spec)
    b.inbox.expect("p", spec)
    ack = (encode_raw("x", torch.zeros(MIB)),)

    def round_of(r: int) -> torch.Tensor:
        sent, got = run_in_threads(
            [
                lambda: a.exchange(r, "p", {1: (encode_raw("x", values[r]),)}, 20),
                lambda: b.exchange(r, "p", {0: ack}, 20),
            ]
        )
        assert not sent.failed and not got.failed
        return decode_raw(got.received[0].tensor("x"))

    kept = round_of(0)  # held across the next rounds, as an algorithm may
    for r in (1, 2, 3):
        assert torch.equal(round_of(r), values[r])
        assert torch.equal(kept, values[0])
    assert b._service._buffers.pooled_bytes == 2 * 4 * MIB  # rounds 2 and 3 reused round 1's


def test_keep_heap_warm_is_idempotent():
    assert keep_heap_warm() == keep_heap_warm()
