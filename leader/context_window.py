"""The context (MAX_SEQUENCE_LENGTH): the longest prompt plus answer rank 0 admits.

By default it is the model's own (its config's positions, extended by rope scaling),
lowered only where the ranks' memory cannot hold MAX_BATCH_SIZE sequences that long; a set
MAX_SEQUENCE_LENGTH is taken as it is. A request's KV grows with its tokens (mlx-lm's
caches grow in steps of 256 positions), so a long context reserves nothing: the memory
bound says only that a full batch of full-length answers would still fit beside each
rank's weights, prefix cache and runtime overhead (decode traces, MLX's buffer cache, a
step's buffers: distributed/overhead.py). Rank 0 holds a draft model's (DRAFT_MODEL)
weights and its rows' KV too, counted as the plan counts them.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from distributed.memory import longest_context
from distributed.model_shape import FALLBACK_CONTEXT, model_context
from ipc.status import RankStatus

log = logging.getLogger("ring.context")


def memory_context(
    ranks: list[RankStatus], sequences: int, draft: tuple[int, int] = (0, 0)
) -> tuple[int, RankStatus] | None:
    """The longest context at which every rank holds `sequences` full sequences' KV beside
    its weights, prefix cache and runtime overhead, and the rank that bounds it; None when
    a rank keeps caches whose size does not grow per token (kv_bytes_per_token 0: no
    bound known).
    `draft`: the draft model's weight bytes and KV bytes a token, on rank 0."""
    on_host = Counter(rank.host for rank in ranks)
    bounds = []
    for rank in ranks:
        share = rank.machine_memory_bytes // on_host[rank.host]
        weights, draft_per_token = draft if rank.rank == 0 else (0, 0)
        free = share - rank.weight_bytes - rank.prefix_cache_bytes - rank.overhead_bytes - weights
        # 0 stays 0 (no bound known); else the draft's rows grow with the served model's
        per_token = rank.kv_bytes_per_token and rank.kv_bytes_per_token + draft_per_token
        longest = longest_context(free, sequences, per_token)
        if longest is None:
            return None
        bounds.append((longest, rank))
    return min(bounds, key=lambda pair: pair[0]) if bounds else None


@dataclass(frozen=True)
class ContextChoice:
    tokens: int
    why: str  # one line for the log


def choose_context(
    setting: int | None,
    config: dict[str, Any],
    ranks: list[RankStatus],
    sequences: int,
    draft: tuple[int, int] = (0, 0),
) -> ContextChoice:
    """MAX_SEQUENCE_LENGTH as set, else the model's context bounded by the ranks' memory
    (`draft`: a draft model's weight bytes and KV bytes a token, which rank 0 holds too)."""
    model = model_context(config)
    if setting is not None:
        beyond = f" (beyond the model's {model} positions)" if model and setting > model else ""
        return ContextChoice(setting, f"{setting} tokens (MAX_SEQUENCE_LENGTH){beyond}")
    tokens = model or FALLBACK_CONTEXT
    why = f"{tokens} tokens, the model's own" if model else f"{tokens} tokens (model names none)"
    bound = memory_context(ranks, sequences, draft)
    if bound is not None and bound[0] < tokens:
        fits, rank = max(bound[0], 16), bound[1]  # 16: the settings' floor (the plan refuses
        # less than MIN_CONTEXT before loading: distributed/memory.py)
        beside = " and the draft model's" if rank.rank == 0 and any(draft) else ""
        return ContextChoice(
            fits,
            f"{fits} tokens, lowered from the model's {tokens}: rank {rank.rank} on "
            f"{rank.host} holds the KV of MAX_BATCH_SIZE={sequences} sequences{beside} only "
            "up to that length (set MAX_SEQUENCE_LENGTH, or a lower MAX_BATCH_SIZE, to choose)",
        )
    return ContextChoice(tokens, why)
