"""A rank's memory while it works, one DEBUG line a minute: resident memory split into what
MLX's arrays hold (the running batch's KV, the prefix cache's entries, the weights and the
rest), MLX's buffer cache, the C heap's free but resident bytes (engine/heap.py), and the
compiled decode's traces. The agent soak (tests/test_agent_soak.py) reads these lines to
say where memory beyond weights, KV and the prefix cache goes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.compiled_decode import CompiledDecode
from engine.heap import heap_stats

log = logging.getLogger("ring.memory")
INTERVAL_S = 60.0
MIB = 2**20


def resident_bytes() -> int | None:
    """This process's resident memory (Linux: /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def cache_bytes(caches: Iterable[list]) -> int:
    """The bytes of every array the caches of the running batch hold (each a layer list)."""
    total = 0
    for cache in caches:
        states: list[tuple[str, object]] = tree_flatten([layer.state for layer in cache])  # type: ignore[assignment]
        total += sum(array.nbytes for _, array in states if isinstance(array, mx.array))
    return total


@dataclass(frozen=True)
class MemoryFigures:
    rss: int | None
    arrays: int  # every MLX array alive (weights, KV, prefix entries, the step's)
    batch_kv: int  # the running batch's caches (decoding and prefilling)
    prefix: int  # the prefix cache's entries on this rank
    mlx_cache: int  # freed buffers MLX keeps for reuse
    heap_free: int | None  # freed by malloc, still resident (glibc)
    traces: int  # compiled decode traces kept
    dropped: int  # and dropped so far

    def line(self) -> str:
        rss = "?" if self.rss is None else f"{self.rss / MIB:.0f}"
        free = "?" if self.heap_free is None else f"{self.heap_free / MIB:.0f}"
        return (
            f"memory: RSS {rss} MiB; MLX arrays {self.arrays / MIB:.0f} MiB (batch KV "
            f"{self.batch_kv / MIB:.0f}, prefix cache {self.prefix / MIB:.0f}), MLX buffer "
            f"cache {self.mlx_cache / MIB:.0f} MiB, C heap free {free} MiB; {self.traces} "
            f"decode traces kept, {self.dropped} dropped"
        )


class MemoryReport:
    """Logs the figures at most once every `interval_s` of work (DEBUG only)."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.last = time.monotonic()

    def due(self) -> bool:
        if not log.isEnabledFor(logging.DEBUG):
            return False
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True

    @staticmethod
    def figures(
        caches: Iterable[list], prefix: int, compiled: CompiledDecode | None
    ) -> MemoryFigures:
        heap = heap_stats()
        return MemoryFigures(
            rss=resident_bytes(),
            arrays=mx.get_active_memory(),
            batch_kv=cache_bytes(caches),
            prefix=prefix,
            mlx_cache=mx.get_cache_memory(),
            heap_free=None if heap is None else heap.free,
            traces=len(compiled.shapes) if compiled is not None else 0,
            dropped=compiled.dropped if compiled is not None else 0,
        )

    def log(self, caches: Iterable[list], prefix: int, compiled: CompiledDecode | None) -> None:
        """`caches`: the running batch's (each a list of layers); `prefix`: the prefix
        cache's bytes on this rank."""
        log.debug("%s", self.figures(caches, prefix, compiled).line())
