"""Linear layers for MLX's CPU backend: weights stored transposed, [in, out].

nn.Linear keeps its weight [out, in] and computes x @ W.T; on the CPU that is a BLAS call
with the weight transposed, and OpenBLAS's kernel for it reads memory slower than the one
for a weight already laid out [in, out] (the default model's 49152 x 576 tied head and a
layer's seven projections, at one token and at 8). Same products, same results (bitwise,
in those measurements).

Which is faster for the layers depends on the BLAS kernels, the threads and the batch.
On an AVX-512 Xeon (OpenBLAS 0.3.21's Cooperlake kernels, the engine's own steps), one
rank with 2 threads decoded batch 8 faster with the layers [out, in], batch 1 and prefill
the same, while two ranks of one thread took a batch-1 step faster [in, out]; on a CPU
with SSE3 and AVX2 kernels [in, out] was faster at batch 8. The head was faster [in, out]
in every measurement. So the head is always stored [in, out], and the layers by
LINEAR_LAYOUT: `plain` (the default since native/sgemm_rows.c: it multiplies a decode
step's few rows against [out, in] itself, a batch-8 step faster than transposed at one
rank) or `transposed`. Timing each shape's products at load did not predict the step and
is not done (docs/BENCHMARKS.md, "Figures behind the code").

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
