"""Run under mlx.launch (or alone for the single-rank reference): load models per plan and
record rank-0 logits, so the tests can compare sharded runs with one rank.

    logits_probe.py SPEC.json OUT_DIR

SPEC: {"prompt": [ids], "steps": 32, "batch_steps": 6,
       "cases": [{"name", "model", "parallelism", "weights", "prompt", "steps" (both
       optional: the case's own prompt and greedy token count)}]}.
For each case, rank 0 writes OUT_DIR/<name>.npz with:
  prompt_logits  last-position logits of the prompt (KVCache prefill)
  tokens         `steps` greedy tokens after it, and step_logits their logits
  padded_logits  last-position logits of the prompt and its first half, left-padded,
                 through batch caches (BatchKVCache, BatchRotatingKVCache for windows)
  batch_logits   `batch_steps` greedy decode steps of the sequences prefilled one by one
                 and merged into batch caches (as the engine does)
  long_logits    last-position logits of the prompt repeated to LONG_PROMPT tokens (a
                 pipeline streams it through its stages in pieces), then of 4 greedy steps
  long_padded_logits  the long prompt and its first 400 tokens, left-padded in batch caches
Every rank writes OUT_DIR/<name>.rank<r>.json with its plan line, its weight bytes (held
and predicted from the headers) and its KV bytes per token (measured and predicted).
A single process (world 1) ignores the cases' parallelism and weights: it is the reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

PROJECT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(PROJECT))

from distributed.hosts import gather_hosts  # noqa: E402
from distributed.loader import load_rank_model, weight_bytes  # noqa: E402
from distributed.memory import activation_bytes, kv_bytes, predict_weight_bytes  # noqa: E402
from distributed.plan import make_plan  # noqa: E402
from distributed.plan_text import describe  # noqa: E402
from engine import cpu_kernels  # noqa: E402
from engine.batch_caches import left_pad, merged  # noqa: E402
from engine.prefix_store import kv_bytes_per_token  # noqa: E402

LONG_PROMPT = 640  # 5 pieces at 2 and 3 ranks (distributed/prefill_pieces.py)
LONG_STEPS = 4


def _last(model, tokens: mx.array, cache) -> mx.array:
    logits = model(tokens, cache=cache)[:, -1, :].astype(mx.float32)
    mx.eval(logits)
    return logits


def _agree(tokens: mx.array, group) -> mx.array:
    """Rank 0's tokens on every rank (rank 0 decides, as in the engine)."""
    if group.size() == 1:
        return tokens
    mine = tokens if group.rank() == 0 else mx.zeros_like(tokens)
    return mx.distributed.all_sum(mine, group=group)


def decode_in_batch(
    model, sequences: list[list[int]], steps: int, agree=lambda tokens: tokens
) -> tuple[mx.array, list[mx.array]]:
    """Each sequence prefilled alone, their caches merged into batch caches, then `steps`
    greedy steps of the batch, as the engine does: the prefills' last-position logits and
    each step's. `agree` makes the ranks take rank 0's tokens."""
    # Several forward calls, one eval at the end: the engine's step does the same.
    singles = [make_prompt_cache(model) for _ in sequences]
    rows = [
        model(mx.array(sequence)[None], cache=seq_cache)[:, -1, :]
        for sequence, seq_cache in zip(sequences, singles, strict=True)
    ]
    prefilled = logits = mx.concatenate(rows, axis=0).astype(mx.float32)
    mx.eval(logits, [c.state for seq_cache in singles for c in seq_cache])
    batch = merged(singles)
    stepped = []
    for _ in range(steps):
        token = agree(mx.argmax(logits, axis=-1).astype(mx.int32))
        logits = _last(model, token[:, None], batch)
        stepped.append(logits)
    return prefilled, stepped


