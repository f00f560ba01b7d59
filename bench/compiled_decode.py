"""What `mx.compile` buys a batch-1 decode step here, outside the server: the default model
decodes the same greedy tokens three ways, in turn, and each way's median ms a token is
printed. (In the server: bench.step_time with --env COMPILED_DECODE=off, then auto.)

    LD_PRELOAD=<OpenBLAS> .venv/bin/python -m bench.compiled_decode [--model DIR] [--tokens 48]

- eager: build the step's graph, evaluate it, read the token (what a plain loop does);
- async: build step N+1 while step N evaluates (mlx-lm's loop, and ours);
- compiled: the engine's compiled step (engine/compiled_decode.py) over a batch cache of
  one row, as the server decodes one request.

Every way installs engine/cpu_kernels.py as the ranks do. The tokens must agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from engine import cpu_kernels
from engine.batch_caches import merged
from engine.compiled_decode import CompiledDecode

DEFAULT_MODEL = Path.home() / (
    ".cache/mlx-ring/gguf/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f-float32-v1"
)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 2, 198, 1, 4093]


def _prefill(model: Any) -> tuple[mx.array, list[KVCache]]:
    cache = [KVCache() for _ in model.layers]
    prompt = mx.array([PROMPT]) % model.args.vocab_size  # a tiny test model's vocabulary too
    token = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
    mx.eval(token)
    return token, cache


def eager(model: Any, tokens: int) -> tuple[float, list[int]]:
    token, cache = _prefill(model)
    out, started = [token.item()], time.perf_counter()
    for _ in range(tokens):
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(token)
        out.append(token.item())
    return (time.perf_counter() - started) / tokens * 1e3, out


def pipelined(model: Any, tokens: int) -> tuple[float, list[int]]:
    token, cache = _prefill(model)
    out, started = [], time.perf_counter()
    for _ in range(tokens):
        following = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(following)
        out.append(token.item())
        token = following
    out.append(token.item())
    return (time.perf_counter() - started) / tokens * 1e3, out


def compiled(model: Any, tokens: int) -> tuple[float, list[int]]:
    token, plain = _prefill(model)
    caches = merged([plain])  # the decode batch's BatchKVCache, as the engine holds it
    decode = CompiledDecode(model)

    def step(token: mx.array) -> mx.array:
        logits = decode.step(token[:, None], caches)
        assert logits is not None, "this model's caches do not take the compiled step"
        return mx.argmax(logits, axis=-1)

    out = [token.item()]
    token = step(token)  # traces: not timed
    out.append(token.item())
    started = time.perf_counter()
    for _ in range(tokens):  # each step waited for, as eager's
        token = step(token)
        out.append(token.item())
    return (time.perf_counter() - started) / tokens * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpu_kernels.install()
    model, _ = load_model(args.model)
    model.eval()
    ways = {"eager": eager, "async": pipelined, "compiled": compiled}
    times: dict[str, list[float]] = {name: [] for name in ways}
    answers: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, way in ways.items():
            ms, answers[name] = way(model, args.tokens)
            times[name].append(ms)
    for name, values in times.items():
        rounded = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name}: {statistics.median(values):.1f} ms a token (rounds: {rounded})")
    agree = answers["eager"][: args.tokens] == answers["async"][: args.tokens]
    agree = agree and answers["eager"][: args.tokens] == answers["compiled"][: args.tokens]
    print(f"same greedy tokens every way: {agree}")


if __name__ == "__main__":
    main()
