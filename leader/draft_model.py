"""Rank 0's draft model (DRAFT_MODEL): greedy proposals for rows prompt lookup has none for.

A smaller model with the served model's tokenizer runs on rank 0 alone (no other rank loads
it or waits for it beyond the step it is planned in). Each row that asks keeps its own
draft KV cache (mlx-lm's `make_prompt_cache` of the draft: plain KV caches, which trim).
Per step the cache is brought to the row's history (prompt + generated, whose last token is
the one the step feeds): trimmed to its common prefix with what it consumed (the proposals
the served model rejected), then fed the rest, at most `chunk` tokens a forward (a long
prompt's first catch-up; a row that needs more than one chunk proposes from the next step
on, so one step never stalls the ranks for more than one chunk of the draft). The last
forward's logits give the first proposal; each further one takes one more forward of the
proposal before it, so k proposals cost k forwards. Proposals are the draft's argmax (a
point mass), so acceptance (leader/speculation.py) stays exact for greedy and sampled rows.

Rows draft one at a time (batch 1). Batching rows of different history lengths would need
the batch engine's padded caches and per-row rollback (engine/batch_caches.py); the rows
that reach the draft are those prompt lookup has nothing for, usually one agent's answer.

Loading refuses, with a one-line reason, a draft that cannot be resolved or loaded, whose
caches are not plain KV caches, or whose tokenizer differs from the served model's (the
vocabulary, end-of-text and beginning-of-text ids); the server then serves with prompt
lookup alone, the reason in the log and in /cluster/status (`speculation.draft_reason`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from acquisition.source import ModelSourceError, resolve_model
from config.settings import Settings
from distributed.memory import draft_bytes
from engine.last_logits import head_on_last_position

log = logging.getLogger("ring.speculation")

CHUNK = 2048  # the most tokens one catch-up forward takes (mlx-lm's own prefill step)
TIMED_TOKENS = 4  # forwards of at most this many tokens time a proposal (not a catch-up)
AVERAGE = 0.2  # weight of a new forward's time in the running average


class DraftError(Exception):
    """DRAFT_MODEL cannot be used; the message is one line: why, and what would work."""


def resolve_draft(settings: Settings) -> Path:
    """DRAFT_MODEL's MLX directory, resolved as MODEL is (acquisition/source.py)."""
    draft = settings.draft_model.strip()
    try:
        return resolve_model(settings.model_copy(update={"model": draft}))
    except ModelSourceError as exc:  # its words name MODEL: say DRAFT_MODEL
        text = str(exc).replace("MODEL=", "DRAFT_MODEL=")
        text = text.replace("empty for the default model", "empty for no draft model")
        prefix = "" if text.startswith("DRAFT_MODEL=") else f"DRAFT_MODEL={draft}: "
        raise DraftError(prefix + text) from None


def tokenizer_difference(served: TokenizerWrapper, draft: TokenizerWrapper) -> str | None:
    """How the draft's tokenizer differs from the served model's: None where they agree on
    every token's id and the end-of-text and beginning-of-text ids."""
    ours, theirs = served.get_vocab(), draft.get_vocab()
    if ours != theirs:
        moved = sum(1 for token in ours.keys() & theirs.keys() if ours[token] != theirs[token])
        return (
            f"the vocabularies differ ({len(ours)} and {len(theirs)} tokens: "
            f"{len(ours.keys() - theirs.keys())} only in the served model's, "
            f"{len(theirs.keys() - ours.keys())} only in the draft's, {moved} with other ids)"
        )
    if set(served.eos_token_ids) != set(draft.eos_token_ids):
        return (
            f"the end-of-text ids differ ({sorted(served.eos_token_ids)} and "
            f"{sorted(draft.eos_token_ids)})"
        )
    if served.bos_token_id != draft.bos_token_id:
        return f"the beginning-of-text ids differ ({served.bos_token_id} and {draft.bos_token_id})"
    return None


@dataclass
class _Row:
    cache: list[Any]
    consumed: list[int] = field(default_factory=list)  # the tokens the cache holds
    confirmed: int = 0  # of those, the leading ones taken from the row's history


