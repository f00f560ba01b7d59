"""Linear layers for MLX's CPU backend: weights stored transposed, [in, out].

nn.Linear keeps its weight [out, in] and computes x @ W.T; on the CPU that is a BLAS call
with the weight transposed, and OpenBLAS's kernel for it reads memory slower than the one
for a weight already laid out [in, out] (this machine, 2 OpenBLAS threads, one token:
the default model's 49152 x 576 tied head 6.5 -> 4.3 ms, a layer's seven projections
731 -> 646 us; 8 tokens: 13.6 -> 10.7 ms and 1534 -> 1435 us). Same products, same
results (bitwise, in those measurements).

`transpose_linears(model)` swaps every plain nn.Linear (and, where the model ties its head
to the embeddings, the nn.Embedding) for the transposed form, after sharding, on the CPU
backend only: Metal and CUDA have their own matrix-vector kernels for the usual layout.
Quantized layers keep theirs. `weight` stays readable, as a transposed view.
"""

from __future__ import annotations

from typing import Any

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


def transpose_linears(model: nn.Module) -> int:
    """Swap `model`'s plain linear layers (and a tied head's embedding) for transposed
    ones, in place, one evaluated at a time; returns how many."""
    embeddings = ties_head(model)
    count = 0

    def converted(child: Any) -> Any:
        """`child` swapped, or (a module) visited and kept."""
        nonlocal count
        if type(child) is nn.Linear:
            new: nn.Module = TransposedLinear(child)
        elif embeddings and type(child) is nn.Embedding:
            new = TransposedEmbedding(child)
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
                child[:] = [converted(item) for item in child]  # in place: shared lists stay
            elif isinstance(child, nn.Module):
                module[key] = converted(child)

    visit(model)
    return count
