"""Drive rank 0's scheduler as the leader does: without a model (logits in, messages out),
or over a batch engine in the same process (each plan through its wire form)."""

from __future__ import annotations

import mlx.core as mx

from engine.batch_engine import BatchEngine
from engine.batch_sampler import sample
from engine.step_plan import StepPlan, StepResult
from ipc.protocol import Delta, Done, Submit
from leader.scheduler import Scheduler


def take_step(scheduler: Scheduler, seq_ids: list[int], logits: mx.array) -> None:
    """Sample `logits` [rows, V] the way the engine does, take the tokens, stream them."""
    sampled = sample(logits, scheduler.sampling_rows(seq_ids))
    mx.eval(sampled.arrays())
    scheduler.on_result(StepResult(seq_ids, logits, sampled=sampled))
    scheduler.stream_pending()


def engine_step(scheduler: Scheduler, engine: BatchEngine) -> list:
    """One step of the scheduler's plan on `engine`; the messages it produced."""
    engine.apply(StepPlan.decode(scheduler.build_plan(engine).encode()))
    scheduler.on_result(engine.run(scheduler.sampling_rows))
    scheduler.stream_pending()
    sent = [message for _, message in scheduler.requests.outbox]
    scheduler.requests.outbox = []
    return sent


def engine_answer(
    scheduler: Scheduler, engine: BatchEngine, submit: Submit
) -> tuple[list[int], Done]:
    """Submit on connection 1 and step until its Done: its tokens and the Done."""
    scheduler.requests.submit(1, submit)
    tokens: list[int] = []
    while True:
        for message in engine_step(scheduler, engine):
            if isinstance(message, Delta) and message.id == submit.id:
                tokens += message.token_ids
            elif isinstance(message, Done) and message.id == submit.id:
                return tokens, message
