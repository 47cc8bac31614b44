"""Receive buffers reused from envelope to envelope once nothing refers to them any more.

A fresh buffer for every large envelope costs the kernel as much as copying the data into it:
glibc maps blocks of that size afresh each time, so every page is faulted and zeroed again (a
64 MiB envelope: 5 to 8 ms of the receiving peer's CPU, up to a fifth of its share). A
buffer can be reused only when its owner is known to be done with it, and the buffer protocol
gives that for free: every view of the memory (memoryview, numpy array, torch tensor) keeps a
reference, direct or chained, to the array that exported it. So a pooled array whose only
references are the pool's own is provably unused, and only then is it handed out again.
"""

from __future__ import annotations

import sys

import numpy

MIN_POOLED_BYTES = 1 << 20  # smaller buffers come from malloc's warm heap anyway


def _references(arrays: list[numpy.ndarray], index: int) -> int:
    """References to arrays[index] as seen from here (the same count for every call)."""
    return sys.getrefcount(arrays[index])


def _idle_references() -> int:
    """The count `_references` reports for an array nothing but the pool's list refers to
    (calibrated, not assumed: interpreters differ in the temporaries they count)."""
    return _references([numpy.empty(0, dtype=numpy.uint8)], 0)


_IDLE = _idle_references()


class BufferPool:
    """Byte buffers for envelopes of >= 1 MiB, reused once nothing else refers to them.

    Holds at most `max_bytes` of buffers in all (in use or idle); beyond that, idle ones are
    dropped to make room, and if the rest are in use a new buffer is simply not pooled. Used
    from one thread (the server's event loop); other threads may only drop references, which
    can make a buffer idle but never busy again behind the pool's back.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes: expected >= 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._arrays: list[numpy.ndarray] = []

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of `nbytes` (contents undefined: the caller writes every byte)."""
        if nbytes < MIN_POOLED_BYTES or nbytes > self._max_bytes:
            return memoryview(numpy.empty(nbytes, dtype=numpy.uint8))
        for index in range(len(self._arrays)):  # no loop name for an array: it would count
            if self._arrays[index].nbytes == nbytes and _references(self._arrays, index) == _IDLE:
                return memoryview(self._arrays[index])
        array = numpy.empty(nbytes, dtype=numpy.uint8)
        self._make_room(nbytes)
        if self.pooled_bytes + nbytes <= self._max_bytes:
            self._arrays.append(array)
        return memoryview(array)

    @property
    def pooled_bytes(self) -> int:
        return sum(array.nbytes for array in self._arrays)

    def _make_room(self, nbytes: int) -> None:
        """Drop idle buffers until `nbytes` more fit (buffers in use stay)."""
        index = 0
        while index < len(self._arrays) and self.pooled_bytes + nbytes > self._max_bytes:
            if _references(self._arrays, index) == _IDLE:
                del self._arrays[index]
            else:
                index += 1
