"""Per-token cost of grammar-constrained sampling on rank 0, at batch 1 and 8.

    .venv/bin/python -m bench.constrained                      # the default model's tokenizer
    .venv/bin/python -m bench.constrained --tokenizer DIR --n-vocab 151936   # e.g. Qwen's 152k

Runs rank 0's own code path (leader.constraints, leader.sampler, the batched MLX sampler)
on random logits at temperature 1, B sequences in lock-step, and times per sampled token:
the grammar (mask + advance), and sampling the batch with the masks applied, against
sampling the same rows unconstrained (the difference: applying the masks). A sequence
whose grammar completes starts again with a fresh constraint (its compile time is
reported apart), so the batch stays full. No model runs:
the figures are what constraints add to a decode step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_tokenizer

from engine.batch_sampler import sample
from ipc.protocol import SamplingParams, ToolChoice, ToolSpec
from leader.constraints import GrammarTokens, tool_call_schema
from leader.sampler import RequestSampler

ADDRESS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["city", "zip"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 40},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "inactive", "banned"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": ADDRESS,
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "tags", "address", "verified"],
    "additionalProperties": False,
}
TOOLS = [
    ToolSpec(name="get_address", parameters=ADDRESS),
    ToolSpec(name="search", parameters=SEARCH),
]
GRAMMARS: dict[str, Any] = {
    "json_schema": SCHEMA,
    "tool_call": tool_call_schema(TOOLS, ToolChoice(mode="required")),
    "json_object": {"type": "object"},
}


def default_tokenizer_dir() -> Path:
    from acquisition.source import resolve_model
    from config.settings import load_settings

    return resolve_model(load_settings())


def measure(grammar: GrammarTokens, schema: Any, eos: set[int], batch: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=steps, temperature=1.0, seed=1)
    compile_ms: list[float] = []

    def fresh() -> RequestSampler:
        started = time.perf_counter()
        constraint = grammar.constraint(schema, "bench")
        compile_ms.append((time.perf_counter() - started) * 1000)
        return RequestSampler(params, [], constraint)

    constrained = [fresh() for _ in range(batch)]
    free = [RequestSampler(params, []) for _ in range(batch)]
    mask_ms, sample_ms, free_ms, consume_ms, step_added = [], [], [], [], []
    for _ in range(steps):
        logits = mx.array(rng.normal(size=(batch, grammar.n_vocab)).astype(np.float32) * 3)
        mx.eval(logits)
        t0 = time.perf_counter()
        rows = [s.row() for s in constrained]  # computes each grammar's mask
        t1 = time.perf_counter()
        drawn = sample(logits, rows)
        mx.eval(drawn.arrays())
        tokens = [token for token, _, _ in drawn.rows()]
        t2 = time.perf_counter()
        for s, token in zip(constrained, tokens, strict=True):
            s.record(token)  # advances the grammar
        t3 = time.perf_counter()
        unconstrained = sample(logits, [s.row() for s in free])
        mx.eval(unconstrained.arrays())
        for s, (token, _, _) in zip(free, unconstrained.rows(), strict=True):
            s.record(token)
        t4 = time.perf_counter()
        mask_ms.append((t1 - t0) * 1000 / batch)
        sample_ms.append((t2 - t1) * 1000 / batch)
        consume_ms.append((t3 - t2) * 1000 / batch)
        free_ms.append((t4 - t3) * 1000 / batch)
        step_added.append((t3 - t0) * 1000 - (t4 - t3) * 1000)
        for i, (s, token) in enumerate(zip(constrained, tokens, strict=True)):
            assert s.constraint is not None
            if token in eos or s.constraint.finished:
                constrained[i] = fresh()

    def mean(values: list[float]) -> float:
        return round(statistics.fmean(values), 4)

    grammar_ms = [m + c for m, c in zip(mask_ms, consume_ms, strict=True)]
    added = [g + s - f for g, s, f in zip(grammar_ms, sample_ms, free_ms, strict=True)]
    return {
        "batch": batch,
        "tokens": steps * batch,
        "grammar_ms_per_token": mean(grammar_ms),
        "apply_ms_per_token": mean([s - f for s, f in zip(sample_ms, free_ms, strict=True)]),
        "added_ms_per_token": mean(added),
        "sample_constrained_ms_per_token": mean(sample_ms),
        "sample_free_ms_per_token": mean(free_ms),
        "added_ms_per_step_p99": round(float(np.percentile(step_added, 99)), 3),
        "compile_ms_median": round(statistics.median(compile_ms), 3),
        "documents": len(compile_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokenizer", type=Path, help="directory with tokenizer.json (default: MODEL's)"
    )
    parser.add_argument(
        "--n-vocab", type=int, help="logits width (default: config.json's vocab_size)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    directory = args.tokenizer or default_tokenizer_dir()
    tokenizer = load_tokenizer(directory)
    n_vocab = args.n_vocab
    if n_vocab is None and (directory / "config.json").is_file():
        n_vocab = json.loads((directory / "config.json").read_text()).get("vocab_size")
    n_vocab = n_vocab or len(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    started = time.perf_counter()
    grammar = GrammarTokens(tokenizer, n_vocab, eos)
    build_s = time.perf_counter() - started
    print(f"tokenizer {directory} ({n_vocab} logits), grammar tokenizer built in {build_s:.2f} s")
    print(f"{platform.processor() or platform.machine()}, {platform.platform()}")
    print(
        "| grammar | batch | grammar ms/token | apply ms/token | added ms/token | "
        "sampling ms/token (constrained / free) | added ms/step p99 | compile ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for name, schema in GRAMMARS.items():
        for batch in args.batch:
            row = measure(grammar, schema, eos, batch, args.steps) | {"grammar": name}
            results.append(row)
            print(
                f"| {name} | {batch} | {row['grammar_ms_per_token']} | "
                f"{row['apply_ms_per_token']} | {row['added_ms_per_token']} | "
                f"{row['sample_constrained_ms_per_token']} / {row['sample_free_ms_per_token']} | "
                f"{row['added_ms_per_step_p99']} | {row['compile_ms_median']} |"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"tokenizer": str(directory), "n_vocab": n_vocab, "build_s": build_s}
        args.out.write_text(json.dumps(summary | {"results": results}, indent=2))


if __name__ == "__main__":
    main()
