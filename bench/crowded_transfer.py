"""What an all_sum costs between a step's products where ranks outnumber the cores: the
figures behind the step-time model's crowded hop (distributed/step_overhead.py `CpuKinds`)
and CROWDED_MS_PER_MB.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.crowded_transfer [--ranks 3]

Each rank runs steps of 20 products (a 1536 x 576 layer's rows) with an all_sum of the
rows after each, and the same steps without them, for activations of 8 to 1,440 rows of
576 float32 (0.02 to 3.32 MB); rank 0 prints each size's cost an all_sum, the steps' time
with less without, over 20. The ranks are started on 127.0.0.1 without mlx.launch
(bench/local_ranks.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

ROWS = (8, 128, 512, 1440)
HIDDEN, COLUMNS, PRODUCTS, REPEATS = 576, 1536, 20, 5


def rank_main() -> None:
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    weight = mx.full((COLUMNS, HIDDEN), 0.001)
    mx.eval(weight)

    def step_ms(rows: int, collectives: bool) -> float:
        times = []
        for _ in range(REPEATS):
            mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))  # start together
            started = time.perf_counter()
            x = mx.full((rows, HIDDEN), 0.5)
            for _ in range(PRODUCTS):
                x = (x @ weight.T)[:, :HIDDEN] * 0.5
                if collectives:
                    x = mx.distributed.all_sum(x, group=group)
            mx.eval(x)
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    for rows in ROWS:
        # twice each, the cheaper kept: another process only ever slows a step
        with_ = min(step_ms(rows, True) for _ in range(2))
        without = min(step_ms(rows, False) for _ in range(2))
        if group.rank() == 0:
            print(
                f"{group.size()} ranks, {rows * HIDDEN * 4 / 1e6:.2f} MB an all_sum: a step "
                f"{with_:.1f} ms, {without:.1f} without its {PRODUCTS} all_sums: "
                f"{(with_ - without) / PRODUCTS:.2f} ms each",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main()
        return
    from bench.local_ranks import run_local_ranks

    run_local_ranks(args.ranks, [sys.executable, "-m", "bench.crowded_transfer", "--rank"])


if __name__ == "__main__":
    main()
