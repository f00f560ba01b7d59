"""How ranks that share a host's cores time work at start (distributed/machine_probe.py):
all at once, as a tensor split's ranks and a pipeline's streamed prefill run, or each
alone while the others wait, as a pipeline's decode stages run. `Turns` is what the probe
needs of them; `GroupTurns` gives it over a group's ranks, an all_sum as the barrier.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

# Ranks sharing a host's cores run a prefill's products and attention at once, so they
# time them at once: the same runs on every rank from one barrier to the next, at least
# this long, less a barrier's own time; the least of AT_ONCE_TIMINGS (other work on the
# cores only lengthens one). Each rank timing its own median at once read 49-108 GFLOP/s
# for the products at 3 ranks on the Xeon host's 2 cores (their least 49-54 in one start,
# 30-58 over six starts of the bench's pipeline, whose prefill it predicted -5% to -43%);
# from barrier to barrier, 55-67, every rank alike.
AT_ONCE_MS = 250.0
AT_ONCE_TIMINGS = 3


class Turns(Protocol):
    """Ranks sharing a host's cores: `together` waits for all of them; `each_alone` runs
    its argument on each rank in turn while the others wait; `agree` gives every rank the
    largest of their counts."""

    def together(self) -> None: ...

    def each_alone(self, run: Any) -> Any: ...

    def agree(self, count: int) -> int: ...


class GroupTurns:
    """Turns over a group's ranks."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group

    def together(self) -> None:
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=self.group))

    def agree(self, count: int) -> int:
        counts = mx.distributed.all_gather(mx.array([count], dtype=mx.int32), group=self.group)
        return int(np.array(counts).max())

    def each_alone(self, run: Any) -> Any:
        mine = None
        for turn in range(self.group.size()):
            self.together()
            if turn == self.group.rank():
                mine = run()
        self.together()
        return mine


def at_once_ms(turns: Turns, run: Callable[[], None]) -> float:
    """Ms of one `run` while every rank sharing the host runs it (AT_ONCE_MS): each rank
    the same count of runs, so a timing lasts as long as the slowest rank's and every rank
    reads the same figure."""
    run()
    started = time.perf_counter()
    run()
    first = (time.perf_counter() - started) * 1e3
    count = turns.agree(max(1, math.ceil(AT_ONCE_MS / max(first, 1e-3))))

    def timing(runs: int) -> float:
        turns.together()
        started = time.perf_counter()
        for _ in range(runs):
            run()
        turns.together()
        return time.perf_counter() - started

    barrier = min(timing(0) for _ in range(AT_ONCE_TIMINGS))
    took = min(timing(count) for _ in range(AT_ONCE_TIMINGS))
    return max(took - barrier, took / 2) * 1e3 / count
