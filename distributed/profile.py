"""Opt-in timing of the all_sums inside the forward pass (RING_PROFILE_COLLECTIVES=1).

Wraps `mx.distributed.all_sum` so each call first evaluates its input (the compute
before it) and then times the collective itself. This adds sync points, so it is for
measuring only; the plan broadcast keeps its own unwrapped all_sum.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx


class CollectiveProfiler:
    """Accumulated time and count of the wrapped all_sums."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0

    def install(self) -> CollectiveProfiler:
        original = mx.distributed.all_sum

        def timed_all_sum(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            mx.eval(x)
            started = time.perf_counter()
            result = original(x, *args, **kwargs)
            mx.eval(result)
            self.seconds += time.perf_counter() - started
            self.count += 1
            return result

        mx.distributed.all_sum = timed_all_sum
        return self
