"""A pipeline's step that decodes running answers and prefills a prompt's chunk, with rank 0
taking the answers' logits back from the last stage before its own layers of the chunk (the
engine's order until 2026-11-29) or after them (distributed/pipeline.py `results_later`,
where the later stages end the decode meanwhile): each way's step time, and a decode-only
step's.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.pipeline_overlap [--ranks 2]
        [--rows 4] [--chunk 64] [--context 1000] [--steps 30] [--model DIR]

The default model (or `--model`) split as a pipeline over ranks on 127.0.0.1
(bench/local_ranks.py, one OpenBLAS thread each), each running the batch engine eagerly
over its stage, as server.py does; every rank builds the same plans: `rows` answers of 64
prompt tokens, then a prompt whose first `context` tokens prefill beside them, then steps
of the three kinds in turn (decode only; decode and a `chunk`-token chunk, results back
first; the same, results back later). Rank 0 prints each kind's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from bench.compiled_decode import DEFAULT_MODEL

KINDS = ("decode only", "decode + chunk, results back first", "decode + chunk, results later")


def rank_main(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from distributed.pipeline import PipelineStage
    from distributed.plan import make_plan
    from distributed.splitting import split_model
    from engine import cpu_kernels
    from engine.batch_engine import BatchEngine
    from engine.step_plan import Insert, StepPlan

    group = mx.distributed.init(strict=True, backend="ring")
    model, _ = load_model(args.model)
    model.eval()
    cpu_kernels.install()
    config = json.loads((args.model / "config.json").read_text())
    stage = split_model(model, make_plan(config, group.size(), None, "pipeline"), group)
    assert isinstance(stage, PipelineStage)
    mx.eval(stage.parameters())
    engine = BatchEngine(stage, 2048)
    linked = engine._order

    def step(kind: int, **fields: object) -> float:
        later = kind == 2
        engine._results_later = stage.results_later if later else nullcontext
        linked.linked = not later
        plan = StepPlan(engine.step_index, engine.fingerprint(), **fields)  # type: ignore[arg-type]
        engine.apply(plan)
        started = time.perf_counter()
        engine.run()
        return (time.perf_counter() - started) * 1e3

    answers = [Insert(1 + r, [100 + 7 * r + i for i in range(64)]) for r in range(args.rows)]
    step(0, inserts=answers)
    tokens = [200 + r for r in range(args.rows)]
    prompt = [300 + i % 1000 for i in range(args.context + (2 * args.steps + 1) * args.chunk)]
    step(0, tokens=tokens, inserts=[Insert(99, prompt)], prefill=args.context)
    times: list[list[float]] = [[], [], []]
    for index in range(3 * args.steps):
        kind = index % 3
        times[kind].append(step(kind, tokens=tokens, prefill=args.chunk if kind else 0))
    if group.rank() == 0:
        for kind, ms in zip(KINDS, times, strict=True):
            print(f"{kind}: {statistics.median(ms):.1f} ms (median of {len(ms)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    from bench.local_ranks import run_local_ranks

    run_local_ranks(
        args.ranks, [sys.executable, "-m", "bench.pipeline_overlap", *sys.argv[1:], "--rank"]
    )


if __name__ == "__main__":
    main()
