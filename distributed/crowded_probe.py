"""What ranks that outnumber their host's cores wait for the scheduler, read back from
collectives timed at start (distributed/step_probe.py `crowded_waits`): each hop's wait
and each MB's beyond the loopback's figure, and a pipeline step's hops timed as a pipeline
meets them (`pipeline_hop_ms`).

A pipeline's stages work in turn: while one computes, the others wait in a receive, and
MLX's ring polls its sockets while it waits, so every waiting rank keeps a core busy. The
chain that times a tensor split's hops (every rank working between all_sums) read 10-14 ms
a hop through the bench's relay at 150 us (3 ranks, the Xeon host's 2 cores), which priced
the 3-rank pipeline's 8-client step 36% slow; the CPU's fitted 1.9 ms left its 1-client
step 22-37% fast. So a pipeline's hops are timed as its steps run: the step plan's
all_sum, then a row's hidden state passed around the ring with each stage's work on it in
turn (its share of the layers, at most MAX_STAGE_LAYERS), less that work as each rank
timed it. Through the relay that read 6.1-8.6 ms a hop, and the steps came within 12% at 1
and 8 clients in two runs each, over the loopback too (2.0-2.9 ms); later starts read
10.1-12.1 ms, and their 1-client steps +20% to +29%; the least of three timings, where
the median was taken, read 5.7 and 9.5 ms (+0%, +10%; docs/BENCHMARKS.md). The stage's work
matters: with 2 layers' products a stage the same probe read 10.3-11.8 ms and priced the
8-client step up to 31% slow. It takes about 2 s at start over the loopback (3 ranks), on
crowded hosts only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from distributed.chips import link_named
from distributed.step_model import CROWDED_MS_PER_MB
from distributed.step_work import PLAN_BUFFER_BYTES

PIPELINE_STEPS = 6  # one timing: this many steps of the pattern back to back
PIPELINE_TIMINGS = 3  # the least of this many: other work on the cores only adds to one
MAX_STAGE_LAYERS = 8  # a stage's work on the row: its layers' products, at most this many


def layer_products(hidden: int, params: int, dtype: mx.Dtype) -> Callable[[mx.array], mx.array]:
    """The work the crowded probes put between their collectives: two products of about
    `params` weights in all on a row's hidden state, through a tanh."""
    width = max(1, params // 2 // hidden)
    weight = mx.full((hidden, width), 1.0 / hidden, dtype=dtype)
    back = mx.full((width, hidden), 1.0 / width, dtype=dtype)
    mx.eval(weight, back)
    return lambda h: mx.tanh(h @ weight) @ back


def pipeline_hop_ms(
    group: mx.distributed.Group, hidden: int, layer_params: int, layers: int, dtype: mx.Dtype
) -> float:
    """Each hop's wait in a pipeline's decode step among this group's ranks: the step's
    time beyond every stage's work and the loopback's figures, over the hops the model
    counts (the plan's all_sum and one hand-over a stage)."""
    rank, ranks = group.rank(), group.size()
    if ranks == 1:
        return 0.0
    layer = layer_products(hidden, layer_params, dtype)
    row = mx.full((1, hidden), 0.5, dtype=dtype)
    plan = mx.zeros((PLAN_BUFFER_BYTES,), dtype=mx.uint8)
    mx.eval(row, plan)

    def step() -> float:
        """One step of the pattern; this rank's work in it, in seconds."""
        mx.eval(mx.distributed.all_sum(plan, group=group))
        h = row if rank == 0 else mx.distributed.recv_like(row, rank - 1, group=group)
        mx.eval(h)
        started = time.perf_counter()
        for _ in range(min(MAX_STAGE_LAYERS, max(1, layers // ranks))):
            h = layer(h)
        mx.eval(h)
        worked = time.perf_counter() - started
        mx.eval(mx.distributed.send(h, (rank + 1) % ranks, group=group))
        if rank == 0:
            mx.eval(mx.distributed.recv_like(row, ranks - 1, group=group))
        return worked

    def timing() -> float:
        started, worked = time.perf_counter(), 0.0
        for _ in range(PIPELINE_STEPS):
            worked += step()
        took = time.perf_counter() - started
        every = mx.distributed.all_sum(mx.array([worked], dtype=mx.float32), group=group)
        return (took - float(np.array(every)[0])) * 1e3 / PIPELINE_STEPS

    step()  # the first pass pays the kernels' and the sockets' first use
    beyond = min(timing() for _ in range(PIPELINE_TIMINGS))
    return pipeline_wait_ms(beyond, row.nbytes, ranks)


def pipeline_wait_ms(beyond_work_ms: float, row_bytes: int, ranks: int) -> float:
    """A crowded pipeline step's ms beyond its stages' work, less the loopback's figures
    for its plan's all_sum and hand-overs, over their hops: each hop's wait."""
    local = link_named("ring-local")
    hops = local.traffic("all_sum", PLAN_BUFFER_BYTES, ranks)[0] + ranks
    loopback = local.all_sum_ms(PLAN_BUFFER_BYTES, ranks) + ranks * local.ms(
        "send", row_bytes, ranks
    )
    return max(0.0, beyond_work_ms - loopback) / hops


def hop_wait_ms(collective_ms: float, nbytes: int, ranks: int) -> float:
    """A crowded all_sum's ms less what the model gives it apart from the hops' waits (the
    loopback's figure, its bytes' turns), over its hops: each hop's wait."""
    beyond, hops, moved = _over_loopback(collective_ms, nbytes, ranks)
    return max(0.0, beyond - CROWDED_MS_PER_MB * moved / 1e6) / max(1, hops)


def ms_per_mb_beyond(collective_ms: float, nbytes: int, ranks: int, hop_ms: float) -> float:
    """A crowded all_sum's ms less the loopback's figure and its hops' waits, a MB moved."""
    beyond, hops, moved = _over_loopback(collective_ms, nbytes, ranks)
    return max(0.0, beyond - hops * hop_ms) / (moved / 1e6) if moved else 0.0


def _over_loopback(collective_ms: float, nbytes: int, ranks: int) -> tuple[float, int, float]:
    """An all_sum's ms beyond the loopback's figure for it, its hops and the bytes it moves."""
    local = link_named("ring-local")
    hops, moved = local.traffic("all_sum", nbytes, ranks)
    return collective_ms - local.all_sum_ms(nbytes, ranks), hops, moved
