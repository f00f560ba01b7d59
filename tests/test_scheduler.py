"""Rank 0's scheduler without a model: admission, refusals, cancellation, plans."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from engine.batch_engine import BatchEngine
from ipc.protocol import Delta, Done, Error, SamplingParams, Started, Submit
from leader.requests import Requests
from leader.scheduler import Scheduler
from tests.support.steps import take_step
from tests.support.tiny_models import write_byte_tokenizer

EOS = 258  # <|im_end|> in the byte tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(directory)
    return load_tokenizer(directory)


def submit(request_id: str, prompt: str = "hi", max_tokens: int = 4, **params) -> Submit:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Submit(id=request_id, prompt=prompt, params=sampling)


def sent(scheduler: Scheduler) -> list:
    messages = [message for _, message in scheduler.requests.outbox]
    scheduler.requests.outbox.clear()
    return messages


def one_hot(rows: list[int], vocab: int = 259) -> mx.array:
    return mx.array([[10.0 if i == t else 0.0 for i in range(vocab)] for t in rows])


def test_refusals_never_reach_a_plan(tokenizer):
    scheduler = Scheduler(Requests(tokenizer, 32), max_batch_size=4)
    scheduler.requests.submit("c", submit("long", "x" * 40, max_tokens=4))
    scheduler.requests.submit("c", submit("empty", ""))
    scheduler.requests.submit("c", submit("ok"))
    scheduler.requests.submit("c", submit("ok"))
    errors = {m.id: m.code for m in sent(scheduler) if isinstance(m, Error)}
    assert errors == {"long": "prompt_too_long", "empty": "invalid_request", "ok": "duplicate_id"}
    plan = scheduler.build_plan(BatchEngine(None, 16))
    assert [i.tokens for i in plan.inserts] == [list(b"hi")]


def test_a_token_past_the_models_embedding_is_refused(tokenizer):
    """A tokenizer that does not match the model's weights gives ids past its embedding
    table, which MLX's gather would read out of bounds: refused, saying so."""
    scheduler = Scheduler(Requests(tokenizer, 32, vocab_size=100), max_batch_size=4)
    scheduler.requests.submit("c", submit("past", "hi"))  # bytes 104 and 105
    scheduler.requests.submit("c", submit("within", "AB"))  # 65 and 66
    errors = {m.id: m for m in sent(scheduler) if isinstance(m, Error)}
    assert list(errors) == ["past"] and errors["past"].code == "internal"
    message = errors["past"].message
    assert "token id 105" in message and "100 embedding rows" in message
    plan = scheduler.build_plan(BatchEngine(None, 16))
    assert [i.tokens for i in plan.inserts] == [list(b"AB")]


def test_admission_stops_at_max_batch_size(tokenizer):
    scheduler = Scheduler(Requests(tokenizer, 64), max_batch_size=2)
    for i in range(3):
        scheduler.requests.submit("c", submit(f"r{i}"))
    assert [type(m) for m in sent(scheduler)] == [Started] * 3
    engine = BatchEngine(None, 16)
    plan = scheduler.build_plan(engine)
    engine.apply(plan)
    assert len(plan.inserts) == 2 and len(scheduler.requests.queue) == 1


def test_tokens_eos_and_cancel_flow_into_plans(tokenizer):
    scheduler = Scheduler(Requests(tokenizer, 64), max_batch_size=4)
    scheduler.requests.submit("c", submit("a", max_tokens=3))
    scheduler.requests.submit("c", submit("b", max_tokens=3))
    sent(scheduler)
    engine = BatchEngine(None, 16)
    engine.apply(scheduler.build_plan(engine))
    seq_a, seq_b = (p.seq_id for p in engine.prefilling)
    # Pretend both prompts finished prefilling: "a" samples 'Z', "b" samples EOS.
    engine.prefilling.clear()
    engine.decode_ids, engine.decode_lengths = [seq_a, seq_b], [2, 2]
    take_step(scheduler, [seq_a, seq_b], one_hot([ord("Z"), EOS]))
    messages = sent(scheduler)
    assert any(isinstance(m, Delta) and m.id == "a" and m.text == "Z" for m in messages)
    assert any(isinstance(m, Done) and m.id == "b" and m.finish_reason == "stop" for m in messages)
    plan = scheduler.build_plan(engine)
    assert plan.removes == [seq_b] and plan.tokens == [ord("Z")]
    scheduler.requests.cancel("c", "a")
    (done,) = sent(scheduler)
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 1
    assert scheduler.requests.to_remove == [seq_a]


def test_stop_string_cuts_the_text(tokenizer):
    scheduler = Scheduler(Requests(tokenizer, 64), max_batch_size=4)
    scheduler.requests.submit("c", submit("s", max_tokens=10, stop=["cd"]))
    sent(scheduler)
    engine = BatchEngine(None, 16)
    engine.apply(scheduler.build_plan(engine))
    seq = engine.prefilling[0].seq_id
    text = ""
    for char in "abcde":
        take_step(scheduler, [seq], one_hot([ord(char)]))
        for message in sent(scheduler):
            if isinstance(message, Delta):
                text += message.text
            if isinstance(message, Done):
                assert message.finish_reason == "stop"
                assert text == "ab"
                return
    pytest.fail("the stop string did not end the request")
