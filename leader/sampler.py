"""Rank 0's per-request sampling state: its parameters, its seed, what its penalties look
at, its grammar; each step it says how to sample its next token (a RowSampling, which
engine/batch_sampler.py applies to the whole batch inside MLX) and records what was drawn.

Each request owns a seed (its `seed`, or fresh entropy): the key of its n-th token is
derived from the seed and n alone, so a seeded request samples the same tokens whatever
else shares the batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.batch_sampler import RowSampling, sample, token_seed
from ipc.protocol import SamplingParams
from leader.constraints import TokenConstraint
from leader.sampling_defaults import SamplingDefaults


@dataclass
class Sample:
    """One sampled token and, when asked for, its log-probability and the top alternatives."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)
    accepted: bool = False  # a speculative step's proposal, accepted (not sampled there)


class RequestSampler:
    """Samples the tokens of one request. Values the params leave unset should be filled
    by the scheduler (the model's defaults); any still unset are neutral (greedy)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_tokens: list[int],
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.params = params = SamplingDefaults().resolve(params)
        self.constraint = constraint
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8))
        self.drawn = 0
        self._seen = dict.fromkeys(prompt_tokens)  # ordered set: repetition penalty
        self._counts: dict[int, int] = {}  # answer tokens: presence and frequency

    def row(self) -> RowSampling:
        """How to sample this request's next token."""
        mask = self.constraint.mask() if self.constraint is not None else None
        return self._row(0, (), mask)

    def rows_after(self, proposals: list[int]) -> list[RowSampling]:
        """How to sample the positions after the next token in a speculative step, one per
        proposal (leader/speculation.py): position j as if proposals[:j] had been drawn,
        its key that token's, its penalties counting them and its grammar past them, so a
        position samples what the plain step that reached it would."""
        masks: list[np.ndarray | None] = [None] * len(proposals)
        if self.constraint is not None:
            masks = list(self.constraint.masks_after(proposals))
        return [self._row(j, proposals[:j], mask) for j, mask in enumerate(masks, start=1)]

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none without one, or where it leaves a choice)."""
        return self.constraint.forced() if self.constraint is not None else []

    @property
    def proposal_ms(self) -> float:
        """What one proposal costs rank 0 before the step: its position's grammar mask."""
        return self.constraint.mask_ms if self.constraint is not None else 0.0

    def allowed(self, proposals: list[int]) -> list[int]:
        """The proposals' run that the grammar allows from here (all without one)."""
        if self.constraint is None:
            return proposals
        return proposals[: self.constraint.allowed_run(proposals)]

    def _row(self, offset: int, before: Sequence[int], mask: np.ndarray | None) -> RowSampling:
        """The row `offset` tokens on, `before` the tokens taken as drawn until then."""
        p = self.params
        seen: list[int] = []
        if p.repetition_penalty != 1.0:  # a 12K-token prompt's set is not built again a row
            seen = [*self._seen, *(t for t in dict.fromkeys(before) if t not in self._seen)]
        counts: dict[int, int] = {}
        if p.presence_penalty or p.frequency_penalty:
            counts = dict(self._counts)
            for token in before:
                counts[token] = counts.get(token, 0) + 1
        return RowSampling(
            temperature=p.temperature or 0.0,
            top_k=p.top_k or 0,
            top_p=p.top_p or 1.0,
            min_p=p.min_p or 0.0,
            seed=token_seed(self.seed, self.drawn + offset),
            repetition_penalty=p.repetition_penalty,
            seen=seen,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            counts=counts,
            mask=mask,
            logprobs=p.top_logprobs if p.logprobs else -1,
        )

    def record(self, token: int) -> None:
        """The token drawn for this request (its penalties and grammar move on)."""
        self.drawn += 1
        self._counts[token] = self._counts.get(token, 0) + 1
        self._seen[token] = None
        if self.constraint is not None:
            self.constraint.consume(token)

    def sample_one(self, logits: mx.array) -> Sample:
        """Sample this request alone from one row of logits [V] and record the token (what
        the engine does for the whole batch; for tools and tests)."""
        row = self.row()
        drawn = sample(logits.reshape(1, -1), [row])
        mx.eval(drawn.arrays())
        ((token, logprob, top),) = drawn.rows()
        self.record(token)
        return Sample(token, logprob if row.logprobs >= 0 else None, top[: max(row.logprobs, 0)])
