"""What new cache lengths cost a speculating answer: the batch engine's decode steps in one
process, each step's width drawn as rank 0's rule drew them, with the traces it made.

    LD_PRELOAD=<OpenBLAS> .venv/bin/python -m bench.trace_cost --prompt 2000 --tokens 300 \
        [--rows 1] [--plain]

The compiled decode step is traced once per batch size, width and buffer length
(engine/compiled_decode.py), and the buffers grow every STEP positions, so an answer that
speculates traces each width it uses at each length it reaches. The widths: on the
edit workloads at 1 rank (`bench.spec_edits --set all`), rank 0's steps were 1 position
wide 37% of the time, 4 wide 28%, 9 wide 30%, and 2, 3, 5-8 wide the other 5%; each step
here accepts a uniform share of its proposals (the rest rolled back at the next), so the
context grows about as a served answer's does. `--plain`: width 1 throughout.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import mlx.core as mx

from bench.compiled_decode import DEFAULT_MODEL
from bench.engine_steps import first_plan, next_plan, served_model
from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode

WIDTHS = [1] * 37 + [4] * 28 + [9] * 30 + [2, 3, 5, 6, 6, 8, 8]  # rank 0's, per hundred steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--prompt", type=int, default=2000, help="tokens per prompt")
    parser.add_argument("--tokens", type=int, default=300, help="tokens each row decodes")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--plain", action="store_true", help="no speculation: width 1")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    model = served_model(args.model)
    compiled = CompiledDecode(model)
    engine = BatchEngine(model, 8192, compiled=compiled)
    engine.apply(first_plan(engine, model.args.vocab_size, args.rows, args.prompt))
    result = engine.run()
    draw = random.Random(args.seed)
    made = steps = accepted = 0
    started = time.perf_counter()
    while made < args.tokens:
        width = 1 if args.plain else draw.choice(WIDTHS)
        engine.apply(next_plan(engine, result, width, kept=accepted))
        result = engine.run()
        mx.eval(result.logits)
        accepted = draw.randint(0, width - 1)  # of this step's proposals, kept at the next
        made += 1 + accepted
        steps += 1
    seconds = time.perf_counter() - started
    print(
        f"{args.rows} row(s) from {args.prompt} prompt tokens, "
        f"{'plain' if args.plain else 'speculating'}: {made} tokens a row in {steps} steps, "
        f"{seconds:.2f} s ({seconds / steps * 1e3:.1f} ms a step); "
        f"{len(compiled.shapes) + compiled.dropped} traces"
    )


if __name__ == "__main__":
    main()
