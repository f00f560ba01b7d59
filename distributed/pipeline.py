"""Pipeline parallelism for every registered family: one contiguous range of layers per rank.

Rank 0 embeds the tokens and runs the first layers, each later rank receives the hidden
state from its left ring neighbour and sends its own to the right; the last stage
applies the final norm to the last position (the last few in a speculative step,
distributed/head_positions.py) and sends the result back to rank 0 (its
right ring neighbour): logits when it holds an untied head, else the normed hidden state,
to which rank 0 applies the tied embedding head. Every rank returns logits shaped
[B, 1, V], correct on rank 0 only (zeros elsewhere). Masks and caches follow the family's own
forward (distributed/families): one shared mask, one per window kind (sliding-window layers
keep a RotatingKVCache), or a boolean array (deepseek_v3's MLA applies it with mx.where).

Families whose mlx-lm model has `pipeline()` (families/mlx_lm_sharded.py) run it instead
(MlxLmPipeline): the family's forward keeps its own masks and caches; the last rank runs
the first layers, rank 0 the last ones, and every rank gets rank 0's hidden state through
an all_gather (mlx-lm's collectives use the global group, which is ours) and applies the
head.

Each call evaluates its own sends and receives before it returns. Ranks run different
graphs, and a point-to-point stream carries no message boundaries: if a caller queued
several lazy calls (a decode step and prefill chunks) and evaluated them together, the
receives could run in another order than the sends and read each other's bytes. One
exception keeps that order: within `results_later()` (a step of the engine) rank 0 takes
a forward's result back from the last stage only before its next send or at the scope's
end, so it computes a prompt chunk's first layers while the later stages finish the
answers' decode, where it waited idle before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

from distributed.families import registered
from distributed.head_positions import tail
from distributed.plan import Plan
from distributed.prefill_pieces import prefill_pieces
from distributed.shares import split
from distributed.watchdog import EvalGuard, guarded_eval


class PipelineStage(nn.Module):
    """This rank's stage of a registered family's model, called like an mlx-lm model."""

    def __init__(self, model: nn.Module, plan: Plan, group: mx.distributed.Group):
        super().__init__()
        if plan.strategy != "pipeline" or group.size() != plan.world_size:
            raise ValueError(f"not a pipeline plan for {group.size()} ranks: {plan.strategy}")
        inner = model.model
        self.args = model.args
        self.model_type = getattr(model, "model_type", plan.shape.model_type)
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        share = plan.ranks[self.rank]
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.tied = plan.shape.tie_word_embeddings
        self.vocab_size = plan.shape.vocab_size
        self.hidden_size = plan.shape.hidden_size
        embed = inner.embed_tokens
        # Every stage must agree on the dtype of the hidden state it sends and receives: the
        # final norm's (never quantized; an mxfp4 embedding's scales are uint8).
        self.hidden_dtype = inner.norm.weight.dtype
        family = registered(plan.shape.model_type)
        self.mask_kind = family.mask if family is not None else "shared"
        self.sliding_window = plan.shape.sliding_window
        start, end = share.layers
        self.layers = inner.layers[start:end]
        self.sliding = [i in plan.shape.sliding_layers for i in range(start, end)]
        # Families mlx-lm splits keep the caches their own make_cache builds (longcat_flash:
        # two per layer, in a CacheList).
        self._family_caches = model.make_cache if family and family.via_mlx_lm else None
        self.local = slice(start, end)
        if share.embeddings:
            self.embed_tokens = embed
        if self.last:
            self.norm = inner.norm
        if share.head and not self.tied:
            self.lm_head = model.lm_head
        # Optional `guard(what)` context manager (a collective watchdog) around each wait.
        self.eval_guard: EvalGuard | None = None
        self._later = False  # within results_later()
        self._pending: list[mx.array] = []  # rank 0's results not yet taken back, in order

    @contextmanager
    def results_later(self) -> Iterator[None]:
        """Within: rank 0 takes each forward's result back from the last stage when it
        must (before its next send, at the end), not at the end of the call."""
        self._later = True
        try:
            yield
        except BaseException:
            self._pending = []  # a failed step: nothing of it is read again
            raise
        finally:
            self._later = False
        self._take_back()

    def _take_back(self) -> None:
        for result in self._pending:
            self._eval(result, "pipeline receive from the last stage")
        self._pending = []

    def make_cache(self) -> list[Any]:
        """One cache per local layer (a rotating one for sliding-window layers; for a family
        mlx-lm splits, what its own make_cache builds for these layers)."""
        if self._family_caches is not None:
            return self._family_caches()[self.local]
        return [
            RotatingKVCache(max_size=self.sliding_window) if sliding else KVCache()
            for sliding in self.sliding
        ]

    def _run_layers(self, h: mx.array, cache: list[Any]) -> mx.array:
        masks: dict[bool, Any] = {}
        for layer, layer_cache, sliding in zip(self.layers, cache, self.sliding, strict=True):
            if sliding not in masks:
                window = self.sliding_window if sliding else None
                # A CacheList's first cache is the layer's attention cache (longcat_flash).
                first = layer_cache[0] if isinstance(layer_cache, CacheList) else layer_cache
                masks[sliding] = create_attention_mask(
                    h, first, window_size=window, return_array=self.mask_kind == "array"
                )
            h = layer(h, masks[sliding], layer_cache)
        return h

    def _head(self, h: mx.array) -> mx.array:
        if self.tied:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def _eval(self, array: mx.array, what: str) -> None:
        guarded_eval(array, self.eval_guard, what)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **_: Any) -> mx.array:
        batch, length = inputs.shape[:2]
        cache = cache if cache is not None else [None] * len(self.layers)
        # Later stages never read the tokens; if they came from rank 0's broadcast,
        # evaluating them first keeps every rank in that collective before any rank blocks
        # in a receive.
        self._eval(inputs, "pipeline input")
        positions = tail()  # 1, or the positions a speculative step verifies
        # A long prefill streams through the stages in pieces (distributed/prefill_pieces.py);
        # every rank cuts the same pieces from the same shape.
        pieces = prefill_pieces(length, self.world) if positions == 1 else 1
        for start, end in split(length, [1.0] * pieces):  # as even as the tokens allow
            h = self._stage(inputs[:, start:end], cache)
            if end < length:  # an earlier piece: passed on (or, last, computed) now, so
                self._pass_on(h)  # this stage takes the next while the next stage takes it
        return self._last_piece(h, batch, positions)

    def _stage(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """This stage's layers over one piece: embedded here, or received from the left."""
        if self.first:
            h = self.embed_tokens(tokens)
        else:
            shape = (tokens.shape[0], tokens.shape[1], self.hidden_size)
            h = mx.distributed.recv(shape, self.hidden_dtype, self.rank - 1, group=self.group)
        return self._run_layers(h, cache)

    def _pass_on(self, h: mx.array) -> None:
        if self.last:
            self._eval(h, "pipeline piece")
            return
        if self._pending:  # this stage's layers first, while the last stage ends its forward
            self._eval(h, "pipeline stage")
            self._take_back()  # then its result, before this stream's next bytes
        sent = mx.distributed.send(h.astype(self.hidden_dtype), self.rank + 1, group=self.group)
        self._eval(sent, "pipeline send")

    def _last_piece(self, h: mx.array, batch: int, positions: int) -> mx.array:
        logits_shape = (batch, positions, self.vocab_size)
        if self.last:
            out = self.norm(h[:, -positions:, :])
            if not self.tied:
                out = self.lm_head(out)
            sent = mx.distributed.send(out.astype(mx.float32), 0, group=self.group)
            self._eval(sent, "pipeline send to rank 0")
            return mx.zeros(logits_shape)
        self._pass_on(h)
        if not self.first:
            return mx.zeros(logits_shape)
        width = self.hidden_size if self.tied else self.vocab_size
        shape = (batch, positions, width)
        back = mx.distributed.recv(shape, mx.float32, self.world - 1, group=self.group)
        logits = self._head(back.astype(self.hidden_dtype)) if self.tied else back
        if self._later:
            self._pending.append(logits)
        else:
            self._eval(logits, "pipeline receive from the last stage")
        return logits


