"""OpenAI's Responses API through the real api.py and 2 real ranks, driven by the official
`openai` SDK's `client.responses` and the OpenAI Agents SDK's default model path, unchanged:
text, the event stream, function calls with a round trip by previous_response_id,
json_schema output, stored responses, and the cap that the context bounds.

The tiny agent model answers greedily with known reasoning and two tool calls (see
tests/support/tiny_models.py). One cluster and one api.py for the module.
"""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest

from tests.support.agent_requests import WEATHER
from tests.support.api_server import cluster_with_api
from tests.support.tiny_models import AGENT_CALLS, AGENT_THOUGHT, write_agent_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

QUESTION = "What is the weather and the time in Paris?"
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER},
    {
        "type": "function",
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
    {"type": "web_search"},  # a hosted tool (Codex sends one): ignored, not refused
]
CONTEXT = 1024


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    work = tmp_path_factory.mktemp("responses-cluster")
    model = write_agent_model(work / "tiny-agent")
    with cluster_with_api(model, work, env={"MAX_SEQUENCE_LENGTH": str(CONTEXT)}) as process:
        yield process


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)


def test_text_capped_by_max_output_tokens(client):
    response = client.responses.create(model="default", input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.usage.input_tokens > 10
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert AGENT_THOUGHT.startswith(reasoning[0].content[0].text.strip())
    assert response.performance["time_to_first_token"] > 0  # our figures, as on chat


def test_a_cap_past_the_context_is_a_cap(client):
    """A max_output_tokens far past the context is not refused: the answer stops where the
    context ends, reported as incomplete. The scripted answer is 5 tokens, so the prompt is
    padded (one token a byte) to leave 2."""
    probe = client.responses.create(model="default", input=QUESTION, max_output_tokens=1)
    padding = "x" * (CONTEXT - probe.usage.input_tokens - 2)
    response = client.responses.create(
        model="default", input=padding + QUESTION, max_output_tokens=128_000
    )
    usage = response.usage
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert usage.output_tokens == 2 and usage.total_tokens == CONTEXT


def test_function_calls_and_a_round_trip_by_id(client):
    first = client.responses.create(model="default", input=QUESTION, tools=TOOLS)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in AGENT_CALLS]
    outputs = [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C and sunny"},
        {"type": "function_call_output", "call_id": calls[1].call_id, "output": "14:00"},
    ]
    second = client.responses.create(
        model="default",
        previous_response_id=first.id,
        input=outputs,
        tools=TOOLS,
        max_output_tokens=4,
    )
    assert second.previous_response_id == first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached < second.usage.input_tokens  # the first turn's prompt was reused
    # the same conversation sent whole, without the id, renders the same prompt
    replay = [
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],
        *outputs,
    ]
    whole = client.responses.create(model="default", input=replay, tools=TOOLS, max_output_tokens=4)
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert client.responses.retrieve(second.id).output[0].id == second.output[0].id


def test_stream_events_and_the_final_response(client):
    plain = client.responses.create(model="default", input=QUESTION, tools=TOOLS)
    with client.responses.stream(model="default", input=QUESTION, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in (
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert kind in kinds, kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    shown = [(item.type, getattr(item, "arguments", None)) for item in final.output]
    assert shown == [(item.type, getattr(item, "arguments", None)) for item in plain.output]
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_json_schema_through_the_grammar(client):
    validator = jsonschema_rs.validator_for(WEATHER)
    for _ in range(2):
        response = client.responses.create(
            model="default",
            input=QUESTION,
            text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
            temperature=1.0,
            max_output_tokens=200,
        )
        assert validator.is_valid(json.loads(response.output_text)), response.output_text


def test_stored_responses_and_clear_refusals(client, api):
    kept = client.responses.create(model="default", input="hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    unkept = client.responses.create(model="default", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(unkept.id)
    assert unkept.id in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="default", input="hi", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    assert "resp_nope" in caught.value.body["message"]
    picture = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="default", input=[picture])
    assert "input_image" in caught.value.body["message"]
    deleted = httpx.delete(f"{api.base_url}/v1/responses/{kept.id}")
    assert deleted.json() == {"id": kept.id, "object": "response", "deleted": True}


def test_the_agents_sdk_default_model_path(api):
    """The Agents SDK with its defaults (the Responses API) runs a tool the model calls."""
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        seen.append(city)
        return f"18 degrees in {city}"

    @function_tool
    def get_time(timezone: str) -> str:
        """The time in a timezone."""
        return "14:00"

    agent = Agent(
        name="weather",
        instructions="Answer with the tools.",
        tools=[get_weather, get_time],
        tool_use_behavior="stop_on_first_tool",
    )
    sdk = openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=sdk), model="default")
    result = Runner.run_sync(agent, QUESTION, run_config=config)
    assert seen == ["Paris"]
    assert result.final_output.startswith("18 degrees")
