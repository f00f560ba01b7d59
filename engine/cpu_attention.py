"""Attention for MLX's CPU backend: the same result as mx.fast.scaled_dot_product_attention,
two to three times faster there at long contexts.

On the CPU, MLX's fused attention runs one small matmul per query head and a scalar exp;
at a 1,600-token context that made attention most of the time a token takes (SmolLM2,
30 layers: 1.4 ms a layer to decode one token, 11 ms for a 22-token prompt suffix). Here:
- grouped-query heads fold into the rows of one matmul per KV head (1.4 -> 0.5 ms);
- the softmax's exponential is 2^(x log2 e) through mx.power, which MLX's CPU backend
  vectorizes: 2.4x faster than mx.exp on this machine, as accurate (3.7e-6 relative, both);
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
    [B, H, N, L]. Sinks, a stream or force_fused: MLX's own kernel."""
    if sinks is not None or stream is not None or force_fused or q.shape[1] % k.shape[1]:
        return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, force_fused=force_fused)
    batch, heads, n, _ = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # [B, KV, G*N, D]: the G query heads sharing a KV head are consecutive
    folded = (q * scale).reshape(batch, kv_heads, group * n, q.shape[-1])
    scores = (folded @ k.swapaxes(-1, -2)).astype(mx.float32)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}: None, 'causal' or an array")
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
    leader's streaming order (engine/leader.py), are for that case."""
    return mx.default_device() == mx.cpu


def install() -> bool:
    """Use grouped_attention on the CPU backend; True when installed."""
    if not on_cpu_backend():
        return False
    mx.fast.scaled_dot_product_attention = grouped_attention
    return True