class MlxLmPipeline(nn.Module):
    """This rank's layers of a family split by mlx-lm's own pipeline(), called like an
    mlx-lm model: returns the last position's logits [B, 1, V], correct on every rank."""

    def __init__(self, model: nn.Module, plan: Plan, group: mx.distributed.Group):
        super().__init__()
        if not plan.via_mlx_lm or plan.strategy != "pipeline":
            raise ValueError(f"not a plan for mlx-lm's pipeline(): {plan.strategy}")
        if group.size() != plan.world_size:
            raise ValueError(f"a plan for {plan.world_size} ranks, the group has {group.size()}")
        counts = [end - start for start, end in (share.layers for share in plan.ranks)]
        model.model.pipeline(group, split=counts)
        self.wrapped = model
        self.eval_guard: EvalGuard | None = None

    @property
    def layers(self) -> list[nn.Module]:
        return self.wrapped.layers

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.wrapped)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **_: Any) -> mx.array:
        # As in PipelineStage: the tokens first (they may come from rank 0's broadcast), then
        # this call's receive, send and all_gather, before another call queues its own.
        guarded_eval(inputs, self.eval_guard, "pipeline input")
        logits = self.wrapped(inputs, cache=cache)[:, -tail() :, :]
        guarded_eval(logits, self.eval_guard, "pipeline step")
        return logits
