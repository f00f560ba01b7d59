"""Turning per-sequence mlx-lm caches into batch caches, for every cache kind a family uses.

KVCache merges into BatchKVCache, QuantizedKVCache (KV_CACHE_BITS) into
BatchQuantizedKVCache (engine/quantized_kv.py), RotatingKVCache (sliding windows) into
BatchRotatingKVCache, ArraysCache (recurrent state of linear attention) and CacheList
(an attention cache beside an indexer's) into themselves. Left padding is set through
`prepare` where the kind has it; ArraysCache's `prepare` takes lengths only, so its
padding is set directly (its mask reads `left_padding`). A speculative step's rejected
positions roll back in plain and quantized BatchKVCache layers only (`roll_back`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, QuantizedKVCache, dynamic_roll

from engine.quantized_kv import BatchQuantizedKVCache


def merged(per_sequence: Sequence[Sequence[Any]]) -> list[Any]:
    """Per layer, the sequences' caches merged into one batch cache."""
    return [_batch_kind(layer[0]).merge(list(layer)) for layer in zip(*per_sequence, strict=True)]


def _batch_kind(cache: Any) -> Any:
    return BatchQuantizedKVCache if isinstance(cache, QuantizedKVCache) else type(cache)


def left_pad(layers: Sequence[Any], padding: list[int]) -> None:
    """Mark the first `padding[i]` positions of row i as padding in every layer's cache."""
    for layer in layers:
        _pad(layer, padding)


def _pad(layer: Any, padding: list[int]) -> None:
    if isinstance(layer, ArraysCache):
        layer.left_padding = mx.array(padding)
    elif isinstance(layer, CacheList):
        for part in layer.caches:
            _pad(part, padding)
    elif isinstance(layer, BatchKVCache) and layer.keys is not None:
        # rows merged from cached prefixes (prepare() pads empty caches only): the padding
        # goes right after the positions merge() already padded, before the next write
        layer.left_padding = layer.left_padding + mx.array(padding)
        layer.offset = layer.offset - mx.array(padding)
    else:
        layer.prepare(left_padding=padding)


def roll_back(layers: Sequence[Any], drops: list[int]) -> None:
    """Drop the last `drops[i]` written positions of row i in every layer (the proposals a
    speculative step wrote and rank 0 did not accept). A BatchKVCache shares one write
    index across rows, so rows that drop more than the least are rolled right by the
    difference (their content now ends where the others' does; the roll brings unused
    buffer positions round to the left, marked as padding), then every row is trimmed by
    the least. Only plain BatchKVCache layers roll back: a rotating window may have
    overwritten what it would restore, and recurrent state cannot be unwound."""
    least = min(drops)
    shifts = mx.array([d - least for d in drops])
    uneven = least != max(drops)
    for layer in layers:
        if type(layer) not in (BatchKVCache, BatchQuantizedKVCache):
            raise TypeError(f"a {type(layer).__name__} cannot roll back positions")
        if uneven and layer.keys is not None:
            if isinstance(layer, BatchQuantizedKVCache):
                layer.roll(shifts)
            else:
                layer.keys = dynamic_roll(layer.keys, shifts[:, None], axis=2)
                layer.values = dynamic_roll(layer.values, shifts[:, None], axis=2)
            layer.left_padding = layer.left_padding + shifts
            layer.offset = layer.offset - shifts
        if least:
            layer.trim(least)


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array a sequence's caches hold (keys and values, recurrent state, indexers)."""
    arrays: list[tuple[str, object]] = tree_flatten([layer.state for layer in cache])  # type: ignore[assignment]
    return [array for _, array in arrays if isinstance(array, mx.array)]
