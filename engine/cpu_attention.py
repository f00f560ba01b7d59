"""Attention for MLX's CPU backend: the same result as mx.fast.scaled_dot_product_attention,
faster there at long contexts.

On the CPU, MLX's fused attention runs one small matmul per query head and a scalar exp;
at a long context that made attention most of the time a token takes (docs/BENCHMARKS.md,
"Figures behind the code"). Here:
- grouped-query heads fold into the rows of one matmul per KV head;
- the softmax's exponential is 2^(x log2 e): through mx.power eagerly (2.4x faster than
  mx.exp there), and in a compiled step (`compiled_step`, engine/compiled_decode.py) by
  `exp2` below, from arithmetic and the float's bits, which compiles into loops without
  calls where MLX's CPU backend calls the C library's powf once per score; eagerly its
  dozen operations are a dozen passes, slower than powf's one;
- masked scores are float32's lowest value, not -inf, so a row with nothing to attend to
  (a left-padded position) averages instead of turning into NaN.

`install()` puts it in place of mx.fast.scaled_dot_product_attention, which every mlx-lm
family calls through mlx_lm.models.base, when the ranks compute on the CPU; on Metal and
CUDA the fused kernel stays. Attention sinks (gpt-oss) keep MLX's own kernel.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

LOG2E = 1.4426950408889634
LOWEST = float(mx.finfo(mx.float32).min)  # a masked score
# 1.5 * 2^23: a float32 sum with it keeps x rounded to an integer in its mantissa's low bits
ROUNDER = 12582912.0
# 2^f = e^(f ln 2) for f in [-1/2, 1/2]: the Taylor terms (ln 2)^k / k! to the 6th, whose
# remainder (0.35^7 / 7!, 1.2e-7) is about float32's rounding
EXP2_TERMS = tuple(math.log(2) ** k / math.factorial(k) for k in range(7))
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
    # in log2 units, for exp2 below
    scores = (folded @ k.swapaxes(-1, -2)).astype(mx.float32) * LOG2E
    if isinstance(mask, str):
        visible = mx.arange(length - n, length)[:, None] >= mx.arange(length)[None]
        scores = _apply(scores, mx.tile(visible, (group, 1)))
    elif mask is not None:
        full = mx.broadcast_to(_in_log2_units(mask), (batch, heads, n, length))
        scores = _apply(scores, full.reshape(batch, kv_heads, group * n, length))
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = exp2(shifted) if _compiling else mx.power(2.0, shifted)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    out = weights.astype(v.dtype) @ v
    return out.reshape(batch, heads, n, v.shape[-1])


_compiling = False


@contextmanager
def compiled_step() -> Iterator[None]:
    """Around the trace of a compiled step: attention's exponential is `exp2` there."""
    global _compiling
    before, _compiling = _compiling, True
    try:
        yield
    finally:
        _compiling = before


def exp2(x: mx.array) -> mx.array:
    """2^x for float32 x <= 0 (a softmax's shifted scores), as accurate as mx.power (within
    3e-7 of the exact value, relative); 0 below about -126.5, where float32's normal numbers
    end. 2^x = 2^i 2^f with i = round(x): a polynomial gives 2^f, and 2^i is the float whose
    exponent bits are i + 127. Compiled, it is a few loops of arithmetic: the exponential over
    a 9-position step's scores (30 layers at a 600-token context) took 10-20 ms through
    mx.power, which MLX's compiled CPU loop runs as a call to the C library's powf per
    score, 30 through mx.exp, and 4.3 so (docs/BENCHMARKS.md, "Figures behind the code")."""
    x = mx.maximum(x, -127.0)
    whole = (x + ROUNDER) - ROUNDER
    f = x - whole
    # Estrin's scheme, not Horner's: MLX fuses a chain of at most 11 operations into one
    # compiled loop, and Horner's 12 split it in two
    c = EXP2_TERMS
    f2 = f * f
    power = (c[0] + c[1] * f + f2 * (c[2] + c[3] * f)) + (f2 * f2) * (c[4] + c[5] * f + f2 * c[6])
    # below -126.5 the exponent's bits are 0: the float 0
    exponent = (whole.astype(mx.int32) + 127) * (1 << 23)
    return power * mx.view(exponent, mx.float32)


def _in_log2_units(mask: mx.array) -> mx.array:
    """A boolean mask as it is; an additive one scaled as the scores are, before it is
    broadcast over the heads. Its float32 lowest (a padded position's) must not become
    -inf, or a row with nothing visible would turn into NaN."""
    if mask.dtype == mx.bool_:
        return mask
    return mx.maximum(mask.astype(mx.float32) * LOG2E, LOWEST)


def _apply(scores: mx.array, mask: mx.array) -> mx.array:
    """`mask` boolean, or additive in log2 units."""
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, LOWEST)
    return scores + mask


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
