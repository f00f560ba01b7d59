"""Grammar-constrained sampling on rank 0 without a model: random logits at temperature 1
still give valid JSON and valid forced calls; what llguidance cannot enforce is refused by
name; the scheduler streams a forced call and ends it with finish_reason tool_calls; the
sampling defaults come from generation_config.json, else the settings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema_rs
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from engine.batch_engine import BatchEngine
from gateway.core import assemble_calls
from ipc.protocol import (
    ChatMessage,
    Delta,
    Done,
    Error,
    OutputFormat,
    SamplingParams,
    Started,
    Submit,
    ToolChoice,
    ToolSpec,
)
from leader.constraints import GrammarTokens, UnsupportedSchema, tool_call_schema
from leader.requests import Requests
from leader.sampler import RequestSampler
from leader.sampling_defaults import SamplingDefaults
from leader.scheduler import Scheduler
from tests.support.steps import take_step
from tests.support.tiny_models import write_agent_tokenizer

VOCAB = 266  # the agent tokenizer: 256 bytes, 3 special tokens, 7 words
TOOLS = [
    ToolSpec(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(name="get_time"),  # no parameters: the arguments are {}
]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_agent_tokenizer(tmp_path_factory.mktemp("agent")))


@pytest.fixture(scope="module")
def grammar(tokenizer):
    return GrammarTokens(tokenizer, VOCAB, tokenizer.eos_token_ids)


def generate(tokenizer, constraint, seed: int, limit: int = 300) -> str:
    """Random logits, temperature 1, the mask applied: the text the grammar let through."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=limit, temperature=1.0, seed=seed)
    sampler = RequestSampler(params, [], constraint)  # it masks and advances the grammar
    tokens = []
    for _ in range(limit):
        row = mx.array(rng.normal(size=VOCAB).astype(np.float32) * 3)
        token = sampler.sample_one(row).token
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
        if constraint.finished:
            break
    assert constraint.finished, "the grammar did not complete within the limit"
    return tokenizer.decode(tokens)


def test_random_logits_give_schema_valid_json_20_of_20(tokenizer, grammar):
    validator = jsonschema_rs.validator_for(SCHEMA)
    for seed in range(20):
        text = generate(tokenizer, grammar.constraint(SCHEMA, "response_format"), seed)
        assert validator.is_valid(json.loads(text)), text
        assert ", " in text or text.count(",") == 0  # compact separators, no free whitespace


def test_forced_calls_name_an_offered_tool_with_valid_arguments(tokenizer, grammar):
    schema = tool_call_schema(TOOLS, ToolChoice(mode="required"))
    validator = jsonschema_rs.validator_for(schema)
    names = set()
    for seed in range(20):
        call = json.loads(generate(tokenizer, grammar.constraint(schema, "tools"), seed))
        assert validator.is_valid(call), call
        names.add(call["name"])
        if call["name"] == "get_time":
            assert call["arguments"] == {}
    assert names == {"get_weather", "get_time"}


def test_unsupported_features_are_refused_by_name(grammar):
    unsupported = {
        "uniqueItems": {"type": "object", "properties": {"a": {"uniqueItems": True}}},
        "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        "look-around": {"type": "string", "pattern": "^(?!x)"},
    }
    for feature, schema in unsupported.items():
        with pytest.raises(UnsupportedSchema) as caught:
            grammar.constraint(schema, "response_format.json_schema.schema")
        assert feature in str(caught.value) and "\n" not in str(caught.value)
        assert caught.value.param == "response_format.json_schema.schema"
    with pytest.raises(UnsupportedSchema, match="no tool named 'nope'"):
        tool_call_schema(TOOLS, ToolChoice(mode="function", name="nope"))


def chat_submit(request_id: str, **fields) -> Submit:
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3)
    return Submit(id=request_id, messages=messages, params=params, **fields)


def sent(scheduler: Scheduler) -> list:
    messages = [message for _, message in scheduler.requests.outbox]
    scheduler.requests.outbox.clear()
    return messages


def test_the_scheduler_streams_a_forced_call_and_says_tool_calls(tokenizer, grammar):
    scheduler = Scheduler(Requests(tokenizer, 4096, grammar=grammar), 4)
    choice = ToolChoice(mode="function", name="get_weather")
    scheduler.requests.submit("c", chat_submit("f", tools=TOOLS, tool_choice=choice))
    assert isinstance(sent(scheduler)[0], Started)
    engine = BatchEngine(None, 16)
    engine.apply(scheduler.build_plan(engine))
    seq = engine.prefilling[0].seq_id
    rng = np.random.default_rng(0)
    deltas, done = [], None
    for _ in range(200):
        take_step(scheduler, [seq], mx.array(rng.normal(size=(1, VOCAB)) * 3))
        for message in sent(scheduler):
            deltas += [message] if isinstance(message, Delta) else []
            done = message if isinstance(message, Done) else done
        if done:
            break
    assert done is not None and done.finish_reason == "tool_calls"
    assert all(not d.text and not d.reasoning for d in deltas)
    (call,) = assemble_calls(piece for d in deltas for piece in d.tool_calls)
    assert call.name == "get_weather"
    assert jsonschema_rs.validator_for(TOOLS[0].parameters).is_valid(json.loads(call.arguments))


def test_refusals_name_the_field_and_counting_generates_nothing(tokenizer, grammar):
    scheduler = Scheduler(Requests(tokenizer, 4096, grammar=grammar), 4)
    bad = OutputFormat(
        type="json_schema", json_schema={"type": "object", "uniqueItems": True}, param="p.schema"
    )
    scheduler.requests.submit("c", chat_submit("bad", output=bad))
    scheduler.requests.submit("c", chat_submit("count", count_only=True, tools=TOOLS))
    error, started, done = sent(scheduler)
    assert isinstance(error, Error) and error.param == "p.schema" and "uniqueItems" in error.message
    assert isinstance(started, Started) and isinstance(done, Done)
    assert done.usage.prompt_tokens == started.prompt_tokens > 100  # the tools are in it
    assert done.usage.completion_tokens == 0 and not scheduler.requests.queue
    without = Scheduler(Requests(tokenizer, 4096), 4)  # no llguidance: refused, saying why
    without.requests.submit("c", chat_submit("x", output=OutputFormat(type="json_object")))
    (error,) = sent(without)
    assert isinstance(error, Error) and "llguidance" in error.message


def test_sampling_defaults_prefer_generation_config(tmp_path):
    settings = SimpleNamespace(
        default_temperature=0.7, default_top_p=1.0, default_top_k=0, default_min_p=0.0
    )
    assert SamplingDefaults.load(tmp_path, settings).temperature == 0.7  # no file: settings
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 7})
    )
    defaults = SamplingDefaults.load(tmp_path, settings)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (
        0.6,
        0.95,
        20,
        0.0,  # out of range: ignored
    )
    resolved = defaults.resolve(SamplingParams(max_tokens=4, temperature=1.0))
    assert (resolved.temperature, resolved.top_k) == (1.0, 20)  # the request wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert SamplingDefaults.load(tmp_path, settings).temperature == 0.0  # greedy