def run_case(case: dict, spec: dict, group, out: Path) -> None:
    model_dir = Path(case["model"])
    config = json.loads((model_dir / "config.json").read_text())
    world = group.size()
    if world == 1:
        plan = make_plan(config, 1, None, "auto")
    else:
        plan = make_plan(config, world, case.get("weights"), case.get("parallelism", "auto"))
    mx.reset_peak_memory()
    started = time.perf_counter()
    model = load_rank_model(model_dir, group, plan)
    loaded = time.perf_counter()
    rank = group.rank()
    info = {
        "plan": describe(plan),
        "strategy": plan.strategy,
        "split_heads": plan.split_heads,
        "weight_bytes": weight_bytes(model),
        "predicted_weight_bytes": predict_weight_bytes(model_dir, plan, [rank])[0],
        "active_bytes": mx.get_active_memory(),
        "peak_load_bytes": mx.get_peak_memory(),
        "memory_gib": [host.memory_bytes / 2**30 for host in gather_hosts(group)],
        "kv_bytes_per_token": kv_bytes_per_token(model, group),
        "predicted_kv_bytes_per_token": kv_bytes(plan, activation_bytes(model_dir, config))[rank][
            0
        ],
    }

    prompt_ids = case.get("prompt", spec["prompt"])
    prompt = mx.array(prompt_ids)[None]
    cache = make_prompt_cache(model)
    logits = _last(model, prompt, cache)
    prompt_logits, step_logits, tokens = logits, [], []
    for _ in range(case.get("steps", spec["steps"])):
        token = _agree(mx.argmax(logits, axis=-1).astype(mx.int32), group)
        tokens.append(token)
        logits = _last(model, token[:, None], cache)
        step_logits.append(logits)

    sequences = [prompt_ids, prompt_ids[: len(prompt_ids) // 2 + 1]]
    longest = max(len(s) for s in sequences)
    padding = [longest - len(s) for s in sequences]
    padded = mx.array([[0] * p + s for p, s in zip(padding, sequences, strict=True)])
    batch_cache = merged([make_prompt_cache(model) for _ in sequences])
    left_pad(batch_cache, padding)
    padded_logits = _last(model, padded, batch_cache)

    _, batch_logits = decode_in_batch(
        model, sequences, spec["batch_steps"], lambda tokens: _agree(tokens, group)
    )

    repeated = (prompt_ids * (LONG_PROMPT // len(prompt_ids) + 1))[:LONG_PROMPT]
    long_cache = make_prompt_cache(model)
    logits = _last(model, mx.array(repeated)[None], long_cache)
    long_logits = [logits]
    for _ in range(LONG_STEPS):
        token = _agree(mx.argmax(logits, axis=-1).astype(mx.int32), group)
        logits = _last(model, token[:, None], long_cache)
        long_logits.append(logits)
    # the same long prompt and its first 400 tokens, left-padded in batch caches
    long_rows = [repeated, repeated[:400]]
    long_batch = merged([make_prompt_cache(model) for _ in long_rows])
    left_pad(long_batch, [0, LONG_PROMPT - 400])
    padded_long = mx.array([long_rows[0], [0] * (LONG_PROMPT - 400) + long_rows[1]])
    long_padded_logits = _last(model, padded_long, long_batch)

    info["load_s"] = round(loaded - started, 2)
    info["run_s"] = round(time.perf_counter() - loaded, 2)
    (out / f"{case['name']}.rank{group.rank()}.json").write_text(json.dumps(info))
    if group.rank() == 0:
        np.savez(
            out / f"{case['name']}.npz",
            prompt_logits=np.array(prompt_logits),
            step_logits=np.array(mx.concatenate(step_logits)),
            tokens=np.array(mx.concatenate(tokens)),
            padded_logits=np.array(padded_logits),
            batch_logits=np.array(mx.stack(batch_logits)),
            long_logits=np.array(mx.stack(long_logits)),
            long_padded_logits=np.array(long_padded_logits),
        )


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    group = mx.distributed.init(strict=False, backend="ring")
    cpu_kernels.install()  # as server.py does
    # mlx.launch busy-loops relaying our stdin while it stays open; the caller sends it
    # one byte after every rank printed this line, and then it stops.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    print(f"rank {group.rank()}: stdin detached", flush=True)
    for case in spec["cases"]:
        run_case(case, spec, group, out)
        print(f"rank {group.rank()}: case {case['name']} done", flush=True)


if __name__ == "__main__":
    main()
