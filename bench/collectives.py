"""Time ring all_sums the size of one decode step's activations (run under mlx.launch).

    .venv/bin/mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -p PORT \
        --python .venv/bin/python -- bench/collectives.py --hidden 576 --batch 1 8

Prints, on rank 0, the median time of one all_sum of [batch, 1, hidden] float32 and of
the 4 KiB step-plan buffer. A tensor-parallel decode step does two such all_sums per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def median_ms(array: mx.array, group: mx.distributed.Group, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(mx.distributed.all_sum(array, group=group))
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    group = mx.distributed.init(strict=True, backend="ring")
    rows = {"plan buffer 4096 B": mx.zeros((4096,), dtype=mx.uint8)}
    for batch in args.batch:
        rows[f"activations [{batch},1,{args.hidden}] f32"] = mx.zeros((batch, 1, args.hidden))
    for name, array in rows.items():
        median_ms(array, group, 20)
        value = median_ms(array, group, args.repeats)
        if group.rank() == 0:
            print(f"{name}: {value:.3f} ms per all_sum", flush=True)


if __name__ == "__main__":
    main()
