"""The Responses adapter without ranks: input items as the conversation the chat template
renders, refusals that name the item, the stream's event order, and the bounded store."""

from __future__ import annotations

import pytest

from gateway.core import Limits
from gateway.responses.convert import ConversionError, parse_items, to_submit, turns
from gateway.responses.protocol import Response, ResponsesRequest
from gateway.responses.store import ResponseStore
from gateway.responses.stream import ResponseBuilder
from ipc.protocol import ChatMessage, Delta, Done, Timings, ToolCallDelta, Usage

CODEX_LIKE = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be"}]},
    {"role": "user", "content": "list files"},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "ls"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On"}]},
    {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
]


def test_items_become_the_chat_conversation():
    request = ResponsesRequest(input=CODEX_LIKE, instructions="Sys", max_output_tokens=9)
    submit = to_submit(request, turns(request, []), "resp_1", Limits(512))
    roles = [(m.role, m.content) for m in submit.messages or []]
    assert roles == [
        ("system", "Sys"),
        ("system", "Be"),
        ("user", "list files"),
        ("assistant", "On"),
        ("tool", "a.txt"),
    ]
    assistant, tool = (submit.messages or [])[3:]
    assert assistant.reasoning == "ls" and assistant.tool_calls[0].name == "exec_command"
    assert tool.tool_call_id == "c1" and tool.name == "exec_command"
    assert submit.params.max_tokens == 9


def test_unknown_items_and_parts_are_refused_by_name():
    with pytest.raises(ConversionError) as caught:
        parse_items([{"type": "local_shell_call", "id": "x"}])
    assert caught.value.param == "input[0].type" and "local_shell_call" in str(caught.value)
    with pytest.raises(ConversionError, match="call_id"):
        parse_items([{"type": "function_call_output", "output": "x"}])
    picture = [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]
    request = ResponsesRequest(input=picture)
    with pytest.raises(ConversionError, match="input_image"):
        turns(request, [])


def _timings() -> Timings:
    return Timings(
        time_to_first_token_s=0.1,
        prompt_tokens_per_second=1.0,
        generation_tokens_per_second=1.0,
        total_time_s=0.2,
    )


def test_the_stream_opens_fills_and_closes_each_item_in_order():
    builder = ResponseBuilder(Response(id="r", created_at=0, status="in_progress", model="m"))
    events = builder.opening()
    events += builder.feed(Delta(id="r", text="", reasoning="think"))
    events += builder.feed(Delta(id="r", text="Hi"))
    piece = ToolCallDelta(index=0, id="call_1", name="f", arguments='{"a"')
    events += builder.feed(Delta(id="r", text="", tool_calls=[piece]))
    events += builder.feed(
        Delta(id="r", text="", tool_calls=[ToolCallDelta(index=0, arguments=":1}")])
    )
    usage = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    events += builder.feed(Done(id="r", finish_reason="length", usage=usage, timings=_timings()))
    kinds = [event["type"].removeprefix("response.") for event in events]
    assert kinds == [
        "created",
        "in_progress",
        "output_item.added",
        "reasoning_text.delta",
        "reasoning_text.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "incomplete",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    final = builder.response
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].arguments == '{"a":1}'  # type: ignore[union-attr]


def test_the_store_keeps_the_newest_within_its_bytes():
    store = ResponseStore(limit_bytes=2000)
    turn = [ChatMessage(role="user", content="x" * 300)]
    for n in range(10):
        store.put(Response(id=f"r{n}", created_at=0, status="completed", model="m"), turn)
        assert store.nbytes <= 2000
    assert store.get("r9") is not None and store.get("r0") is None
    assert 1 < len(store) < 10
    assert store.delete("r9") and store.get("r9") is None