@dataclass
class DraftModel:
    """A loaded draft and its rows' caches; `propose` gives a row's greedy continuation."""

    model: nn.Module
    name: str  # DRAFT_MODEL as set
    vocab: int  # proposals come from the served model's embedding rows only
    chunk: int = CHUNK
    token_ms: float = 0.0  # one proposal's forward, a running average (the per-step rule's)
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0  # a row's cache grows by this (the plan's figure)
    rows: dict[int, _Row] = field(default_factory=dict)

    def propose(self, seq_id: int, history: list[int], count: int) -> list[int]:
        """Up to `count` tokens the draft predicts greedily after `history`; none while the
        row's cache is still catching up with a long prompt (one chunk a step)."""
        if count <= 0 or not history:
            return []
        row = self.rows.get(seq_id)
        if row is None:
            row = self.rows[seq_id] = _Row(make_prompt_cache(self.model))
        # The history only grows, so what the cache took from it still holds: only the
        # proposals after it are compared (not the whole prompt again each step).
        limit = min(len(row.consumed), len(history) - 1)  # feed one token at least
        common = min(row.confirmed, limit)
        while common < limit and row.consumed[common] == history[common]:
            common += 1
        if len(row.consumed) > common:
            for cache in row.cache:
                cache.trim(len(row.consumed) - common)
            del row.consumed[common:]
        feed = history[common:]
        if len(feed) > self.chunk:
            self._forward(row, feed[: self.chunk])
            row.confirmed = len(row.consumed)
            return []
        proposals = [self._forward(row, feed)]
        row.confirmed = len(history)
        while len(proposals) < count:
            proposals.append(self._forward(row, proposals[-1:]))
        return proposals

    def _forward(self, row: _Row, tokens: list[int]) -> int:
        """Feed `tokens` to the row's cache; the draft's argmax after them."""
        started = time.perf_counter()
        logits = self.model(mx.array([tokens]), cache=row.cache)[0, -1, : self.vocab]
        token = int(mx.argmax(logits))
        row.consumed += tokens
        if len(tokens) <= TIMED_TOKENS:
            ms = (time.perf_counter() - started) * 1000
            self.token_ms += AVERAGE * (ms - self.token_ms) if self.token_ms else ms
        return token

    def forget(self, keep: Container[int]) -> None:
        """Drop the caches of rows not in `keep` (they left the batch)."""
        for seq_id in [s for s in self.rows if s not in keep]:
            del self.rows[seq_id]


def load_draft(
    settings: Settings,
    served_tokenizer: TokenizerWrapper,
    vocab: int,
    served_name: str,
    chunk: int = CHUNK,
) -> DraftModel:
    """DRAFT_MODEL loaded on this rank, checked against the served model's tokenizer and
    timed once (its one-token forward, the per-step rule's first figure); DraftError with
    the reason where it cannot serve as a draft."""
    path = resolve_draft(settings)
    name = settings.draft_model.strip()
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # a missing or broken tokenizer file: one line, not a trace
        raise DraftError(f"DRAFT_MODEL={name}: cannot load its tokenizer ({exc})") from None
    differs = tokenizer_difference(served_tokenizer, tokenizer)
    if differs:
        raise DraftError(
            f"DRAFT_MODEL={name} has another tokenizer than the served model {served_name}: "
            f"{differs}; a draft must share the served model's tokenizer (a smaller model "
            "of the same release usually does)"
        )
    try:
        model, _ = load_model(path)
    except Exception as exc:  # an unknown model type, a config or weights that do not match
        raise DraftError(
            f"DRAFT_MODEL={name}: cannot load it ({type(exc).__name__}: {exc})"
        ) from None
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if kinds:
        raise DraftError(
            f"DRAFT_MODEL={name} keeps {', '.join(kinds)} caches, which cannot roll back "
            "rejected proposals; a draft with plain KV caches (full attention) works"
        )
    head_on_last_position(model)  # a catch-up forward needs its last position's logits only
    arrays: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    draft = DraftModel(
        model,
        name,
        vocab,
        chunk,
        weight_bytes=sum(a.nbytes for _, a in arrays),
        kv_bytes_per_token=draft_bytes(path)[1],
    )
    draft.propose(-1, [0] * 8, 1 + TIMED_TOKENS)  # warm up and time it
    draft.forget(())
    return draft
