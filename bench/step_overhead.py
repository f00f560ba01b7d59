"""The step-time model's overhead on this machine: the decode steps of tiny models whose
weights cost next to nothing, at two depths, in the server (distributed/step_model.py
`CPU_OVERHEAD`).

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.step_overhead [--layers 6 30]

Writes the tests' tiny llama (hidden 64, a byte tokenizer) with each depth, starts one rank
on each, decodes 1 and 8 clients (bench/step_time.py's requests) and fits
`step_ms + layers x (layer_ms + rows x row_layer_ms)` to the median steps.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from bench.step_time import run_batch
from launcher.local_cluster import Cluster


def measure(layers: int, root: Path) -> dict[int, float]:
    from tests.support.tiny_models import write_tiny_model

    model = write_tiny_model(root / f"tiny-{layers}", num_hidden_layers=layers, never_stops=True)
    env = {"MAX_BATCH_SIZE": "8", "SPECULATIVE": "off", "KEEP_WARM_SECONDS": "0"}
    with Cluster(model, ranks=1, env=env) as cluster:
        run_batch(cluster, 1, 8)
        for batch in (1, 8):
            run_batch(cluster, batch, 48)
        measured = cluster.status().step_model.measured_decode_ms
    return {rows: measured[rows] for rows in (1, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 30])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        steps = {layers: measure(layers, Path(tmp)) for layers in args.layers}
    # ms = step + layers * layer + layers * rows * row_layer, least squares
    rows_of = [(layers, rows, ms) for layers, by in steps.items() for rows, ms in by.items()]
    a = np.array([[1.0, layers, layers * rows] for layers, rows, _ in rows_of])
    b = np.array([ms for *_, ms in rows_of])
    step, layer, row_layer = np.linalg.lstsq(a, b, rcond=None)[0]
    print(
        json.dumps(
            {
                "measured_ms": steps,
                "step_ms": round(step, 3),
                "layer_ms": round(layer, 4),
                "row_layer_ms": round(row_layer, 5),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
