"""Every rank's part of the prefix cache: the KV of each cached entry for this rank's own
heads (tensor parallel) or layers (pipeline), keyed by the entry ids rank 0 hands out.

Entries are immutable. A request that reuses entry E for n tokens starts from fresh
caches holding slices of E's arrays (slicing makes new arrays, so its own appends never
touch E), which is why cancelling such a request leaves E intact. Only plain KV caches
are cached (mlx-lm's KVCache, which also holds MLA's latent keys, or with KV_CACHE_BITS its
QuantizedKVCache, whose keys and values are triples); a model whose caches
are of another kind (sliding windows' rotating buffers, recurrent state) runs without
the prefix cache, and the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from distributed.memory import KV_GROUP_SIZE
from engine.prefix_disk import DiskTier
from engine.quantized_kv import make_caches

log = logging.getLogger("ring.prefix")
# keys, values: [1, heads, length, dims], or with KV_CACHE_BITS (packed, scales, biases)
LayerKV = tuple[Any, Any]


def plain_kv(caches: Sequence[Any]) -> bool:
    """True when every layer's cache is a plain KVCache or QuantizedKVCache (the kinds this
    store can slice)."""
    return all(type(cache) in (KVCache, QuantizedKVCache) for cache in caches)


def kv_bytes_per_token(
    model: Callable[..., mx.array],
    group: mx.distributed.Group | None = None,
    bits: int | None = None,
) -> int:
    """Bytes of KV this rank keeps per cached token, from a one-token forward (every rank
    must call it together: the forward holds the collectives); 0 on every rank when any
    rank's caches are not plain KV caches (a pipeline stage may hold only sliding-window
    layers while the next holds only full ones: the ranks agree through `group`). `bits`:
    KV_CACHE_BITS, already checked against the model."""
    caches = make_caches(model, bits)
    mine = plain_kv(caches)
    refusals = 0 if mine else 1
    if group is not None and group.size() > 1:
        votes = mx.distributed.all_sum(mx.array([refusals]), group=group)
        refusals = int(np.array(votes).sum())
    if refusals:
        kinds = ", ".join(sorted({type(cache).__name__ for cache in caches}))
        log.info(
            "prefix cache off: %d rank(s) keep caches other than KVCache (this rank: %s)",
            refusals,
            kinds or "none",
        )
        return 0
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=caches))
    return _nbytes(_layers(caches, 1))


def budget_tokens(per_rank: list[tuple[int, int]]) -> int:
    """Tokens every rank can cache, from each rank's (budget bytes, KV bytes per token);
    0 when a rank keeps no prefix cache."""
    if not per_rank or any(per_token <= 0 for _, per_token in per_rank):
        return 0
    return min(budget // per_token for budget, per_token in per_rank)


def _layers(caches: Sequence[Any], length: int) -> list[LayerKV]:
    """Each layer's first `length` positions, as arrays of their own."""
    return [
        tree_map(lambda x: mx.contiguous(x[..., :length, :]), (c.keys, c.values)) for c in caches
    ]


def _nbytes(layers: list[LayerKV]) -> int:
    return int(tree_reduce(lambda total, x: total + x.nbytes, layers, 0))


class PrefixStore:
    """Cached entries on this rank: entry id -> per-layer (keys, values)."""

    def __init__(self, bits: int | None = None, disk: DiskTier | None = None) -> None:
        self.bits = bits  # KV_CACHE_BITS: entries hold quantized triples
        self.disk = disk  # PREFIX_CACHE_DIR's tier, when on
        self.entries: dict[int, list[LayerKV]] = {}
        self.nbytes = 0  # of every entry's arrays on this rank
        self.loaded: list[tuple[int, int, bool]] = []  # the last plan's (entry, key, ok)

    def length(self, entry: int) -> int:
        keys = self.entries[entry][0][0]
        return int((keys[0] if isinstance(keys, tuple) else keys).shape[2])

    def put(self, entry: int, caches: Sequence[Any], length: int) -> list[mx.array]:
        """Keep the first `length` positions of a sequence's per-layer caches as `entry`;
        returns the new arrays (to evaluate with the step)."""
        layers = _layers(caches, length)
        self.drop(entry)
        self.entries[entry] = layers
        self.nbytes += _nbytes(layers)
        arrays: list[mx.array] = tree_reduce(lambda out, x: [*out, x], layers, [])
        return arrays

    def apply_disk(
        self, saves: list[tuple[int, int]], loads: list[tuple[int, int, int]], drops: list[int]
    ) -> None:
        """A plan's disk operations (engine/prefix_disk.py). A load that failed on any rank
        leaves no entry on any rank; `loaded` says which did."""
        self.loaded = []
        if self.disk is None:
            if loads:  # a rank without the tier still votes: it has none of them
                self.loaded = [(e, k, False) for e, k, _ in loads]
            return
        for entry, key in saves:
            if entry in self.entries:
                self.disk.save(key, self.entries[entry], self.length(entry))
        results = self.disk.load_all([(key, length) for _, key, length in loads])
        for (entry, key, _), layers in zip(loads, results, strict=True):
            if layers is not None:
                self.drop(entry)
                self.entries[entry] = layers
                self.nbytes += _nbytes(layers)
            self.loaded.append((entry, key, layers is not None))
        for key in drops:
            self.disk.drop(key)

    def close(self) -> None:
        """A clean stop: the disk tier finishes its queued saves."""
        if self.disk is not None:
            self.disk.close()

    def drop(self, entry: int) -> None:
        layers = self.entries.pop(entry, None)
        if layers is not None:
            self.nbytes -= _nbytes(layers)

    def caches(self, entry: int, length: int) -> list[KVCache | QuantizedKVCache]:
        """Fresh caches holding the first `length` positions of `entry`."""
        fresh: list[KVCache | QuantizedKVCache] = []
        for keys, values in self.entries[entry]:
            cache = KVCache() if self.bits is None else QuantizedKVCache(KV_GROUP_SIZE, self.bits)
            cache.keys, cache.values = tree_map(lambda x: x[..., :length, :], (keys, values))
            cache.offset = length
            fresh.append(cache)
        return fresh

    def digest(self) -> list[tuple[int, int]]:
        """(entry, length) pairs, sorted: what the batch fingerprint covers."""
        return sorted((entry, self.length(entry)) for entry in self.entries)
