"""RoPE without slices, for the compiled decode step's shapeless trace on MLX's CPU backend.

The compiled decode step is traced once per batch size and width, whatever the length of
the cache buffers (a shapeless `mx.compile`, engine/compiled_decode.py). A shapeless trace
infers every operation's output shape from its inputs again at each call, and a slice
cannot ("Slice cannot infer output shapes"). On the CPU, mx.fast.rope is built from
slices: the halves of the rotated dimensions cut out, turned and joined again. Here the
same rotation is `a * cos + (a @ turn) * sin`, where `turn` is a constant D x D matrix of 0
and +-1 that moves each rotated dimension onto its pair (so `a @ turn` is exact), and cos
and sin are 1 and 0 on the dimensions left as they are; the angles are computed as MLX
computes them, so the result is MLX's to the bit. Inside `traced()` it stands in for
mx.fast.rope, which every mlx-lm family calls. On Metal and CUDA mx.fast.rope is one
kernel of its own and stays.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np


@contextmanager
def traced() -> Iterator[None]:
    """mx.fast.rope is `rope` inside this block (a trace: the graph is built here)."""
    before, mx.fast.rope = mx.fast.rope, rope
    try:
        yield
    finally:
        mx.fast.rope = before


def _turn(depth: int, dims: int, traditional: bool) -> np.ndarray:
    """[depth, depth]: (a @ turn)[j] is -a[pair of j] for the first of a pair, +a[pair of j]
    for the second, 0 past `dims`. Pairs: (i, i + dims/2), or (2i, 2i + 1) traditionally."""
    turn = np.zeros((depth, depth), dtype=np.float32)
    half = dims // 2
    for i in range(half):
        first, second = (2 * i, 2 * i + 1) if traditional else (i, i + half)
        turn[second, first] = -1.0
        turn[first, second] = 1.0
    return turn


def _spread(depth: int, dims: int, traditional: bool) -> np.ndarray:
    """[dims / 2, depth]: frequency i to the two dimensions of pair i (a product, not a
    gather: the trace stays shapeless); the dimensions past `dims` get none."""
    half = dims // 2
    spread = np.zeros((half, depth), dtype=np.float32)
    for i in range(half):
        for j in (2 * i, 2 * i + 1) if traditional else (i, i + half):
            spread[i, j] = 1.0
    return spread


def rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    """mx.fast.rope's result for `a` [B, *, L, D], without a slice (a stream is ignored:
    the trace runs on the default one)."""
    depth, length = a.shape[-1], a.shape[-2]
    if freqs is not None:
        inverse = 1.0 / freqs.astype(mx.float32)
    else:
        assert base is not None
        # as MLX computes it: its angles exactly, and past a few thousand positions the
        # angles' rounding is what tells two forms apart
        half = dims // 2
        inverse = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(base) / half))
    start = mx.array(offset) if isinstance(offset, int) else offset
    # positions [L] or, with an offset per row, [B, 1, ..., L]
    positions = start.astype(mx.float32).reshape(-1, *([1] * (a.ndim - 2))) + mx.arange(length)
    if start.size == 1:
        positions = positions.reshape(length)
    frequencies = inverse @ mx.array(_spread(depth, dims, traditional))
    angles = (positions * scale)[..., None] * frequencies
    cos, sin = mx.cos(angles).astype(a.dtype), mx.sin(angles).astype(a.dtype)
    turn = mx.array(_turn(depth, dims, traditional), dtype=a.dtype)
    return a * cos + (a @ turn) * sin
