"""What the compiled decode's traces hold, in one process: issue 30's growth, found.

    .venv/bin/python -m bench.trace_memory [--max-traces 128] [--steps 1200]

The batch engine over the default model (one rank, as server.py sets it up on MLX's CPU
backend), 2 rows of 40-token prompts, decode steps of widths 1 to 5 in turn (each
speculative step rolled back at the next), so every 64 positions and every width is a
new trace. Every 200 steps: resident memory, MLX's arrays and buffer cache, glibc's heap
(bytes in use, and free but held) and the traces kept. At the end the same after
malloc_trim, after dropping every trace, and after malloc_trim again: what the traces
held, and what glibc kept of it once they were gone.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import mlx.core as mx

from bench.compiled_decode import DEFAULT_MODEL
from bench.engine_steps import first_plan, next_plan, served_model
from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode
from engine.heap import heap_stats, release_freed
from ipc.processes import rss_bytes

MIB = 2**20


def report(label: str, compiled: CompiledDecode, engine: BatchEngine) -> None:
    heap = heap_stats()
    held = "" if heap is None else f", heap in use {heap.used // MIB}, free {heap.free // MIB}"
    print(
        f"{label}: RSS {(rss_bytes(os.getpid()) or 0) // MIB} MiB, MLX arrays "
        f"{mx.get_active_memory() // MIB}, MLX cache {mx.get_cache_memory() // MIB}{held}; "
        f"{len(compiled.shapes)} traces kept, {compiled.dropped} dropped; context "
        f"{engine.decode_lengths[0] if engine.decode_lengths else 0}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-traces", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1200)
    args = parser.parse_args(argv)
    model = served_model(args.model)
    compiled = CompiledDecode(model, max_traces=args.max_traces)
    engine = BatchEngine(model, 256, compiled=compiled)
    plan = first_plan(engine, model.args.vocab_size, rows=2, tokens=40)
    report("start", compiled, engine)
    for step in range(args.steps + 1):
        engine.apply(plan)
        result = engine.run()
        plan = next_plan(engine, result, width=1 + step % 5)
        if step % 200 == 0:
            report(f"step {step}", compiled, engine)
    release_freed()
    report("after malloc_trim", compiled, engine)
    compiled._traces.clear()
    gc.collect()
    report("every trace dropped", compiled, engine)
    release_freed()
    report("after malloc_trim", compiled, engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
