"""Compiled decode: the decode batch's forward pass as one `mx.compile`d function.

A compiled function is traced once per input shape, so every input must keep its shape
from step to step. The decode batch's caches stay mlx-lm's BatchKVCache (joins, removals
and prefix stores work on them as before); for the step, each layer's key and value
buffers go into the compiled function whole, with the write position, the rows' RoPE
offsets and left padding as arrays:
- a layer writes the step's keys and values at the position with `slice_update`: one
  token a row, or a speculative step's next token and proposals (leader/speculation.py),
  the same width for every row;
- attention runs over the whole buffer, the mask hiding the left padding and what lies
  past each query's position (masked scores weigh exactly 0);
- buffers are kept at a multiple of STEP positions, so one trace serves a batch size for
  STEP tokens (a batch size is its own bucket: padding rows to a bucket would cost their
  whole forward on a CPU). STEP is 64, not BatchKVCache's 256: attention over unused
  positions is not free (a compiled step over 256 positions was slower than an eager one
  at a short context), and a new shape costs one trace and its kernels once.

It applies where every layer's decode cache is a plain BatchKVCache and nothing in the
forward evaluates (pipeline stages and expert routing do): elsewhere, and when a trace
fails, the step runs eagerly. Compiling fuses each layer's elementwise work (norms, RoPE,
the activation, the softmax), which on MLX's CPU backend is a kernel launch per operation:
a speculative step is faster compiled than eagerly, though dearer than a plain compiled
step (docs/BENCHMARKS.md, "Figures behind the code").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from distributed.head_positions import computing
from distributed.overhead import MAX_TRACES
from engine.cpu_attention import compiled_step

log = logging.getLogger(__name__)

STEP = 64  # positions a buffer grows by
# Each shape (rows, positions, buffer) is traced once, by an mx.compile of its own, and
# MLX keeps a trace as long as its function lives, each holding megabytes of this process's
# heap on the CPU. A long context and speculation's widths would make their number grow
# without bound, so at most MAX_TRACES are kept, the least recently used dropped first (a
# dropped shape that comes back is traced again). A dropped trace's memory stays resident
# in glibc's heaps until the rank gives their free pages back (engine/memory_report.py,
# every UPKEEP_S of work). The plan counts MAX_TRACES traces in each rank's memory
# (distributed/overhead.py, where MAX_TRACES is set; docs/BENCHMARKS.md, "Figures behind
# the code").


class _Slot:
    """One layer's cache as the traced forward sees it: whole buffers, array positions."""

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        position: mx.array,
        offset: mx.array,
        left_padding: mx.array,
    ) -> None:
        self.keys = keys
        self.values = values
        self.position = position  # [1]: where this step's first token goes
        self.offset = offset  # [B]: each row's RoPE position
        self.left_padding = left_padding  # [B]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.position, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.position, axes=(2,))
        return self.keys, self.values

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> mx.array:
        if window_size is not None:
            raise ValueError("a compiled decode step takes no sliding window")
        positions = mx.arange(self.keys.shape[2])
        queries = self.position + mx.arange(n)  # each query sees itself and what precedes it
        visible = (positions <= queries[:, None]) & (self.left_padding[:, None, None] <= positions)
        return visible[:, None, :, :]


def compilable(caches: Sequence[Any]) -> bool:
    """Whether a decode batch's caches take the compiled step: plain BatchKVCache layers
    (no sliding window, recurrent state or indexer), holding keys, with no right padding."""
    return all(
        type(cache) is BatchKVCache and cache.keys is not None and cache._right_padding is None
        for cache in caches
    )


def buffer_size(positions: int) -> int:
    """The buffer that holds `positions`: the least multiple of STEP (one trace a size)."""
    return -(-positions // STEP) * STEP


def _reserve(cache: BatchKVCache, positions: int) -> None:
    """Size a layer's buffers to `buffer_size(positions)` (the prefill and a removal leave
    other sizes; growing copies them once per STEP tokens)."""
    size = cache.keys.shape[2]
    wanted = buffer_size(positions)
    if wanted > size:
        pad = [(0, 0), (0, 0), (0, wanted - size), (0, 0)]
        cache.keys = mx.pad(cache.keys, pad)
        cache.values = mx.pad(cache.values, pad)
    elif wanted < size:
        cache.keys = cache.keys[..., :wanted, :]
        cache.values = cache.values[..., :wanted, :]


class CompiledDecode:
    """The decode step of `model`, compiled; `step` returns None where it does not apply."""

    def __init__(self, model: Callable[..., mx.array], max_traces: int = MAX_TRACES) -> None:
        self.model = model
        self.max_traces = max_traces
        self.dropped = 0  # traces dropped past max_traces
        self.enabled = True
        # (rows, positions, buffer) -> its compiled step, least recently used first
        self._traces: OrderedDict[tuple[int, int, int], Callable[..., list[mx.array]]] = (
            OrderedDict()
        )

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The shapes traced and kept, least recently used first."""
        return list(self._traces)

    def _forward(
        self,
        tokens: mx.array,
        position: mx.array,
        offset: mx.array,
        left_padding: mx.array,
        *buffers: mx.array,
    ) -> list[mx.array]:
        slots = [
            _Slot(buffers[i], buffers[i + 1], position, offset, left_padding)
            for i in range(0, len(buffers), 2)
        ]
        logits = self.model(tokens, cache=slots)[:, -tokens.shape[1] :, :]
        logits = logits.reshape(-1, logits.shape[-1])
        return [logits, *(array for slot in slots for array in (slot.keys, slot.values))]

    def step(self, tokens: mx.array, caches: list[Any]) -> mx.array | None:
        """The logits of one decode step over `caches` (updated in place as BatchKVCache
        would), rows x positions of `tokens` [rows, positions], row-major; or None: run
        this step eagerly."""
        if not self.enabled or not compilable(caches):
            return None
        first: BatchKVCache = caches[0]
        width = tokens.shape[1]
        for cache in caches:
            _reserve(cache, first._idx + width)
        shape = (tokens.shape[0], width, first.keys.shape[2])
        compiled = self._compiled(shape)
        buffers = [array for cache in caches for array in (cache.keys, cache.values)]
        position = mx.array([first._idx])
        try:
            # read while tracing; each width is its own trace
            with computing(width), compiled_step():
                logits, *updated = compiled(
                    tokens, position, first.offset, first.left_padding, *buffers
                )
        except Exception as exc:  # a family whose forward does not trace
            self.enabled = False
            self._traces.clear()
            log.warning("compiled decode off for this model (%s); decoding eagerly", exc)
            return None
        offset = first.offset + width  # every layer's is the same; arrays are never mutated
        for i, cache in enumerate(caches):
            cache.keys, cache.values = updated[2 * i], updated[2 * i + 1]
            cache.offset = offset
            cache._idx += width
        return logits

    def _compiled(self, shape: tuple[int, int, int]) -> Callable[..., list[mx.array]]:
        """The compiled step of `shape`, made (and traced at its first call) if new."""
        compiled = self._traces.get(shape)
        if compiled is not None:
            self._traces.move_to_end(shape)
            return compiled
        while len(self._traces) >= self.max_traces:
            self._traces.popitem(last=False)
            self.dropped += 1
        compiled = mx.compile(self._forward)
        self._traces[shape] = compiled
        log.debug("compiled decode: traced batch %d x %d positions over %d", *shape)
        return compiled
