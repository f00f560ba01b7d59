"""What an evaluation in the middle of a forward costs where an all_sum comes just before
it, as an expert split's routing does at every MoE layer (distributed/expert_parallel.py).
Measured here at 0.04 ms or less, so the step-time model has no term for it.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.routing_sync [--ranks 2]

Every rank runs steps of LAYERS segments, each a layer's worth of products (about 4 MB of
weights, hidden 512) and an all_sum of its output: once queued whole and evaluated at the
end, and once evaluated after every all_sum with the result read on the host (as the
routing is), at 1 and 8 rows, with the all_sums real and made the identity. Rank 0 prints
each step's median and the cost of one such evaluation: (synced - queued) / LAYERS.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

LAYERS = 8
HIDDEN, WIDTH = 512, 2048
STEPS = 80  # a case's steps (--steps)


def rank_main(steps: int) -> None:
    import mlx.core as mx
    import numpy as np

    group = mx.distributed.init(strict=True, backend="ring")
    weights = [mx.random.normal((HIDDEN, WIDTH)) * 0.01 for _ in range(LAYERS)]
    back = [mx.random.normal((WIDTH, HIDDEN)) * 0.01 for _ in range(LAYERS)]
    mx.eval(weights, back)

    def step(x: mx.array, synced: bool, collective: bool) -> mx.array:
        for up, down in zip(weights, back, strict=True):
            y = (x @ up) @ down
            x = mx.distributed.all_sum(y, group=group) if collective else y
            if synced:
                mx.eval(x)
                np.array(x[:, :4])  # the host reads it, as the routing's indices are read
        mx.eval(x)
        return x

    def median_ms(rows: int, synced: bool, collective: bool) -> float:
        x = mx.ones((rows, HIDDEN))
        times = []
        for _ in range(steps):
            mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))  # start together
            started = time.perf_counter()
            step(x, synced, collective)
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times[steps // 4 :])

    cases = [(rows, collective) for rows in (1, 8) for collective in (True, False)]
    for rows, collective in cases:  # warm the kernels
        median_ms(rows, True, collective), median_ms(rows, False, collective)
    for rows, collective in cases:
        queued, synced = median_ms(rows, False, collective), median_ms(rows, True, collective)
        if group.rank() == 0:
            kind = "all_sums" if collective else "no all_sums"
            print(
                f"{group.size()} ranks, {rows} row(s), {kind}: a step {queued:.2f} ms queued, "
                f"{synced:.2f} evaluated at each of {LAYERS}: "
                f"{(synced - queued) / LAYERS:.3f} ms an evaluation",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.steps)
        return
    from bench.local_ranks import run_local_ranks

    command = [sys.executable, "-m", "bench.routing_sync", "--rank", "--steps", str(args.steps)]
    run_local_ranks(args.ranks, command)


if __name__ == "__main__":
    main()
