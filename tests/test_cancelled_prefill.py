"""A request cancelled while its long prompt prefills leaves what every rank computed of it
in the prefix cache: rank 0's scheduler and the batch engine in one process, stepped as the
leader steps them (each plan through its wire form), on a tiny random model."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from engine.batch_engine import BatchEngine
from ipc.protocol import Delta, Done, SamplingParams, Submit
from leader.prefix_cache import PrefixCache
from leader.requests import Requests
from leader.scheduler import Scheduler
from tests.support.steps import engine_answer, engine_step
from tests.support.tiny_models import write_tiny_model

CHUNK = 16
PROMPT = "".join(chr(97 + (i * 7) % 26) for i in range(120))  # 120 byte tokens and the EOS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), never_stops=True)
    return load_model(directory)[0], load_tokenizer(directory)


def answer(scheduler: Scheduler, engine: BatchEngine, request_id: str) -> tuple[list[int], Done]:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    return engine_answer(scheduler, engine, Submit(id=request_id, prompt=PROMPT, params=params))


def test_a_prefill_cancelled_mid_prompt_leaves_its_chunks_for_the_next(tiny):
    model, tokenizer = tiny
    scheduler = Scheduler(Requests(tokenizer, 512, PrefixCache(budget_tokens=4096)), 4)
    engine = BatchEngine(model, CHUNK)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    scheduler.requests.submit(1, Submit(id="interrupted", prompt=PROMPT, params=params))
    for _ in range(3):  # three chunks of the prompt, no token yet
        assert not any(isinstance(m, Delta) for m in engine_step(scheduler, engine))
    assert [p.length for p in engine.prefilling] == [3 * CHUNK]
    scheduler.requests.cancel(1, "interrupted")
    tokens, done = answer(scheduler, engine, "again")
    assert done.usage.prompt_tokens_details.cached_tokens == 3 * CHUNK
    fresh = Scheduler(Requests(tokenizer, 512, PrefixCache(budget_tokens=4096)), 4)
    alone, _ = answer(fresh, BatchEngine(model, CHUNK), "alone")
    assert tokens == alone  # the kept chunks serve as a full prefill would
