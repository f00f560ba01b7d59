"""What `mx.compile` would buy a batch-1 decode step here (issue 18's compiled decode, not
built into the engine): the default model decodes the same greedy tokens three ways, in
turn, and each way's median ms a token is printed.

    LD_PRELOAD=<OpenBLAS> .venv/bin/python -m bench.compiled_decode [--model DIR] [--tokens 48]

- eager: build the step's graph, evaluate it, read the token (what a plain loop does);
- async: build step N+1 while step N evaluates (mlx-lm's loop, and ours);
- compiled: one `mx.compile`d step over a preallocated cache of fixed capacity (positions
  past the answer masked), the shape-static form a compiled decode needs.

Every way installs engine/cpu_attention.py as the ranks do. The tokens must agree.
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

from engine import cpu_attention

DEFAULT_MODEL = Path.home() / (
    ".cache/mlx-ring/gguf/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f-float32-v1"
)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 2, 198, 1, 4093]


class StaticCache:
    """A KV cache of fixed capacity: keys and values written at `position` (an array, so a
    compiled step takes it as an input), the mask hiding what lies past it."""

    def __init__(self, keys: mx.array, values: mx.array, capacity: int) -> None:
        batch, heads, length, dim = keys.shape
        self.keys = mx.zeros((batch, heads, capacity, dim), keys.dtype)
        self.values = mx.zeros((batch, heads, capacity, dim), values.dtype)
        self.keys[..., :length, :] = keys
        self.values[..., :length, :] = values
        self.position = mx.array(length)
        self.capacity = capacity

    @property
    def offset(self) -> mx.array:
        return self.position

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self.position.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, *_: Any, **__: Any) -> mx.array:
        return (mx.arange(self.capacity) <= self.position)[None, None, None, :]


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


def compiled(model: Any, tokens: int, capacity: int = 256) -> tuple[float, list[int]]:
    token, plain = _prefill(model)
    length = len(PROMPT)
    caches = [
        StaticCache(c.keys[..., :length, :], c.values[..., :length, :], capacity) for c in plain
    ]
    state = [array for c in caches for array in (c.keys, c.values)]

    def step(token: mx.array, position: mx.array, *arrays: mx.array) -> list[mx.array]:
        for i, cache in enumerate(caches):
            cache.keys, cache.values, cache.position = arrays[2 * i], arrays[2 * i + 1], position
        following = mx.argmax(model(token[:, None], cache=caches)[:, -1, :], axis=-1)
        return [following, *(array for c in caches for array in (c.keys, c.values))]

    compiled_step = mx.compile(step)
    out = [token.item()]
    token, *state = compiled_step(token, mx.array(length), *state)  # compiles: not timed
    out.append(token.item())
    started = time.perf_counter()
    for position in range(length + 1, length + 1 + tokens):  # each step waited, as eager's
        token, *state = compiled_step(token, mx.array(position), *state)
        out.append(token.item())
    return (time.perf_counter() - started) / tokens * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpu_attention.install()
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
