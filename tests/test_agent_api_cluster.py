"""Agent features through the real api.py and 2 real ranks, with the `openai` SDK and the
project's original examples: tool calls (parsed, forced, streamed, in the history),
structured output, reasoning split from the answer, requests without a model.

The model is the tiny agent model (tests/support/tiny_models.py): random weights, except
that its greedy answer is known (reasoning, then two tool calls). At temperature 1 only
the grammar makes forced calls and JSON valid, which is what the 20-of-20 checks prove.
One cluster and one api.py for the module.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.agent_requests import ASK, TIME, WEATHER
from tests.support.api_server import cluster_with_api
from tests.support.tiny_models import AGENT_CALLS, AGENT_THOUGHT, write_agent_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema, "strict": True}}
    for name, schema in SCHEMAS.items()
]
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "admin"],
    "additionalProperties": False,
}


class Profile(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    admin: bool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_agent_model(tmp_path_factory.mktemp("agent") / "tiny-agent")


@pytest.fixture(scope="module")
def api(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("agent-cluster")
    with cluster_with_api(model_dir, work) as process:
        yield process


@pytest.fixture(scope="module")
def sdk(api):
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)


def many(function, count: int = 20) -> list:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(function, range(count)))


def test_the_original_examples_work_as_written(api, model_dir):
    assert httpx.get(f"{api.base_url}/health").json()["ready"] is True
    assert httpx.get(f"{api.base_url}/health/live").status_code == 200
    hello = httpx.post(
        f"{api.base_url}/v1/chat/completions",
        headers={"Content-Type": "application/json"},
        content='{"messages": [{"role": "user", "content": "Say hello!"}], "max_tokens": 50}',
    )
    assert hello.status_code == 200, hello.text
    body = {
        "messages": [{"role": "user", "content": "What is machine learning?"}],
        "max_tokens": 100,
        "temperature": 0.7,
    }
    data = httpx.post(f"{api.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert isinstance(data["choices"][0]["message"]["content"], str)
    assert data["performance"]["time_to_first_token"] > 0
    info = httpx.get(f"{api.base_url}/").json()
    assert info["model"] == "tiny-agent" and info["ready"] is True  # the readable served id
    routes = {(e["method"], e["path"]) for e in info["endpoints"]}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/messages")} <= routes
    assert httpx.get(f"{api.base_url}/model/info").json()["id"] == "tiny-agent"
    old_id = {**body, "model": str(model_dir), "max_tokens": 2}  # MODEL as written: an alias
    reply = httpx.post(f"{api.base_url}/v1/chat/completions", json=old_id, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "tiny-agent"


def test_no_temperature_is_greedy_and_reasoning_is_split(sdk):
    plain = sdk.chat.completions.create(messages=ASK, model="default", max_tokens=40)
    again = sdk.chat.completions.create(messages=ASK, model="default", max_tokens=40)
    greedy = sdk.chat.completions.create(
        messages=ASK, model="default", max_tokens=40, temperature=0
    )
    message = plain.choices[0].message
    assert message.content == again.choices[0].message.content == greedy.choices[0].message.content
    assert message.model_extra["reasoning_content"] == AGENT_THOUGHT
    assert message.content.startswith("<tool_call>")  # no tools offered: the blocks are text
    assert AGENT_THOUGHT not in message.content and "think>" not in message.content
    chunks = list(
        sdk.chat.completions.create(messages=ASK, model="default", max_tokens=40, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert streamed == AGENT_THOUGHT
    assert "".join(d.content or "" for d in deltas) == message.content


def test_auto_tool_calls_are_parsed_from_the_text_and_streamed(sdk):
    reply = sdk.chat.completions.create(messages=ASK, model="default", tools=TOOLS, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    called = [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]
    assert called == [(name, args) for name, args in AGENT_CALLS]  # two calls in parallel
    assert len({c.id for c in choice.message.tool_calls}) == 2
    stream = sdk.chat.completions.create(
        messages=ASK, model="default", tools=TOOLS, max_tokens=40, stream=True
    )
    pieces = [
        tc for chunk in stream if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []
    ]
    assert [p.index for p in pieces] == [0, 1] and all(
        p.id and p.type == "function" for p in pieces
    )
    assert [json.loads(p.function.arguments) for p in pieces] == [a for _, a in AGENT_CALLS]
    single = sdk.chat.completions.create(
        messages=ASK, model="default", tools=TOOLS, max_tokens=40, parallel_tool_calls=False
    )
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]


def test_forced_tool_call_is_valid_20_of_20_at_temperature_1(sdk):
    def call(seed: int):
        return sdk.chat.completions.create(
            messages=ASK,
            model="default",
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        ).choices[0]

    choices = many(call)
    names = set()
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        (tool_call,) = choice.message.tool_calls
        names.add(tool_call.function.name)
        arguments = json.loads(tool_call.function.arguments)
        assert jsonschema_rs.validator_for(SCHEMAS[tool_call.function.name]).is_valid(arguments)
    assert names <= set(SCHEMAS)


def test_streamed_named_tool_call_assembles_to_valid_json(sdk):
    for seed in range(3):
        stream = sdk.chat.completions.create(
            messages=ASK,
            model="default",
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            stream=True,
        )
        chunks = [chunk for chunk in stream if chunk.choices]
        pieces = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        assert pieces[0].id and pieces[0].function.name == "get_weather"
        assert all(p.id is None and p.function.name is None for p in pieces[1:])
        assert len(pieces) > 2  # the arguments arrive as they grow
        arguments = json.loads("".join(p.function.arguments or "" for p in pieces))
        assert jsonschema_rs.validator_for(WEATHER).is_valid(arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_reaches_the_template(sdk, model_dir):
    from transformers import AutoTokenizer

    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                },
                {
                    "id": "call_b2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a1", "content": "18C and sunny"},
        {"role": "tool", "tool_call_id": "call_b2", "content": [{"type": "text", "text": "14:00"}]},
    ]
    reply = sdk.chat.completions.create(
        messages=history, model="default", tools=TOOLS, max_tokens=5
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = [dict(m) for m in history]
    rendered[1] = {
        **rendered[1],
        "content": "",
        "tool_calls": [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in history[1]["tool_calls"]
        ],
    }
    rendered[3] = {**rendered[3], "content": "14:00"}
    shown = [  # the tools as rank 0 shows them to the template
        {"type": "function", "function": {"name": n, "description": "", "parameters": s}}
        for n, s in SCHEMAS.items()
    ]
    text = tokenizer.apply_chat_template(
        rendered, tools=shown, add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert "18C and sunny" in text and '"city": "Paris"' in text
    assert reply.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_json_schema_output_validates_20_of_20_at_temperature_1(sdk):
    validator = jsonschema_rs.validator_for(PROFILE)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "profile", "schema": PROFILE, "strict": True},
    }

    def ask(seed: int):
        return sdk.chat.completions.create(
            messages=ASK,
            model="default",
            response_format=response_format,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        ).choices[0]

    for choice in many(ask):
        assert choice.finish_reason == "stop", choice
        assert validator.is_valid(json.loads(choice.message.content)), choice.message.content
        assert choice.message.model_extra.get("reasoning_content") is None
    parsed = sdk.chat.completions.parse(  # the SDK's own structured-output helper
        messages=ASK, model="default", response_format=Profile, temperature=1.0, max_tokens=200
    )
    assert isinstance(parsed.choices[0].message.parsed, Profile)
    anything = sdk.chat.completions.create(
        messages=ASK, model="default", response_format={"type": "json_object"}, max_tokens=60
    ).choices[0]
    assert anything.message.content.startswith("{")
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)


def test_an_unsupported_schema_feature_is_a_400_naming_it(sdk):
    schema = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            messages=ASK,
            model="default",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    error = caught.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in error["message"]
