"""The KV cache in 8 or 4 bits (KV_CACHE_BITS): each sequence's QuantizedKVCache (mlx-lm's)
and the decode batch's BatchQuantizedKVCache (ours: mlx-lm has none).

Keys and values are kept as mx.quantize's (packed, scales, biases) triples in groups of
KV_GROUP_SIZE along the head dimension, the layout mlx-lm's QuantizedKVCache uses and
its attention (mlx_lm.models.base.quantized_scaled_dot_product_attention, chosen by the
cache's `bits`) reads. The batch cache is mlx-lm's BatchKVCache with every operation
applied to each array of the triple: the position axis is axis 2 in all three.

`agreed_bits` decides at start, on every rank together: a model whose caches are not all
plain KV caches (sliding windows, recurrent state, an indexer's cache: mlx-lm quantizes
none of them in a batch) or whose head dimension is not a multiple of the group keeps
float KV on every rank, and the log says why. `make_caches` gives a sequence's caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from distributed.memory import KV_GROUP_SIZE

Triple = tuple[mx.array, mx.array, mx.array]


def make_caches(model: Callable[..., Any], bits: int | None) -> list[Any]:
    """A sequence's fresh caches: the model's own, or QuantizedKVCache where `bits` (which
    `agreed_bits` has checked)."""
    caches = make_prompt_cache(model)
    if bits is None:
        return caches
    return [QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits) for _ in caches]


def refusal(caches: Sequence[Any]) -> str | None:
    """Why these caches (after a forward) cannot be quantized, or None."""
    kinds = sorted({type(cache).__name__ for cache in caches if type(cache) is not KVCache})
    if kinds:
        return (
            f"it needs plain KV caches, and this model keeps {', '.join(kinds)} "
            "(sliding windows, recurrent state or an indexer)"
        )
    dims = {x.shape[-1] for cache in caches for x in (cache.keys, cache.values)}
    bad = sorted(d for d in dims if d % KV_GROUP_SIZE)
    if bad:
        return (
            f"it quantizes in groups of {KV_GROUP_SIZE} along a KV head, and this model's "
            f"heads have {', '.join(map(str, bad))} dimensions"
        )
    return None


def agreed_bits(
    model: Callable[..., Any], bits: int | None, group: mx.distributed.Group | None
) -> tuple[int | None, str | None]:
    """KV_CACHE_BITS as every rank applies it, and why not where a rank refuses. Every rank
    must call it together (the probe's forward holds the collectives)."""
    if bits is None:
        return None, None
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=caches))
    why = refusal(caches)
    votes = 1 if why else 0
    if group is not None and group.size() > 1:
        votes = int(np.array(mx.distributed.all_sum(mx.array([votes]), group=group)).sum())
    if votes:
        return None, why or f"{votes} other rank(s) cannot quantize their KV"
    return bits, None


def _map(triple: Triple, fn: Callable[[mx.array], mx.array]) -> Triple:
    a, b, c = (fn(x) for x in triple)
    return a, b, c


def _positions(triple: Triple) -> int:
    return int(triple[0].shape[2])


def _empty(like: Triple, rows: int) -> Triple:
    return _map(like, lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype))


def _fit(triple: Triple, left: int, size: int) -> Triple:
    """`left` positions of padding before the content, cut or padded to `size` in all."""
    right = size - _positions(triple) - left
    if right < 0:
        triple = _map(triple, lambda x: x[..., :right, :])
        right = 0
    return _map(triple, lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]))


