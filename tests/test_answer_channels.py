"""Rank 0's answer pipeline without a model: thinking and tool-call markers split from
streamed text however it is cut, tool blocks parsed into calls, forced calls streamed as
argument pieces, whitespace around markers trimmed."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_tokenizer

from ipc.protocol import ToolSpec
from leader.answer import AnswerShape, AnswerStream, Piece
from leader.channels import ChannelSplitter, Markers
from leader.tool_calls import FALLBACK_FORMAT, ForcedCallStream, parse_calls
from tests.support.tiny_models import (
    AGENT_CALLS,
    AGENT_SCRIPT,
    AGENT_THOUGHT,
    write_agent_tokenizer,
)

MARKERS = Markers(think=("<think>", "</think>"), tool=("<tool_call>", "</tool_call>"))
TEXT = (
    "<think>plan it</think>Sure.<tool_call>\n"
    '{"name": "f", "arguments": {"a": 1}}\n</tool_call> done'
)
TOOLS = [ToolSpec(name=name) for name, _ in AGENT_CALLS] + [ToolSpec(name="f")]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(TEXT)])
def test_splitter_gives_the_same_channels_however_the_text_is_cut(size):
    splitter = ChannelSplitter(MARKERS)
    content, reasoning, blocks = "", "", []
    for start in range(0, len(TEXT), size):
        out = splitter.push(TEXT[start : start + size])
        assert "<" not in out.content and "<" not in out.reasoning  # no marker pieces leak
        content, reasoning, blocks = (
            content + out.content,
            reasoning + out.reasoning,
            blocks + out.tool_blocks,
        )
    end = splitter.finish()
    assert (content + end.content, reasoning) == ("Sure. done", "plan it")
    assert [json.loads(b) for b in blocks] == [{"name": "f", "arguments": {"a": 1}}]


def test_splitter_starts_inside_an_open_thinking_block_and_releases_a_false_marker():
    splitter = ChannelSplitter(MARKERS, start_in_reasoning=True)
    out = splitter.push("hmm</think>a <t")
    assert (out.reasoning, out.content) == ("hmm", "a ")
    assert splitter.finish().content == "<t"  # held as a possible marker, then released


def test_an_unparsable_block_or_an_unknown_tool_stays_text():
    assert parse_calls(FALLBACK_FORMAT, "{not json", TOOLS, 0) is None
    assert parse_calls(FALLBACK_FORMAT, '{"name": "nope", "arguments": {}}', TOOLS, 0) is None
    calls = parse_calls(FALLBACK_FORMAT, '{"name": "f", "parameters": {"a": 2}}', TOOLS, 3)
    assert calls is not None and calls[0].index == 3 and json.loads(calls[0].arguments) == {"a": 2}
    assert calls[0].id and calls[0].id.startswith("call_")


def test_forced_call_streams_id_and_name_once_then_the_arguments():
    text = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris"}}'
    stream, pieces = ForcedCallStream(), Piece()
    for char in text:
        piece = Piece(tool_calls=stream.push(char))
        pieces.add(piece)
    pieces.add(Piece(tool_calls=stream.finish(complete=True)))
    (call,) = pieces.tool_calls
    assert call.name == "get_weather" and call.id
    assert json.loads(call.arguments) == {"city": 'Pa"ris'}


@pytest.fixture(scope="module")
def agent_tokenizer(tmp_path_factory):
    return load_tokenizer(write_agent_tokenizer(tmp_path_factory.mktemp("agent") / "m"))


def script_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(text) for text in AGENT_SCRIPT[1:-1]]


def run(tokenizer, shape: AnswerShape, ids: list[int]) -> Piece:
    stream, total = AnswerStream(tokenizer, [], shape), Piece()
    for token in ids:
        piece, hit = stream.push(token)
        assert not hit
        total.add(piece)
    return total.add(stream.finish(complete=True))


def test_the_agent_script_is_reasoning_then_two_calls(agent_tokenizer):
    shape = AnswerShape(markers=MARKERS, starts_in_reasoning=True, tools=TOOLS)
    answer = run(agent_tokenizer, shape, script_ids(agent_tokenizer))
    assert answer.reasoning == AGENT_THOUGHT
    assert answer.text == ""  # the newlines around the call blocks are not an answer
    called = [(c.index, c.name, json.loads(c.arguments)) for c in answer.tool_calls]
    assert called == [(i, name, args) for i, (name, args) in enumerate(AGENT_CALLS)]


def test_one_call_only_when_parallel_calls_are_off(agent_tokenizer):
    shape = AnswerShape(
        markers=MARKERS, starts_in_reasoning=True, tools=TOOLS, parallel_tool_calls=False
    )
    answer = run(agent_tokenizer, shape, script_ids(agent_tokenizer))
    assert [c.name for c in answer.tool_calls] == [AGENT_CALLS[0][0]]


def test_without_tools_the_blocks_are_answer_text(agent_tokenizer):
    shape = AnswerShape(markers=Markers(think=MARKERS.think), starts_in_reasoning=True)
    answer = run(agent_tokenizer, shape, script_ids(agent_tokenizer))
    assert answer.tool_calls == [] and answer.text.count("<tool_call>") == 2


def test_a_block_that_is_no_call_comes_back_in_place():
    shape = AnswerShape(markers=MARKERS, tools=TOOLS)
    stream = AnswerStream(None, [], shape)
    text = 'Hi\n<tool_call>{"name": "nope"}</tool_call> bye'
    answer = stream._route(text).add(stream.finish(complete=True))
    assert answer.text == text and answer.tool_calls == []
