"""Decode rows and a prefill chunk in one forward, against the two forwards the engine runs
(docs/BENCHMARKS.md, "A long prompt beside running answers"): the logits of both ways, and
each way's time. A measurement outside the engine, not a path of it.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    .venv/bin/python -m bench.mixed_forward [--model DIR] [--rows 4] [--context 300]
        [--prompt 2000] [--chunk 48]

One rank, the model set up as server.py sets it up (bench.engine_steps.served_model: the
engine's CPU kernels, its head layout, the head on the last position only). The step goes
in as rows + chunk batch rows of one token each, so every projection, norm and MLP takes
them all at once. Each layer's `MixedCache` gives each row its position (mx.fast.rope
takes an offset per batch row), sends the decode rows to their batch cache and the chunk's
to the prompt's cache, and hands attention (`mixed_attention`) both, which attends each
part over its own keys; the head then takes the decode rows and the chunk's last, as the
two forwards' heads do. Families whose forward ends in `model.model` then a head (llama's
shape, the default model's).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from bench.compiled_decode import DEFAULT_MODEL
from bench.engine_steps import served_model
from engine.cpu_linear import ties_head

Fetched = tuple[mx.array, mx.array, Any, mx.array, mx.array]


class MixedCache:
    """One layer's two caches behind the interface the families call."""

    def __init__(
        self, batch: BatchKVCache, chunk: KVCache, rows: int, tokens: int, step: list[MixedCache]
    ) -> None:
        self.batch, self.chunk, self.rows, self.tokens = batch, chunk, rows, tokens
        self.step = step  # every layer's cache of this forward
        self.fetched: Fetched | None = None

    @property
    def offset(self) -> mx.array:
        """Each batch row's position: the decode rows', then the chunk's tokens'."""
        return mx.concatenate([self.batch.offset, self.chunk.offset + mx.arange(self.tokens)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rows = self.rows
        mask = self.batch.make_mask(1)
        kd, vd = self.batch.update_and_fetch(keys[:rows], values[:rows])
        kc, vc = self.chunk.update_and_fetch(
            keys[rows:].swapaxes(0, 2), values[rows:].swapaxes(0, 2)
        )
        self.fetched = (kd, vd, mask, kc, vc)
        return kd, vd

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> MixedMask:
        return MixedMask(self.step)


class MixedMask:
    """What the families pass attention as the mask: the forward's caches."""

    def __init__(self, caches: list[MixedCache]) -> None:
        self.caches = caches


def mixed_attention(fallback: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """Attention that splits a mixed step by cache, `fallback` for every other call."""

    def attend(q: mx.array, k: mx.array, v: mx.array, *, scale: float, **kwargs: Any) -> mx.array:
        mask = kwargs.pop("mask", None)
        if not isinstance(mask, MixedMask):
            return fallback(q, k, v, scale=scale, mask=mask, **kwargs)
        cache = next(c for c in mask.caches if c.fetched is not None and c.fetched[0] is k)
        assert cache.fetched is not None
        kd, vd, decode_mask, kc, vc = cache.fetched
        rows = cache.rows
        decoded = fallback(q[:rows], kd, vd, scale=scale, mask=decode_mask)
        chunk = fallback(q[rows:].swapaxes(0, 2), kc, vc, scale=scale, mask="causal")
        return mx.concatenate([decoded, chunk.swapaxes(0, 2)])

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int, default=4, help="decode rows")
    parser.add_argument("--context", type=int, default=300, help="their cached positions")
    parser.add_argument("--prompt", type=int, default=2000, help="the prompt's cached positions")
    parser.add_argument("--chunk", type=int, default=48, help="the chunk's tokens")
    parser.add_argument("--trials", type=int, default=15)
    args = parser.parse_args()
    model: Any = served_model(Path(args.model))
    mx.fast.scaled_dot_product_attention = mixed_attention(mx.fast.scaled_dot_product_attention)
    layers, rows, size = len(model.layers), args.rows, args.chunk
    mx.random.seed(0)
    answers = mx.random.randint(0, 1000, (rows, args.context)).astype(mx.uint32)
    prompt = mx.random.randint(0, 1000, (1, args.prompt + size)).astype(mx.uint32)
    tokens = mx.random.randint(0, 1000, (rows, 1)).astype(mx.uint32)
    chunk = prompt[:, args.prompt :]

    batch = [BatchKVCache([0] * rows) for _ in range(layers)]
    mx.eval(model(answers, cache=batch))
    cached = [KVCache() for _ in range(layers)]
    for start in range(0, args.prompt, 512):
        mx.eval(model(prompt[:, start : min(args.prompt, start + 512)], cache=cached))

    def caches() -> tuple[list, list]:
        # every trial writes the same positions with the same values: shallow copies do
        return [copy.copy(c) for c in batch], [copy.copy(c) for c in cached]

    def timed(
        step: Callable[[list, list], tuple[mx.array, ...]],
    ) -> tuple[float, tuple[mx.array, ...]]:
        ours, theirs = caches()
        start = time.perf_counter()
        out = step(ours, theirs)
        mx.eval(*out)
        return (time.perf_counter() - start) * 1e3, out

    def two(ours: list, theirs: list) -> tuple[mx.array, mx.array]:
        return model(tokens, cache=ours)[:, -1], model(chunk, cache=theirs)[:, -1]

    def one(ours: list, theirs: list) -> tuple[mx.array, mx.array]:
        mixed: list[MixedCache] = []
        mixed += [MixedCache(b, c, rows, size, mixed) for b, c in zip(ours, theirs, strict=True)]
        hidden = model.model(mx.concatenate([tokens[:, 0], chunk[0]])[:, None], cache=mixed)
        kept = mx.concatenate([hidden[:rows], hidden[-1:]])  # what the two forwards' heads take
        head = model.model.embed_tokens.as_linear if ties_head(model) else model.lm_head
        out = head(kept)[:, -1]
        return out[:rows], out[-1:]

    d2, c2 = timed(two)[1]
    d1, c1 = timed(one)[1]
    print(
        f"logits, one forward against two: decode rows within {mx.abs(d1 - d2).max().item():.2g},"
        f" the chunk's last within {mx.abs(c1 - c2).max().item():.2g}; greedy tokens equal:"
        f" {bool((d1.argmax(-1) == d2.argmax(-1)).all().item())}"
    )
    ways: dict[str, Callable[[list, list], tuple[mx.array, ...]]] = {
        "decode alone": lambda o, t: (model(tokens, cache=o),),
        "chunk alone": lambda o, t: (model(chunk, cache=t),),
        "as two forwards": two,
        "as one": one,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.trials):  # interleaved: the host's drift falls on every way alike
        for name, way in ways.items():
            times[name].append(timed(way)[0])
    print(", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in times.items()), end="; ")
    saved = [a - b for a, b in zip(times["as two forwards"], times["as one"], strict=True)]
    print(f"one forward saves {statistics.median(saved):.1f} ms (medians of {args.trials})")


if __name__ == "__main__":
    main()