class BatchQuantizedKVCache(BatchKVCache):
    """BatchKVCache over quantized triples: the same padding, filtering, joining and
    extraction, each applied to the packed values and their scales and biases."""

    keys: Triple | None
    values: Triple | None
    offset: mx.array
    left_padding: mx.array
    _right_padding: mx.array | None
    _idx: int

    def __init__(self, left_padding: list[int], group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        new_k = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_v = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        prev, count = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + count > _positions(self.keys):
            steps = (self.step + count - 1) // self.step

            def grow(old: Triple | None, new: Triple) -> Triple:
                def one(index: int) -> mx.array:
                    part = new[index]
                    shape = (*part.shape[:2], steps * self.step, part.shape[3])
                    zeros = mx.zeros(shape, part.dtype)
                    if old is None:
                        return zeros
                    return mx.concatenate([old[index][..., :prev, :], zeros], axis=2)

                return one(0), one(1), one(2)

            self.keys, self.values = grow(self.keys, new_k), grow(self.values, new_v)
        self.offset = self.offset + count
        self._idx += count
        for stored, new in ((self.keys, new_k), (self.values, new_v)):
            for buffer, part in zip(stored, new, strict=True):
                buffer[..., prev : self._idx, :] = part
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        end = self._idx
        return _map(self.keys, lambda x: x[..., :end, :]), _map(
            self.values, lambda x: x[..., :end, :]
        )

    def finalize(self) -> None:
        if self._right_padding is not None and self.keys is not None and self.values is not None:
            padding = self._right_padding[:, None]
            self.keys = _map(self.keys, lambda x: dynamic_roll(x, padding, axis=2))
            self.values = _map(self.values, lambda x: dynamic_roll(x, padding, axis=2))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def roll(self, shifts: mx.array) -> None:
        """Roll each row right by its shift along the positions (engine/batch_caches.py)."""
        if self.keys is not None and self.values is not None:
            self.keys = _map(self.keys, lambda x: dynamic_roll(x, shifts[:, None], axis=2))
            self.values = _map(self.values, lambda x: dynamic_roll(x, shifts[:, None], axis=2))

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _map(self.keys, lambda x: x[batch_indices])
            self.values = _map(self.values, lambda x: x[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = int(np.array(self.left_padding).min())
        if least > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _map(self.keys, lambda x: x[..., least:, :])
                self.values = _map(self.values, lambda x: x[..., least:, :])
            self._idx -= least
            self.left_padding -= least

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        template = self if self.keys is not None else other
        assert template.keys is not None and template.values is not None
        end = max(self._idx, other._idx)
        size = max(_positions(c.keys) for c in (self, other) if c.keys is not None)

        def padded(cache: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            rows, left = cache.offset.shape[0], end - cache._idx
            stored = []
            for mine, like in ((cache.keys, template.keys), (cache.values, template.values)):
                assert like is not None
                stored.append(_fit(mine if mine is not None else _empty(like, rows), left, size))
            return stored[0], stored[1], cache.offset, cache.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = padded(self), padded(other)
        join = lambda a, b: (  # noqa: E731
            mx.concatenate([a[0], b[0]]),
            mx.concatenate([a[1], b[1]]),
            mx.concatenate([a[2], b[2]]),
        )
        self.keys, self.values = join(k1, k2), join(v1, v2)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = end

    def extract(self, idx: int) -> QuantizedKVCache:
        assert self.keys is not None and self.values is not None
        mx.eval(self.left_padding)
        start, end = int(np.array(self.left_padding)[idx]), self._idx
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys = _map(self.keys, lambda x: mx.contiguous(x[idx : idx + 1, :, start:end]))
        cache.values = _map(self.values, lambda x: mx.contiguous(x[idx : idx + 1, :, start:end]))
        cache.offset = end - start
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, first.group_size, first.bits)
        filled = [c for c in caches if c.keys is not None]
        if longest == 0 or not filled:
            return batch

        def stacked(part: Callable[[QuantizedKVCache], Triple]) -> Triple:
            like = part(filled[0])

            def one(index: int) -> mx.array:
                x = like[index]
                out = mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype)
                for row, (pad, cache) in enumerate(zip(padding, caches, strict=True)):
                    if cache.keys is not None:
                        written = part(cache)[index][..., : cache.offset, :]
                        out[row : row + 1, :, pad:longest] = written
                return out

            return one(0), one(1), one(2)

        batch.keys = stacked(lambda c: c.keys)
        batch.values = stacked(lambda c: c.values)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))
