"""Keep glibc's heap warm for gRPC's megabyte buffers (process-wide, once, Linux/glibc only).

gRPC reads a stream into buffers of up to a few MiB, and every 1 MiB chunk becomes a bytes
object; glibc serves blocks that large with a fresh mmap (or returns the heap's top to the
kernel when they are freed), so each envelope's bytes land in pages the kernel must fault in
and zero again: for a 64 MiB envelope about 16,000 faults, as much of the receiver's CPU as
the data's own copies. With blocks up to `MMAP_THRESHOLD` served from the heap and up to
`TRIM_THRESHOLD` of free heap kept mapped, those buffers reuse the same warm pages round after
round. The cost is memory the process keeps rather than returns: at most `TRIM_THRESHOLD` of
free space at the top of each malloc arena.
"""

from __future__ import annotations

import ctypes
import sys

# blocks below this come from the heap (glibc's default: 128 KiB, raised by itself up to 32 MiB
# as blocks are freed); 32 MiB, glibc's most, covers every gRPC message (16 MiB at most)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20  # free heap kept before giving memory back (default: 128 KiB)
_M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_applied: bool | None = None


def keep_heap_warm() -> bool:
    """Set glibc's mmap and trim thresholds for this process (the first call does it); returns
    whether they are set (False where the C library is not glibc)."""
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc only; musl has no mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
