"""The batch engine's steps in one process, as rank 0 runs them: B prompts of P tokens
prefilled together, then N decode steps; prints the prefill and the median decode step.

    LD_PRELOAD=<OpenBLAS> [OPENBLAS_CORETYPE=Prescott] .venv/bin/python -m bench.engine_steps \
        --batch 8 --prompt 70 --steps 64 [--layout plain|transposed] [--eager] [--draft N]

The model is set up as server.py does on MLX's CPU backend (the attention kernel, the
head stored transposed and on the last position); `--layout transposed` stores the layers
[in, out] too, as LINEAR_LAYOUT=transposed does. For comparing OpenBLAS's kernels
(OPENBLAS_CORETYPE) and layouts without a server around them; bench.step_time measures the
server's steps. `--draft N` gives every row N proposed tokens a step (a speculative
step's forward, leader/speculation.py) and rolls them all back at the next: the cost of
verifying N proposals, whatever is accepted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import get_args

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model

from bench.compiled_decode import DEFAULT_MODEL
from config.settings import LinearLayout
from engine import cpu_kernels
from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode
from engine.cpu_linear import transpose_linears
from engine.last_logits import head_on_last_position
from engine.step_plan import Insert, StepPlan, StepResult


def served_model(path: Path, layout: LinearLayout = "plain") -> nn.Module:
    """The model at `path` set up as server.py sets it up on MLX's CPU backend."""
    model, _ = load_model(path)
    model.eval()
    cpu_kernels.install()
    transpose_linears(model, layout)
    head_on_last_position(model)
    return model


def first_plan(engine: BatchEngine, vocab: int, rows: int, tokens: int) -> StepPlan:
    """A step that inserts `rows` distinct prompts of `tokens` tokens each."""
    prompts = [[(7 * row + i) % (vocab - 100) + 100 for i in range(tokens)] for row in range(rows)]
    inserts = [Insert(i + 1, prompt) for i, prompt in enumerate(prompts)]
    return StepPlan(0, engine.fingerprint(), inserts=inserts)


def next_plan(engine: BatchEngine, result: StepResult, width: int, kept: int = 0) -> StepPlan:
    """The next decode step: each row's greedy token, with `width - 1` copies of it proposed
    (a speculative step's forward, whatever is accepted), the last step's proposals rolled
    back but the first `kept` of each row's."""
    assert result.logits is not None
    chosen = mx.argmax(result.logits, axis=-1).tolist()
    firsts = [sum(result.widths[:i]) for i in range(len(result.widths))]
    tokens = {seq_id: chosen[at] for seq_id, at in zip(result.seq_ids, firsts, strict=True)}
    following = [tokens[seq_id] for seq_id in engine.decode_ids]
    rollbacks = [max(0, w - 1 - kept) for w in result.widths]
    drafts = [[t] * (width - 1) for t in following] if width > 1 else []
    return StepPlan(
        engine.step_index,
        engine.fingerprint(),
        tokens=following,
        drafts=drafts,
        rollbacks=rollbacks if any(rollbacks) else [],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=70, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=64, help="decode steps")
    parser.add_argument("--layout", choices=get_args(LinearLayout), default="plain")
    parser.add_argument("--eager", action="store_true", help="no compiled decode")
    parser.add_argument("--draft", type=int, default=0, help="proposed tokens a row a step")
    args = parser.parse_args()
    model = served_model(args.model, args.layout)
    engine = BatchEngine(
        model, max(256, args.prompt), compiled=None if args.eager else CompiledDecode(model)
    )
    plan = first_plan(engine, model.args.vocab_size, args.batch, args.prompt)
    times = []
    for _ in range(args.steps + 1):
        engine.apply(plan)
        started = time.perf_counter()
        result = engine.run()
        plan = next_plan(engine, result, 1 + args.draft)  # reads the logits: the step's end
        times.append((time.perf_counter() - started) * 1e3)
    decode = statistics.median(times[2:])
    print(
        f"batch {args.batch} x {args.prompt} prompt tokens: prefill {times[0]:.0f} ms, "
        f"decode {decode:.1f} ms a step (median of {len(times) - 2}; fastest "
        f"{min(times[2:]):.1f})"
    )


if __name__ == "__main__":
    main()
