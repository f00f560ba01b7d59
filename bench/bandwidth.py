"""This machine's memory read bandwidth as decode sees it: a matrix-vector product over a
float32 matrix much larger than the caches (what every layer of a batch-1 decode step is),
and a plain reduction for comparison.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        .venv/bin/python -m bench.bandwidth [--mib 1024] [--repeats 20]

Prints GB/s (10^9 bytes per second) for each, as JSON. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx


def seconds(run: object, repeats: int) -> float:
    """Median wall time of `run()` (which evaluates its own result)."""
    assert callable(run)
    run()  # warm-up: page the memory in
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(mib: int, repeats: int) -> dict[str, float]:
    columns = 4096
    rows = mib * 2**20 // (4 * columns)
    matrix = mx.random.normal((rows, columns))
    vector = mx.random.normal((columns, 1))
    flat = matrix.reshape(-1)
    mx.eval(matrix, vector, flat)
    nbytes = matrix.nbytes
    matvec = seconds(lambda: mx.eval(matrix @ vector), repeats)
    reduce = seconds(lambda: mx.eval(flat.sum()), repeats)
    return {
        "matrix_mib": nbytes / 2**20,
        "matvec_gb_s": round(nbytes / matvec / 1e9, 2),
        "sum_gb_s": round(nbytes / reduce / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="matrix size")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(json.dumps(measure(args.mib, args.repeats), indent=2))


if __name__ == "__main__":
    main()
