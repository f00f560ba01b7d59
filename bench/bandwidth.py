"""This machine's memory read bandwidth, the limit of a batch-1 decode step, measured three ways:

- `matvec`: one float32 matrix much larger than the caches times a vector (MLX);
- `layers`: many matrices of one decoder layer's shape (576 x 1536, SmolLM2's MLP) times a
  vector, in one graph (MLX): what a decode step reads, layer after layer;
- `parallel_sum`: one process per core, each summing its own array much larger than the
  caches, all at once (numpy): the read rate of every core together.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        .venv/bin/python -m bench.bandwidth [--mib 1024] [--repeats 20]

Prints GB/s (10^9 bytes per second) for each and `limit_gb_s`, the highest: the read rate
this machine reached, against which docs/BENCHMARKS.md sets decode. Run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

LAYER_SHAPE = (1536, 576)


def seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of `run()` (which evaluates its own result)."""
    run()  # warm-up: page the memory in
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matvec_gb_s(mib: int, repeats: int) -> float:
    columns = 4096
    matrix = mx.random.normal((mib * 2**20 // (4 * columns), columns))
    vector = mx.random.normal((columns, 1))
    mx.eval(matrix, vector)
    return matrix.nbytes / seconds(lambda: mx.eval(matrix @ vector), repeats) / 1e9


def layers_gb_s(mib: int, repeats: int) -> float:
    rows, columns = LAYER_SHAPE
    count = mib * 2**20 // (4 * rows * columns)
    matrices = [mx.random.normal(LAYER_SHAPE) for _ in range(count)]
    vector = mx.random.normal((columns, 1))
    mx.eval(matrices, vector)

    def run() -> None:
        mx.eval([matrix @ vector for matrix in matrices])

    return sum(m.nbytes for m in matrices) / seconds(run, repeats) / 1e9


def _sum_worker(nbytes: int, repeats: int, barrier: object, out: object) -> None:
    array = np.ones(nbytes // 4, dtype=np.float32)
    array.sum()  # page in
    times = []
    for _ in range(repeats):
        barrier.wait()  # type: ignore[attr-defined]
        started = time.perf_counter()
        array.sum()
        times.append(time.perf_counter() - started)
    out.put(statistics.median(times))  # type: ignore[attr-defined]


def parallel_sum_gb_s(mib: int, repeats: int) -> float:
    workers = os.cpu_count() or 1
    nbytes = mib * 2**20 // workers
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(workers), context.Queue()
    processes = [
        context.Process(target=_sum_worker, args=(nbytes, repeats, barrier, out))
        for _ in range(workers)
    ]
    for process in processes:
        process.start()
    medians = [out.get() for _ in processes]
    for process in processes:
        process.join()
    return workers * nbytes / max(medians) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes read per measurement")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    figures = {
        "mib": args.mib,
        "matvec_gb_s": round(matvec_gb_s(args.mib, args.repeats), 2),
        "layers_gb_s": round(layers_gb_s(args.mib, args.repeats), 2),
        "parallel_sum_gb_s": round(parallel_sum_gb_s(args.mib, args.repeats), 2),
    }
    figures["limit_gb_s"] = max(v for k, v in figures.items() if k.endswith("_gb_s"))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
