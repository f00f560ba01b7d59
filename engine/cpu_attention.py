"""Attention for MLX's CPU backend: the same result as mx.fast.scaled_dot_product_attention,
faster there at long contexts.

On the CPU, MLX's fused attention runs one small matmul per query head and a scalar exp;
at a long context that made attention most of the time a token takes (docs/BENCHMARKS.md,
"Figures behind the code"). Here:
- grouped-query heads fold into the rows of one matmul per KV head;
- the softmax's exponential is 2^(x log2 e) through mx.power, which MLX's CPU backend
  vectorizes: faster than mx.exp, and as accurate;
- masked scores are float32's lowest value, not -inf, so a row with nothing to attend to
  (a left-padded position) averages instead of turning into NaN.

`install()` puts it in place of mx.fast.scaled_dot_product_attention, which every mlx-lm
family calls through mlx_lm.models.base, when the ranks compute on the CPU; on Metal and
CUDA the fused kernel stays. Attention sinks (gpt-oss) keep MLX's own kernel.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

LOG2E = 1.4426950408889634
# Scores one block of query rows holds (per batch row, all heads). A 2,048-token chunk
# against a long cache would otherwise hold 2048 x L x heads float32 scores a layer; a long
# prompt prefilled fastest in chunks of 2,048 in blocks of 2^20 scores, ahead of larger
# blocks and of unblocked smaller chunks (docs/BENCHMARKS.md, "Figures behind the code").
SCORE_ELEMENTS = 1 << 20
_mlx_attention = mx.fast.scaled_dot_product_attention


def grouped_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    sinks: mx.array | None = None,
    force_fused: bool = False,
    stream: Any = None,
) -> mx.array:
    """softmax(q k^T * scale + mask) v for q [B, H, N, D], k [B, KV, L, D], v [B, KV, L, Dv];
    mask None, "causal", a boolean (True: attend) or an additive array broadcasting to
    [B, H, N, L]. Sinks, a stream or force_fused: MLX's own kernel. A long chunk of queries
    is taken in blocks of rows (see SCORE_ELEMENTS)."""
    if sinks is not None or stream is not None or force_fused or q.shape[1] % k.shape[1]:
        return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, force_fused=force_fused)
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}: None, 'causal' or an array")
    batch, heads, n, _ = q.shape
    length = k.shape[2]
    block = max(1, SCORE_ELEMENTS // (heads * length))
    if n <= block:
        return _attend(q, k, v, scale, mask)
    if isinstance(mask, mx.array):
        mask = mx.broadcast_to(mask, (*mask.shape[:-2], n, length))
    outputs = []
    for start in range(0, n, block):
        end = min(n, start + block)
        if mask is None or isinstance(mask, mx.array):
            rows = None if mask is None else mask[..., start:end, :]
            outputs.append(_attend(q[:, :, start:end], k, v, scale, rows))
        else:  # causal: the block sees the keys up to its last row
            seen = length - n + end
            outputs.append(_attend(q[:, :, start:end], k[:, :, :seen], v[:, :, :seen], scale, mask))
    return mx.concatenate(outputs, axis=2)


def _attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None
) -> mx.array:
    """One block: the query heads of a KV head folded into the rows of one product."""
    batch, heads, n, _ = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # [B, KV, G*N, D]: the G query heads sharing a KV head are consecutive
    folded = (q * scale).reshape(batch, kv_heads, group * n, q.shape[-1])
    scores = (folded @ k.swapaxes(-1, -2)).astype(mx.float32)
    if isinstance(mask, str):
        visible = mx.arange(length - n, length)[:, None] >= mx.arange(length)[None]
        scores = _apply(scores, mx.tile(visible, (group, 1)))
    elif mask is not None:
        full = mx.broadcast_to(mask, (batch, heads, n, length))
        scores = _apply(scores, full.reshape(batch, kv_heads, group * n, length))
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = mx.power(2.0, shifted * LOG2E)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    out = weights.astype(v.dtype) @ v
    return out.reshape(batch, heads, n, v.shape[-1])


def _apply(scores: mx.array, mask: mx.array) -> mx.array:
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(mx.float32).min)
    return scores + mask.astype(mx.float32)


def on_cpu_backend() -> bool:
    """Whether this process's MLX computes on the CPU (no GPU): the kernel here, and the
    leader's streaming order (leader/loop.py), are for that case."""
    return mx.default_device() == mx.cpu


def install() -> bool:
    """Use grouped_attention on the CPU backend; True when installed."""
    if not on_cpu_backend():
        return False
    mx.fast.scaled_dot_product_attention = grouped_attention
    return True
