"""The Anthropic Messages API through the real api.py and 2 real ranks, driven by the
official `anthropic` SDK unchanged: text, the event stream, tool_use and a tool_result
round trip, stop sequences, count_tokens, both key headers and Anthropic-shaped errors.

The tiny agent model answers greedily with known reasoning and two tool calls (see
tests/support/tiny_models.py). One cluster and one api.py (with API_KEY) for the module.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema_rs
import pytest

from tests.support.agent_requests import ASK, WEATHER
from tests.support.api_server import cluster_with_api
from tests.support.tiny_models import AGENT_CALLS, AGENT_THOUGHT, write_agent_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KEY = "anthropic-test-key"
MODEL = "claude-local-test"  # Anthropic clients send Claude names: they select the served model
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER},
    {
        "name": "get_time",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    work = tmp_path_factory.mktemp("anthropic-cluster")
    model = write_agent_model(work / "tiny-agent")
    with cluster_with_api(model, work, api_env={"API_KEY": KEY}) as process:
        yield process


@pytest.fixture(scope="module")
def client(api):
    return anthropic.Anthropic(base_url=api.base_url, api_key=KEY, max_retries=0)


def test_text_message_with_thinking(client):
    message = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, system="Be brief.")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "tiny-agent" and message.id.startswith("msg_")
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == AGENT_THOUGHT
    assert text.type == "text" and text.text.startswith("<tool_call>")  # no tools offered
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 10 and usage.output_tokens == 5


def test_stream_gives_the_same_message(client):
    plain = client.messages.create(model=MODEL, max_tokens=40, messages=ASK)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [block.model_dump() for block in final.content] == [
        block.model_dump() for block in plain.content
    ]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5


def test_tool_use_then_tool_result_round_trip(client):
    first = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [(n, a) for n, a in AGENT_CALLS]
    assert not [b for b in first.content if b.type == "text"]  # only whitespace was around
    results = [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18C and sunny"},
        {
            "type": "tool_result",
            "tool_use_id": uses[1].id,
            "content": [{"type": "text", "text": "14:00"}],
        },
    ]
    history = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": results},
    ]
    second = client.messages.create(model=MODEL, max_tokens=5, messages=history, tools=TOOLS)
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    usage = second.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens > 0  # the first turn's prompt was reused


def test_forced_tool_streams_valid_input(client):
    validator = jsonschema_rs.validator_for(WEATHER)
    for seed in range(3):
        with client.messages.stream(
            model=MODEL,
            max_tokens=200,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 1.0, "seed": seed},
        ) as stream:
            partial = [e.partial_json for e in stream if e.type == "input_json"]
            final = stream.get_final_message()
        (use,) = final.content
        assert use.type == "tool_use" and use.name == "get_weather"
        assert validator.is_valid(use.input) and json.loads("".join(partial)) == use.input
        assert final.stop_reason == "tool_use"


def test_stop_sequence_is_reported(client):
    message = client.messages.create(
        model=MODEL, max_tokens=40, messages=ASK, stop_sequences=["get_time", "zzz"]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "get_time"
    assert message.content[-1].text.endswith(
        '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "'
    )


def test_keys_headers_and_errors(api, client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="gpt-4o", max_tokens=5, messages=ASK)
    assert caught.value.type == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=api.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK
        )
    assert caught.value.type == "authentication_error"
    body = {"model": MODEL, "max_tokens": 3, "messages": ASK}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}  # older clients, curl
    old_style = httpx.post(f"{api.base_url}/v1/messages", json=body, headers=headers, timeout=60)
    assert old_style.status_code == 200 and old_style.json()["type"] == "message"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert caught.value.type == "invalid_request_error" and "max_tokens" in caught.value.message


def test_a_final_assistant_turn_is_continued(client):
    prefilled = [*ASK, {"role": "assistant", "content": "Sure"}]
    message = client.messages.create(model=MODEL, max_tokens=3, messages=prefilled)
    counted = client.messages.count_tokens(model=MODEL, messages=prefilled).input_tokens
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    # "...assistant\nSure" where a new turn would end "...assistant\n<think>": 4 bytes for 1
    assert counted == plain + 3
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted


def test_a_cap_past_the_context_ends_with_max_tokens(client):
    """Claude Code asks for max_tokens=128000 whatever the model: a cap, not an error. The
    answer stops where the context (4096) ends; the 5-token script is left room for 2."""
    counted = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    padded = [{"role": "user", "content": "x" * (4096 - counted - 2) + ASK[0]["content"]}]
    # streamed, as Claude Code does (the SDK refuses so large a cap without a stream)
    with client.messages.stream(model=MODEL, max_tokens=128_000, messages=padded) as stream:
        message = stream.get_final_message()
    usage = message.usage
    assert message.stop_reason == "max_tokens" and usage.output_tokens == 2
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens == 4096
