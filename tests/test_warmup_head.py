"""The warm-up's last request: the chat template's opening, found from the template itself,
goes into the prefix cache, and a first chat then reuses it. Rank 0's scheduler and the
batch engine in one process, stepped as the leader steps them, on a tiny random model
whose template adds a default system prompt (as SmolLM2's and Qwen2.5's do)."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from engine.batch_engine import BatchEngine
from ipc.protocol import ChatMessage, SamplingParams, Submit
from leader.prefix_cache import PrefixCache
from leader.requests import Requests
from leader.scheduler import Scheduler
from leader.warmup import opening, template_head, uncounted
from tests.support.steps import engine_answer, engine_step
from tests.support.tiny_models import CHATML_TEMPLATE, write_tiny_model

DEFAULT_SYSTEM = "You are a patient assistant who answers about harbours and boats."
WITH_DEFAULT = (
    "{% if messages[0].role != 'system' %}<|im_start|>system\n"
    + DEFAULT_SYSTEM
    + "<|im_end|>\n{% endif %}"
    + CHATML_TEMPLATE
)
OPENING = f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
FIRST_MESSAGES = ["What is the capital of France?", " a leading space", "\nnewline first", "né"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), template=WITH_DEFAULT)
    return load_model(directory)[0], load_tokenizer(directory)


def chat(text: str, system: str | None = None) -> Submit:
    messages = [ChatMessage(role="system", content=system)] if system else []
    return Submit(
        id=f"chat-{len(text)}",
        messages=[*messages, ChatMessage(role="user", content=text)],
        params=SamplingParams(max_tokens=3, temperature=0.0),
    )


def test_the_opening_is_what_every_one_message_chat_starts_with(tiny) -> None:
    _, tokenizer = tiny
    requests = Requests(tokenizer, 512)
    head = template_head(requests)
    assert head == list(tokenizer.encode(OPENING, add_special_tokens=False))
    for text in FIRST_MESSAGES:
        prompt = requests.setup.prepare(chat(text)).prompt
        assert prompt[: len(head)] == head and len(prompt) > len(head), text
    # a chat with a system prompt of its own shares only the first marker and role
    own = requests.setup.prepare(chat("Hello", system="Be terse.")).prompt
    assert own[: len(head)] != head


def test_a_template_without_a_default_system_prompt_opens_with_the_user_turn(
    tmp_path_factory,
) -> None:
    directory = write_tiny_model(tmp_path_factory.mktemp("plain"))
    tokenizer = load_tokenizer(directory)
    head = template_head(Requests(tokenizer, 512))
    assert head == list(tokenizer.encode("<|im_start|>user\n", add_special_tokens=False))


def test_a_first_chat_reuses_the_primed_opening_and_the_counters_do_not_count_it(tiny) -> None:
    model, tokenizer = tiny
    prefix = PrefixCache(budget_tokens=4096)
    scheduler = Scheduler(Requests(tokenizer, 512, prefix), 4)
    engine = BatchEngine(model, 64)
    head = opening(scheduler.requests)
    assert head == template_head(scheduler.requests)
    with uncounted(prefix):
        scheduler.requests.prime(head)
        while scheduler.has_work(engine):
            engine_step(scheduler, engine)  # its messages go to rank 0's own connection
    assert (prefix.hits, prefix.misses, prefix.stats().entries) == (0, 0, 1)
    answers = []
    for text in FIRST_MESSAGES[:2]:
        tokens, done = engine_answer(scheduler, engine, chat(text))
        assert done.usage.prompt_tokens_details.cached_tokens == len(head), text
        answers.append(tokens)
    assert prefix.hits == 2 and prefix.misses == 0
    fresh = Scheduler(Requests(tokenizer, 512, PrefixCache(budget_tokens=4096)), 4)
    alone, done = engine_answer(fresh, BatchEngine(model, 64), chat(FIRST_MESSAGES[0]))
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    assert answers[0] == alone  # the reused opening answers as a full prefill would


def test_nothing_is_primed_without_a_cache_or_room_or_an_opening_worth_an_entry(
    tiny, tmp_path_factory
) -> None:
    _, tokenizer = tiny
    length = len(template_head(Requests(tokenizer, 512)))
    assert opening(Requests(tokenizer, 512)) == []  # the prefix cache off (no budget)
    assert opening(Requests(tokenizer, length, PrefixCache(4096))) == []  # no room to answer
    assert len(opening(Requests(tokenizer, length + 1, PrefixCache(4096)))) == length
    plain = load_tokenizer(write_tiny_model(tmp_path_factory.mktemp("plain")))
    assert opening(Requests(plain, 512, PrefixCache(4096))) == []  # "<|im_start|>user\n"
