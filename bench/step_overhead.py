"""The step-time model's overhead on a CPU (distributed/step_overhead.py): what
a decode step costs beyond the weights the probe times.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.step_overhead \
        [--calibrate run/bench/r-l1.json]

1. The fixed part: the decode steps of the tests' tiny llama (hidden 64, a byte tokenizer)
   at 6 and 30 layers, one rank, 1 and 8 clients, in the server; their weights cost next
   to nothing, so the steps are the plan, the sampler, streaming and the graph; fitted as
   `step_ms + layers x layer_ms` (through the origin where the fit puts `step_ms` below 0).
2. With `--calibrate`, a one-rank bench/step_time.py report of a model with full-size
   layers: its measured steps at 1 and 8 clients less the probe's weights and the fixed
   part, per layer, fitted as `layers x (extra + rows x row_layer_ms)` (on this CPU the
   kernel's helper threads wake for every product between the layer's other work, and
   attention and the activations cost per row). That report's decode rows are then the
   calibration, not predictions. Several reports are fitted together.
3. With `--one-core`, the same for a rank with one core (`CPU_ONE_CORE_OVERHEAD`): run it,
   and the reports' bench.step_time, under `OPENBLAS_NUM_THREADS=1 taskset -c 0`; a row
   and layer keeps the two-core kind's cost, which a prefill's rows pay alike on one core
   and two, and the fit is of the extra a decode row and layer costs on one core.
4. With `--eager`, the tiny models' steps uncompiled (COMPILED_DECODE=off), for
   `CPU_EAGER_OVERHEAD` (and with `--one-core` its one-core kind): the reports then come
   from bench.step_time with `--env COMPILED_DECODE=off`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.step_model import model_of
from bench.step_time import run_batch
from distributed.machine_probe import this_cpu
from distributed.step_model import predict
from distributed.step_overhead import Overhead, cpu_overhead
from launcher.local_cluster import Cluster


def measure(layers: int, root: Path, eager: bool) -> dict[int, float]:
    from tests.support.tiny_models import write_tiny_model

    model = write_tiny_model(root / f"tiny-{layers}", num_hidden_layers=layers, never_stops=True)
    env = {"MAX_BATCH_SIZE": "8", "SPECULATIVE": "off", "KEEP_WARM_SECONDS": "0"}
    if eager:
        env["COMPILED_DECODE"] = "off"
    with Cluster(model, ranks=1, env=env) as cluster:
        run_batch(cluster, 1, 8)
        for batch in (1, 8):
            run_batch(cluster, batch, 48)
        measured = cluster.status().step_model.measured_decode_ms
    return {rows: measured[rows] for rows in (1, 8)}


def calibrate(
    reports: list[dict], step_ms: float, layer_ms: float, row_layer_ms: float = 0.0
) -> tuple[float, float]:
    """(extra ms a full-size layer, ms a decode row a layer beyond `row_layer_ms`) from
    one-rank reports."""
    rows, gaps = [], []
    for report in reports:
        model = model_of(report)
        status = report["model"]
        bare = Overhead(step_ms, layer_ms, row_layer_ms, "fixed part")
        machines = tuple(replace(m, overhead=bare) for m in model.speed.machines)
        speed = replace(model.speed, machines=machines)
        layers = model.work.ranks[0].layers
        for key, measured in status["measured_decode_ms"].items():
            context = status["decode_context"][key]
            predicted = predict(model.work, speed, int(key), 1, round(context)).ms
            rows.append(int(key))
            gaps.append((measured - predicted) / layers)
    a = np.array([[1.0, r] for r in rows])
    extra, per_row = np.linalg.lstsq(a, np.array(gaps), rcond=None)[0]
    return float(extra), float(per_row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 30])
    parser.add_argument(
        "--calibrate", type=Path, nargs="*", default=[], help="one-rank bench.step_time reports"
    )
    parser.add_argument("--one-core", action="store_true", help="a rank with one core")
    parser.add_argument("--eager", action="store_true", help="steps not compiled")
    parser.add_argument("--rounds", type=int, default=1, help="times to step the tiny models")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        steps = [
            {layers: measure(layers, Path(tmp) / str(n), args.eager) for layers in args.layers}
            for n in range(args.rounds)
        ]
    # the fixed part: ms = step + layers x layer, over both depths, both batch sizes, rounds
    points = [(layers, ms) for run in steps for layers, by in run.items() for ms in by.values()]
    a = np.array([[1.0, layers] for layers, _ in points])
    times = np.array([ms for _, ms in points])
    step, layer = np.linalg.lstsq(a, times, rcond=None)[0]
    if step < 0:  # a fixed part within noise of none: through the origin
        step, layer = 0.0, float(a[:, 1] @ times / (a[:, 1] @ a[:, 1]))
    out = {"tiny_models_ms": steps, "step_ms": round(step, 3), "layer_ms": round(layer, 4)}
    if args.calibrate:
        reports = [json.loads(path.read_text()) for path in args.calibrate]
        kept = cpu_overhead(False, args.eager, this_cpu()).row_layer_ms if args.one_core else 0.0
        extra, per_row = calibrate(reports, step, layer, kept)
        out["full_layer_extra_ms"] = round(extra, 4)
        out["decode_row_layer_ms" if args.one_core else "row_layer_ms"] = round(per_row, 5)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
