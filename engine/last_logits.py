"""The output head on the last position only: the engine samples nothing else.

A model's forward computes logits for every position it is given, so a prefill chunk of
256 tokens multiplied 256 hidden states by the head (SmolLM2: 49152 x 576) to keep one
row: a sizeable share of a prefill on the CPU, for batched short prompts and one long one
alike (docs/BENCHMARKS.md, "Figures behind the code"). Sharded heads already take the last
position (distributed/vocab_parallel.py, the pipeline stages); `head_on_last_position(model)`
wraps an unsplit model's head, or a tied head's embedding, the same way.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from distributed.head_positions import tail
from engine.cpu_linear import TransposedEmbedding, TransposedLinear, ties_head

HEADS = (nn.Linear, nn.QuantizedLinear, TransposedLinear)
EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding, TransposedEmbedding)


class _Wrapper(nn.Module):
    """Reads through to the wrapped module (`weight`, `bits` and the like)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "inner" not in self:  # still in __init__
                raise
            return getattr(self["inner"], name)


class LastPositionHead(_Wrapper):
    """An untied head applied to the last position (the last `tail()` in a speculative
    step): [B, L, D] -> [B, 1, V]."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x[:, -tail() :, :])


class LastPositionTiedHead(_Wrapper):
    """An embedding table whose `as_linear` (the tied head) takes the last position."""

    def __call__(self, ids: mx.array) -> mx.array:
        return self.inner(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.inner.as_linear(x[:, -tail() :, :])


def head_on_last_position(model: nn.Module) -> bool:
    """Wrap `model.lm_head` (or, where the head is tied, `model.model.embed_tokens`; in
    `model.language_model` where there is one) so it computes the last position's logits
    only; False where neither is a plain head."""
    head = model.get("lm_head")
    if type(head) in HEADS:
        model.lm_head = LastPositionHead(head)
        return True
    inner = model.get("model")
    embedding = inner.get("embed_tokens") if isinstance(inner, nn.Module) else None
    if head is None and ties_head(model) and type(embedding) in EMBEDDINGS:
        inner.embed_tokens = LastPositionTiedHead(embedding)
        return True
    language = model.get("language_model")  # multimodal families wrap the text model
    return isinstance(language, nn.Module) and head_on_last_position(language)
