"""The C heap under MLX on Linux (glibc): what it holds, and giving its free pages back.

MLX's CPU backend allocates its buffers with malloc, and the nodes of every compiled trace
too. glibc keeps what is freed in its heaps for reuse and returns only the top of a heap
to the system, so memory freed in the middle (a dropped trace's thousands of small nodes,
the KV of finished requests) stays in the process's resident memory. Measured: traces
compiled anew over many steps left the heaps holding much free but resident memory, and
malloc_trim gave nearly all of it back; under agent traffic rank 0's heaps kept more free
than its live arrays held (docs/RELIABILITY.md, "Agent soak: memory under agent
traffic"; docs/BENCHMARKS.md, "Figures behind the code"). `release_freed` calls
malloc_trim(0), which returns every free page of every heap to the system; elsewhere
(macOS's allocator returns freed pages by itself) it does nothing. `limit_buffer_cache`
bounds the buffers MLX itself keeps (distributed/overhead.py counts them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

import mlx.core as mx

log = logging.getLogger("ring.heap")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes the heaps took from the system (brk and their own mmaps)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in chunks malloc mapped on their own (large allocations)
            "usmblks",
            "fsmblks",
            "uordblks",  # bytes in use in the heaps
            "fordblks",  # bytes free in the heaps
            "keepcost",
        )
    ]


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC = _glibc()


@dataclass(frozen=True)
class HeapStats:
    """The C heap's bytes: in use, free but held, and mapped on their own."""

    used: int
    free: int
    mapped: int


def heap_stats() -> HeapStats | None:
    """glibc's figures for this process; None where the allocator is not glibc."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return HeapStats(used=info.uordblks, free=info.fordblks, mapped=info.hblkhd)


def release_freed() -> bool:
    """Give the heaps' free pages back to the system; whether any were."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


def limit_buffer_cache(limit: int) -> int:
    """Bound MLX's buffer cache (freed buffers kept for reuse) to `limit` bytes, or keep
    MLX's own limit where it is lower; the limit in force."""
    previous = mx.set_cache_limit(limit)
    if previous < limit:
        mx.set_cache_limit(previous)
        return previous
    return limit
