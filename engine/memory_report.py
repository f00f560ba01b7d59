"""A rank's memory while it works: every UPKEEP_S of work, the C heap's free pages go back
to the system (engine/heap.py), and once a minute a DEBUG line splits the resident memory
into what MLX's arrays hold (the running batch's KV, the prefix cache's entries, the
weights and the rest), MLX's buffer cache, the C heap's free but resident bytes and the
compiled decode's traces.

Why the upkeep: MLX's CPU backend allocates its buffers with malloc, and a decode step's
KV buffers grow by 64 positions at a time, so every size is new and the freed ones leave
holes glibc keeps resident. In an agent soak rank 0's heap held more free memory than its
live arrays took within minutes: the growth beyond weights, KV and the prefix cache that
issue 37 measured (docs/RELIABILITY.md, "Agent soak: memory under agent traffic";
docs/BENCHMARKS.md, "Figures behind the code"). The agent soak (tests/test_agent_soak.py)
prints the ranks' last lines.
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
from engine.heap import heap_stats, release_freed

log = logging.getLogger("ring.memory")
UPKEEP_S = 10.0  # of work between giving the heap's free pages back
LOG_S = 60.0  # between DEBUG lines
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

    def trimmed(self, after: int | None, seconds: float) -> str:
        """The line of an upkeep that gave free pages back."""
        gave = "?" if self.rss is None or after is None else f"{(self.rss - after) / MIB:.0f}"
        return f"{self.line()}; gave back {gave} MiB in {seconds * 1000:.1f} ms"


class MemoryReport:
    """The upkeep, due every `upkeep_s` of work; a DEBUG line every `log_s`."""

    def __init__(self, upkeep_s: float = UPKEEP_S, log_s: float = LOG_S) -> None:
        self.upkeep_s, self.log_s = upkeep_s, log_s
        self.last = self.logged = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.upkeep_s

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

    def upkeep(self, caches: Iterable[list], prefix: int, compiled: CompiledDecode | None) -> None:
        """Give the heap's free pages back; the DEBUG line when one is due. `caches`: the
        running batch's (each a list of layers); `prefix`: the prefix cache's bytes on
        this rank."""
        now = time.monotonic()
        self.last = now
        line = log.isEnabledFor(logging.DEBUG) and now - self.logged >= self.log_s
        figures = self.figures(caches, prefix, compiled) if line else None
        started = time.perf_counter()
        release_freed()
        if figures is not None:
            self.logged = now
            seconds = time.perf_counter() - started
            log.debug("%s", figures.trimmed(resident_bytes(), seconds))
