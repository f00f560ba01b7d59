"""Linear layers for MLX's CPU backend: weights stored transposed, [in, out].

nn.Linear keeps its weight [out, in] and computes x @ W.T; on the CPU that is a BLAS call
with the weight transposed, and OpenBLAS's kernel for it reads memory slower than the one
for a weight already laid out [in, out] (this machine, 2 OpenBLAS threads, one token:
the default model's 49152 x 576 tied head 6.5 -> 4.3 ms, a layer's seven projections
731 -> 646 us; 8 tokens: 13.6 -> 10.7 ms and 1534 -> 1435 us). Same products, same
results (bitwise, in those measurements).

Which is faster for the layers depends on the BLAS kernels, the threads and the batch.
On an AVX-512 Xeon (OpenBLAS 0.3.21's Cooperlake kernels, 2026-11-25, the engine's own
steps): one rank with 2 threads decoded batch 8 in 87-88 ms with the layers [out, in]
against 96-98 ms [in, out], batch 1 and prefill the same; two ranks of one thread took
48.4 against 44.6 ms a batch-1 step. On 2026-11-24's CPU (SSE3 and AVX2
kernels) [in, out] was 15-19% faster at batch 8. The head was faster [in, out] in every
measurement. So the head is always stored [in, out], and the layers by LINEAR_LAYOUT:
`plain` (the default since native/sgemm_rows.c: it multiplies a decode step's few rows
against [out, in] itself, 74 against 102 ms a batch-8 step transposed at one rank) or
`transposed`. Timing each shape's products at load did not predict the step
(docs/BENCHMARKS.md, 2026-11-25 later) and is not done.

`transpose_linears(model, layout)` swaps the head (an lm_head nn.Linear, or the
nn.Embedding of a model that ties its head to it) and, for `transposed`, every other plain
nn.Linear for the transposed form, after sharding; server.py calls it where the Linux CPU
layer's gate (launcher/cpu_layer.applies: MLX on its CPU device, Linux x86_64) says so, as
these measurements are OpenBLAS's. Metal and CUDA have their own matrix-vector kernels
for the usual layout. Quantized layers keep
theirs. `weight` stays readable, as a transposed view.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from config.settings import LinearLayout


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


def transpose_linears(model: nn.Module, layout: LinearLayout = "plain") -> int:
    """Swap `model`'s head (an lm_head linear, or a tied head's embedding) and, with the
    `transposed` layout, its other plain linear layers for transposed ones, in place, one
    evaluated at a time; returns how many."""
    embeddings = ties_head(model)
    layers = layout == "transposed"
    count = 0

    def converted(place: Any, child: Any) -> Any:
        """`child` swapped, or (a module) visited and kept."""
        nonlocal count
        if embeddings and type(child) is nn.Embedding:
            new: nn.Module = TransposedEmbedding(child)
        elif type(child) is nn.Linear and (layers or place == "lm_head"):
            new = TransposedLinear(child)
        else:
            if isinstance(child, nn.Module):
                visit(child)
            return child
        mx.eval(new.parameters())
        count += 1
        return new

    def visit(module: nn.Module) -> None:
        for key, child in list(module.items()):
            if isinstance(child, list):
                child[:] = [converted(i, item) for i, item in enumerate(child)]  # shared lists stay
            elif isinstance(child, nn.Module):
                module[key] = converted(key, child)

    visit(model)
    return count
