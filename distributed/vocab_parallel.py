"""Vocabulary-parallel embeddings and output head (tensor and expert plans).

Each rank keeps a contiguous range of vocabulary rows (sized by the plan) of the embedding
table and of an untied head; a tied head is the embedding slice itself. Lookup: ids outside
the slice give zero rows and one all_sum adds the slices. Head: each rank computes the
logits of its rows for the last position only (the engine samples nothing else; the last
few in a speculative step, distributed/head_positions.py), pads them
to the largest slice (all_gather needs the same shape on every rank: uneven shapes gave a
wrong-sized result on rank 0 and a lost connection on rank 1) and gathers them, so every
rank returns the full last-position logits [B, 1, V].
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from distributed.head_positions import tail
from distributed.slicing import keep_rows


def gather_logits(local: mx.array, sizes: list[int], group: mx.distributed.Group) -> mx.array:
    """[B, P, n_rank] per rank -> [B, P, V] on every rank (slices of uneven sizes; P is 1,
    or the positions of a speculative step)."""
    widest = max(sizes)
    batch, positions = local.shape[0], local.shape[1]
    rows = local.reshape(batch * positions, -1)
    if rows.shape[-1] < widest:
        rows = mx.pad(rows, [(0, 0), (0, widest - rows.shape[-1])])
    everyone = mx.distributed.all_gather(rows, group=group)
    everyone = everyone.reshape(len(sizes), batch * positions, widest)
    parts = [everyone[r, :, :size] for r, size in enumerate(sizes)]
    return mx.concatenate(parts, axis=-1).reshape(batch, positions, -1)


class VocabEmbedding(nn.Module):
    """This rank's vocabulary rows of a (Quantized)Embedding; `as_linear` is the tied head."""

    def __init__(
        self, embedding: nn.Module, spans: list[tuple[int, int]], group: mx.distributed.Group
    ) -> None:
        super().__init__()
        self.start, end = spans[group.rank()]
        self.count = end - self.start
        self.sizes = [b - a for a, b in spans]
        self.embedding = keep_rows(embedding, self.start, end)
        if hasattr(embedding, "num_embeddings"):
            embedding.num_embeddings = self.count
        self.group = group

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids.astype(mx.int32) - self.start
        inside = (local >= 0) & (local < self.count)
        rows = self.embedding(mx.where(inside, local, 0))
        rows = mx.where(inside[..., None], rows, mx.zeros((), dtype=rows.dtype))
        return mx.distributed.all_sum(rows, group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return gather_logits(self.embedding.as_linear(x[:, -tail() :, :]), self.sizes, self.group)


class VocabHead(nn.Module):
    """This rank's vocabulary rows of an untied (Quantized)Linear head."""

    def __init__(
        self, head: nn.Module, spans: list[tuple[int, int]], group: mx.distributed.Group
    ) -> None:
        super().__init__()
        start, end = spans[group.rank()]
        self.sizes = [b - a for a, b in spans]
        self.head = keep_rows(head, start, end)
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_logits(self.head(x[:, -tail() :, :]), self.sizes, self.group)


def split_vocabulary(
    model: nn.Module, spans: list[tuple[int, int]], group: mx.distributed.Group
) -> None:
    """Replace `model`'s embeddings (and untied head) by this rank's vocabulary rows."""
    inner = model.model
    inner.embed_tokens = VocabEmbedding(inner.embed_tokens, spans, group)
    if hasattr(model, "lm_head"):
        model.lm_head = VocabHead(model.lm_head, spans, group)
