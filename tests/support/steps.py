"""Drive rank 0's scheduler without a model: logits in, messages out, as the leader does."""

from __future__ import annotations

import mlx.core as mx

from engine.batch_sampler import sample
from engine.step_plan import StepResult
from leader.scheduler import Scheduler


def take_step(scheduler: Scheduler, seq_ids: list[int], logits: mx.array) -> None:
    """Sample `logits` [rows, V] the way the engine does, take the tokens, stream them."""
    sampled = sample(logits, scheduler.sampling_rows(seq_ids))
    mx.eval(sampled.arrays())
    scheduler.on_result(StepResult(seq_ids, logits, sampled=sampled))
    scheduler.stream_pending()
