"""Rank 0 samples the whole batch inside MLX, as the last ops of the step's graph.

Penalties (repetition on the prompt and the answer; presence and frequency on the answer),
grammar masks (packed allowed-token bits from leader/constraints.py), temperature, top_k,
top_p, min_p and logprobs are batched array ops, so the sampled tokens are one more lazy
result of the step: rank 0 can start the step and do other work (stream the last step's
text) while it computes.

Draws: every sampled row uses its own key, derived from the request's seed and the token's
index, so a seeded request gets the same tokens whatever else shares the batch (the draws
differ from the numpy sampler this replaced: a documented change). Sampling is Gumbel-max
over the kept logits. top_k, top_p and min_p look at the most likely CANDIDATES tokens
(argpartition, no full sort of the vocabulary); top_p's mass is measured among them, which
differs from a full sort only when they hold less than top_p of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

CANDIDATES = 1024
_SEED_MIX = 0x9E3779B97F4A7C15


def token_seed(seed: int, index: int) -> int:
    """The key of a request's `index`-th sampled token: reproducible, distinct per token."""
    return (seed * _SEED_MIX + index) % 2**63


@dataclass(frozen=True)
class RowSampling:
    """How to sample one row of the step's logits."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0  # token_seed(...) of this token
    repetition_penalty: float = 1.0
    seen: Sequence[int] = ()  # tokens the repetition penalty applies to
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    counts: Mapping[int, int] = field(default_factory=dict)  # answer tokens so far
    mask: np.ndarray | None = None  # allowed tokens, packed int32 words
    logprobs: int = -1  # -1: none; 0: the chosen token's; k > 0: and the top k

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class Sampled:
    """The batch's sampled tokens (and logprobs when asked), lazy until evaluated."""

    tokens: mx.array  # [B] int32
    logprobs: mx.array | None = None  # [B] of the chosen tokens
    top_ids: mx.array | None = None  # [B, K] most likely first
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        found = (self.tokens, self.logprobs, self.top_ids, self.top_logprobs)
        return [array for array in found if array is not None]

    def rows(self) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        """Per row, once evaluated: (token, its logprob, [(top token, logprob), ...])."""
        tokens: list[int] = self.tokens.tolist()  # type: ignore[assignment]
        chosen: list[float | None] = (
            self.logprobs.tolist() if self.logprobs is not None else [None] * len(tokens)  # type: ignore[assignment]
        )
        if self.top_ids is None or self.top_logprobs is None:
            return [(t, lp, []) for t, lp in zip(tokens, chosen, strict=True)]
        ids: list[list[int]] = self.top_ids.tolist()  # type: ignore[assignment]
        values: list[list[float]] = self.top_logprobs.tolist()  # type: ignore[assignment]
        return [
            (t, lp, list(zip(i, v, strict=True)))
            for t, lp, i, v in zip(tokens, chosen, ids, values, strict=True)
        ]


def _padded(rows: list[list[int]], fill: int = 0) -> mx.array:
    width = max((len(r) for r in rows), default=0) or 1
    return mx.array([r + [r[0] if r else fill] * (width - len(r)) for r in rows], mx.int32)


