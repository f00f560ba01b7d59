"""Linear layers for MLX's CPU backend: weights stored transposed, [in, out].

nn.Linear keeps its weight [out, in] and computes x @ W.T; on the CPU that is a BLAS call
with the weight transposed, and OpenBLAS's kernel for it reads memory slower than the one
for a weight already laid out [in, out] (this machine, 2 OpenBLAS threads, one token:
the default model's 49152 x 576 tied head 6.5 -> 4.3 ms, a layer's seven projections
731 -> 646 us; 8 tokens: 13.6 -> 10.7 ms and 1534 -> 1435 us). Same products, same
results (bitwise, in those measurements).

Which layout is faster depends on the BLAS kernels, the threads and the batch: on an
AVX-512 Xeon (OpenBLAS 0.3.21's Cooperlake kernels, 2026-11-25), thirty layers' products
in sequence took 36.1 against 36.7 ms transposed at 1 token and 56.9 against 52.2 ms at 8
with 2 threads, but 36.9 against 63.0 ms at 1 token with 1 thread; the tied head was
25-30% faster transposed either way. One layer's products timed alone, from the CPU's
caches, came out equal in both layouts: a step streams its weights from memory. So with
LINEAR_LAYOUT=auto, `MeasuredLayout` times the head alone and the layers' products in
model order (as many as fit TIMED_BYTES), in both layouts at 1 and 8 rows, once per rank,
and keeps each group's faster layout; `transposed` and `plain` fix the choice.

`transpose_linears(model, choose)` swaps the plain nn.Linear layers (and, where the model
ties its head to the embeddings, the nn.Embedding) of the groups `choose` picks for the
transposed form, after sharding, on the CPU backend only: Metal and CUDA have their own
matrix-vector kernels for the usual layout. Quantized layers keep theirs. `weight` stays
readable, as a transposed view.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn


class TransposedLinear(nn.Module):
    """nn.Linear with its weight kept as [in, out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


class TransposedEmbedding(nn.Module):
    """nn.Embedding with its table kept as [dims, vocabulary], for a tied head."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(embedding.weight.T)

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.moveaxis(mx.take(self.weight_t, ids, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def ties_head(model: nn.Module) -> bool:
    """Whether `model` computes its logits with its embedding table (`as_linear`)."""
    args = getattr(model, "args", None)
    return bool(getattr(args, "tie_word_embeddings", False))


Layout = Literal["auto", "transposed", "plain"]
# Whether to store a group's weights ([out, in], in model order) transposed.
Chooser = Callable[[str, list[mx.array]], bool]
# Rows timed: a decode step of one request and of a full default batch, and a prefill.
TIMED_ROWS = (1, 8, 128)
# Weights timed per group, at most: more than a CPU's caches hold, so that the products
# read from memory as a step's do, and not the whole model (the timing holds both layouts).
TIMED_BYTES = 128 << 20
# The transposed layout is kept unless the usual one is faster, over the rows timed (the
# geometric mean of the ratios), by more than this fraction: where the two are this close,
# repeated timings pick either.
PLAIN_MARGIN = 0.02


@dataclass(frozen=True)
class LayoutTiming:
    """The products of a group's first `count` weights in sequence, fastest ms in each
    layout, one figure per row count of TIMED_ROWS."""

    group: str
    count: int
    plain_ms: tuple[float, ...]
    transposed_ms: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Transposed over plain time, the geometric mean over the row counts."""
        ratios = [t / p for t, p in zip(self.transposed_ms, self.plain_ms, strict=True)]
        return math.prod(ratios) ** (1 / len(ratios))

    @property
    def transposed(self) -> bool:
        return self.ratio <= 1 + PLAIN_MARGIN

    def describe(self) -> str:
        kept = "[in, out]" if self.transposed else "[out, in]"
        rows = ", ".join(
            f"{n} rows {t:.1f}/{p:.1f}"
            for n, t, p in zip(TIMED_ROWS, self.transposed_ms, self.plain_ms, strict=True)
        )
        return f"{self.group} ({self.count} timed) kept {kept}, ms [in, out]/[out, in]: {rows}"


def time_layouts(group: str, weights: list[mx.array], repeats: int = 5) -> LayoutTiming:
    """Products with `weights` ([out, in]) in sequence, each of inputs of TIMED_ROWS rows,
    in both layouts, interleaved so that both see the same machine; the fastest of
    `repeats` after a warm-up: a rank times while the others and api.py load, and what
    else runs only ever adds time (medians of 3 in the server read 78.9 against 30.4 ms
    where the same products alone take 16.8 and 15.0)."""
    transposed = [mx.contiguous(weight.T) for weight in weights]
    inputs = {
        columns: [mx.random.normal((n, columns)).astype(weights[0].dtype) for n in TIMED_ROWS]
        for columns in {int(weight.shape[1]) for weight in weights}
    }
    mx.eval(transposed, inputs)
    layouts = {"plain": [weight.T for weight in weights], "transposed": transposed}
    samples: dict[tuple[str, int], list[float]] = {}
    for repeat in range(repeats + 1):
        for row in range(len(TIMED_ROWS)):
            for name, stored in layouts.items():
                started = time.perf_counter()  # one evaluation, as a step's
                mx.eval([inputs[weight_t.shape[0]][row] @ weight_t for weight_t in stored])
                if repeat:
                    elapsed = (time.perf_counter() - started) * 1e3
                    samples.setdefault((name, row), []).append(elapsed)

    def fastest(name: str) -> tuple[float, ...]:
        return tuple(min(samples[name, row]) for row in range(len(TIMED_ROWS)))

    return LayoutTiming(group, len(weights), fastest("plain"), fastest("transposed"))


class MeasuredLayout:
    """Chooses each group's layout by timing up to TIMED_BYTES of its weights."""

    def __init__(self) -> None:
        self.timings: list[LayoutTiming] = []

    def __call__(self, group: str, weights: list[mx.array]) -> bool:
        timed: list[mx.array] = []
        for weight in weights:
            if timed and sum(w.nbytes for w in timed) + weight.nbytes > TIMED_BYTES:
                break
            timed.append(weight)
        self.timings.append(time_layouts(group, timed))
        return self.timings[-1].transposed


def layout_chooser(layout: Layout) -> Chooser:
    """Whether to store a group's weights transposed, by LINEAR_LAYOUT."""
    if layout == "auto":
        return MeasuredLayout()
    return lambda _group, _weights: layout == "transposed"


def transpose_linears(model: nn.Module, choose: Chooser = lambda _group, _weights: True) -> int:
    """Swap `model`'s plain linear layers (and a tied head's embedding) for transposed
    ones where `choose` picks their group (the "head", the "layers"), in place, one
    evaluated at a time; returns how many."""
    embeddings = ties_head(model)
    # Where each layer sits: (its module or list, its key there, the layer), in model order.
    groups: dict[str, list[tuple[Any, Any, nn.Module]]] = {"head": [], "layers": []}

    def visit(module: nn.Module) -> None:
        for key, child in list(module.items()):
            places = enumerate(child) if isinstance(child, list) else [(key, child)]
            owner = child if isinstance(child, list) else module  # lists stay, shared or not
            for place, item in places:
                if embeddings and type(item) is nn.Embedding:
                    groups["head"].append((owner, place, item))
                elif type(item) is nn.Linear:
                    group = "head" if place == "lm_head" else "layers"
                    groups[group].append((owner, place, item))
                elif isinstance(item, nn.Module):
                    visit(item)

    visit(model)
    count = 0
    for group, layers in groups.items():
        if not layers or not choose(group, [layer.weight for _, _, layer in layers]):
            continue
        for owner, place, layer in layers:
            new = (
                TransposedEmbedding(layer)
                if isinstance(layer, nn.Embedding)
                else TransposedLinear(layer)
            )
            mx.eval(new.parameters())
            owner[place] = new
            count += 1
    return count
