"""Rank 0's per-request sampler: penalties, temperature, top_k, top_p, min_p, seed, logprobs.

Works on one row of logits as a numpy float32 vector. Each request owns a numpy
Generator seeded from its `seed` (or fresh entropy), so a seeded request samples the
same tokens whatever else shares the batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from engine.sampling_defaults import SamplingDefaults
from ipc.protocol import SamplingParams

# top_p first looks among this many most likely tokens, then falls back to a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass
class Sample:
    """One sampled token and, when asked for, its log-probability and the top alternatives."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


def _log_softmax(values: np.ndarray) -> np.ndarray:
    shifted = values - values.max()
    return shifted - np.log(np.exp(shifted).sum())


class RequestSampler:
    """Samples the tokens of one request. Values the params leave unset should be filled
    by the scheduler (the model's defaults); any still unset are neutral (greedy)."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int]) -> None:
        self.params = params = SamplingDefaults().resolve(params)
        self.temperature = params.temperature or 0.0
        self.top_p = params.top_p or 1.0
        self.top_k = params.top_k or 0
        self.min_p = params.min_p or 0.0
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.rng = np.random.default_rng(seed)
        self._seen = np.unique(np.asarray(prompt_tokens, dtype=np.int64))
        self._counts: dict[int, int] = {}

    def _penalize(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        if p.repetition_penalty != 1.0 and self._seen.size:
            chosen = logits[self._seen]
            logits[self._seen] = np.where(
                chosen > 0, chosen / p.repetition_penalty, chosen * p.repetition_penalty
            )
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts.keys(), dtype=np.int64)
            counts = np.fromiter(self._counts.values(), dtype=np.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _choose(self, logits: np.ndarray) -> int:
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits / self.temperature
        vocab = scaled.shape[0]
        top_k, top_p = self.top_k, self.top_p
        if 0 < top_k < vocab:
            candidates = np.argpartition(-scaled, top_k - 1)[:top_k]
        elif top_p < 1.0 and vocab > _TOP_P_CANDIDATES:
            candidates = np.argpartition(-scaled, _TOP_P_CANDIDATES - 1)[:_TOP_P_CANDIDATES]
        else:
            candidates = np.arange(vocab)
        probs_all = np.exp(scaled - scaled.max())
        total = probs_all.sum()
        order = candidates[np.argsort(-scaled[candidates], kind="stable")]
        probs = probs_all[order] / total
        if top_p < 1.0:
            cumulative = np.cumsum(probs)
            if cumulative[-1] < top_p and len(order) < vocab:
                order = np.argsort(-scaled, kind="stable")
                probs = probs_all[order] / total
                cumulative = np.cumsum(probs)
            keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
            order, probs = order[:keep], probs[:keep]
        if self.min_p > 0.0:
            mask = probs >= self.min_p * probs[0]
            order, probs = order[mask], probs[mask]
        total = probs.sum()
        if not np.isfinite(total) or total <= 0:
            return int(order[0])
        return int(order[self.rng.choice(len(order), p=probs / total)])

    def sample(self, logits: np.ndarray) -> Sample:
        """Pick the next token from one row of raw logits and record it."""
        logits = self._penalize(np.array(logits, dtype=np.float32, copy=True))
        # Extreme penalties can overflow; keep the order of what is left finite.
        logits = np.nan_to_num(logits, nan=-np.inf, posinf=float(np.finfo(np.float32).max))
        token = self._choose(logits)
        result = Sample(token)
        if self.params.logprobs:
            logprobs = _log_softmax(logits.astype(np.float64))
            result.logprob = float(logprobs[token])
            k = self.params.top_logprobs
            if k:
                top = np.argpartition(-logprobs, k - 1)[:k]
                top = top[np.argsort(-logprobs[top], kind="stable")]
                result.top = [(int(t), float(logprobs[t])) for t in top]
        self._counts[token] = self._counts.get(token, 0) + 1
        if self.params.repetition_penalty != 1.0 and token not in self._seen:
            self._seen = np.append(self._seen, token)
        return result