def _penalize(x: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    if any(r.repetition_penalty != 1.0 and r.seen for r in rows):
        ids = _padded([list(r.seen) if r.repetition_penalty != 1.0 else [] for r in rows])
        factor = mx.array([[r.repetition_penalty] for r in rows], mx.float32)
        chosen = mx.take_along_axis(x, ids, axis=-1)
        chosen = mx.where(chosen > 0, chosen / factor, chosen * factor)
        x = mx.put_along_axis(x, ids, chosen, axis=-1)
    if any(r.counts and (r.presence_penalty or r.frequency_penalty) for r in rows):
        ids_rows, amounts = [], []
        for r in rows:
            used = r.presence_penalty or r.frequency_penalty
            ids_rows.append(list(r.counts) if used else [])
            amounts.append(
                [r.presence_penalty + r.frequency_penalty * n for n in r.counts.values()]
                if used
                else []
            )
        ids = _padded(ids_rows)
        width = ids.shape[1]
        amount = mx.array([a + [0.0] * (width - len(a)) for a in amounts], mx.float32)
        batch = mx.arange(len(rows))[:, None]
        x = x.at[batch, ids].add(-amount)
    return x


def _masked(x: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    if all(r.mask is None for r in rows):
        return x
    vocab = x.shape[-1]
    words = (vocab + 31) // 32
    packed = np.full((len(rows), words), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        if r.mask is not None:
            packed[i, : r.mask.shape[0]] = r.mask[:words]
    bits = (mx.array(packed)[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(len(rows), words * 32)[:, :vocab]
    return mx.where(allowed.astype(mx.bool_), x, -mx.inf)


def _gumbel(rows: Sequence[RowSampling], width: int) -> mx.array:
    """Per-row Gumbel noise from each row's own key."""
    return mx.stack(
        [mx.random.gumbel(shape=(width,), key=mx.random.key(r.seed)) for r in rows], axis=0
    )


def _filtered_draw(scaled: mx.array, rows: Sequence[RowSampling]) -> mx.array:
    """Sample among the most likely candidates, after top_k, top_p and min_p."""
    vocab = scaled.shape[-1]
    count = min(vocab, max([CANDIDATES] + [r.top_k for r in rows]))
    if count < vocab:
        ids = mx.argpartition(-scaled, kth=count - 1, axis=-1)[:, :count]
    else:
        ids = mx.broadcast_to(mx.arange(vocab)[None], scaled.shape)
    values = mx.take_along_axis(scaled, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    values = mx.take_along_axis(values, order, axis=-1)
    probs = mx.softmax(values, axis=-1)
    rank = mx.arange(count)[None]
    top_k = mx.array([[r.top_k or count] for r in rows])
    top_p = mx.array([[r.top_p] for r in rows], mx.float32)
    min_p = mx.array([[r.min_p] for r in rows], mx.float32)
    keep = (rank < top_k) & (mx.cumsum(probs, axis=-1) - probs < top_p)
    keep = keep & (probs >= min_p * probs[:, :1])
    kept = mx.where(keep, values, -mx.inf)
    choice = mx.argmax(kept + _gumbel(rows, count), axis=-1)
    return mx.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def sample(logits: mx.array, rows: Sequence[RowSampling]) -> Sampled:
    """Sample one token per row of `logits` [B, V] (raw, as the model gave them)."""
    x = _masked(_penalize(logits.astype(mx.float32), rows), rows)
    # Extreme penalties can overflow; keep the order of what is left finite.
    x = mx.where(mx.isnan(x), -mx.inf, x)
    x = mx.minimum(x, mx.finfo(mx.float32).max)
    tokens = mx.argmax(x, axis=-1)
    drawn = [r.temperature > 0 for r in rows]
    if any(drawn):
        temperature = mx.array([[r.temperature if r.temperature > 0 else 1.0] for r in rows])
        scaled = x / temperature
        draws = tokens
        filtered = [r.filters for r in rows]
        if any(d and not f for d, f in zip(drawn, filtered, strict=True)):
            draws = mx.argmax(scaled + _gumbel(rows, x.shape[-1]), axis=-1)
        if any(d and f for d, f in zip(drawn, filtered, strict=True)):
            chosen = _filtered_draw(scaled, rows)
            draws = mx.where(mx.array(filtered), chosen, draws)
        tokens = mx.where(mx.array(drawn), draws, tokens)
    tokens = tokens.astype(mx.int32)
    if all(r.logprobs < 0 for r in rows):
        return Sampled(tokens)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen_lp = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top = max(r.logprobs for r in rows)
    if top <= 0:
        return Sampled(tokens, chosen_lp)
    top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
    order = mx.argsort(-top_values, axis=-1)
    return Sampled(
        tokens,
        chosen_lp,
        mx.take_along_axis(top_ids, order, axis=-1).astype(mx.int32),
        mx.take_along_axis(top_values, order, axis=-1),
    )
