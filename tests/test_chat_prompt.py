"""Rank 0's chat prompt: tools through a template that takes them, or through the
fallback prompt (tools in the system turn, calls and results rewritten as text); thinking
switched off and the call block opened when a grammar forces the answer."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_tokenizer

from ipc.protocol import ChatMessage, SamplingParams, Submit, ToolCall, ToolChoice, ToolSpec
from leader.chat_prompt import FALLBACK_TOOLS_PROMPT, ChatPrompt
from tests.support.tiny_models import (
    AGENT_TEMPLATE,
    AGENT_WORDS,
    write_agent_tokenizer,
    write_byte_tokenizer,
)

WEATHER = ToolSpec(
    name="get_weather",
    description="Weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
HISTORY = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris and Rome?"),
    ChatMessage(
        role="assistant",
        content="",
        tool_calls=[
            ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),
            ToolCall(id="c2", name="get_weather", arguments='{"city": "Rome"}'),
        ],
    ),
    ChatMessage(role="tool", content="18C", tool_call_id="c1"),
    ChatMessage(role="tool", content="25C", tool_call_id="c2"),
]


def chat(messages=HISTORY, **fields) -> Submit:
    return Submit(id="r", messages=messages, params=SamplingParams(max_tokens=8), **fields)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chatml")
    write_byte_tokenizer(directory)
    return ChatPrompt(load_tokenizer(directory))


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    return ChatPrompt(load_tokenizer(write_agent_tokenizer(tmp_path_factory.mktemp("agent") / "m")))


@pytest.fixture(scope="module")
def one_system(tmp_path_factory):
    """The agent's template, refusing a system message anywhere but first (as some do)."""
    refusing = "{% if message.role == 'system' and not loop.first %}{{ raise_exception('no') }}"
    template = AGENT_TEMPLATE.replace(
        "{% for message in messages %}", "{% for message in messages %}" + refusing + "{% endif %}"
    )
    directory = tmp_path_factory.mktemp("one-system")
    write_byte_tokenizer(directory, AGENT_WORDS, template)
    return ChatPrompt(load_tokenizer(directory))


def test_a_template_without_tools_gets_the_fallback_prompt(plain):
    assert not plain.tool_format.native and plain.think is None
    text = plain.render(chat(tools=[WEATHER]), constrained=False).text
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps({"type": "function", "function": WEATHER.model_dump()}) in system
    assert FALLBACK_TOOLS_PROMPT.splitlines()[-1] in system
    # Earlier calls become <tool_call> blocks; both results share one user turn.
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    )
    results = text.split("<|im_start|>user\n")[-1]
    assert results.count("<tool_response>") == 2 and '"content": "25C"' in results
    assert "<|im_start|>tool" not in text


def test_the_fallback_prompt_states_the_tool_choice(plain):
    named = chat(tools=[WEATHER], tool_choice=ToolChoice(mode="function", name="get_weather"))
    text = plain.render(named, constrained=True).text
    assert "You must call the function get_weather." in text
    assert text.endswith("<|im_start|>assistant\n<tool_call>\n")  # the forced call's block
    single = plain.render(chat(tools=[WEATHER], parallel_tool_calls=False), constrained=False)
    assert "Call at most one function." in single.text
    hidden = plain.render(chat(tools=[WEATHER], tool_choice=ToolChoice(mode="none")), False)
    assert "# Tools" not in hidden.text


def test_a_template_with_tools_renders_them_itself(agent):
    assert agent.tool_format.native and agent.think == ("<think>", "</think>")
    rendered = agent.render(chat(tools=[WEATHER]), constrained=False)
    assert '"name": "get_weather"' in rendered.text.split("</tools>")[0]
    assert "# Tools\n<tools>" in rendered.text and "You may call" not in rendered.text
    assert '"arguments": {"city": "Rome"}' in rendered.text  # arguments as an object
    assert rendered.text.endswith("<think>") and rendered.starts_in_reasoning


def test_constrained_answers_do_not_think(agent):
    rendered = agent.render(chat(tools=[WEATHER]), constrained=True)
    assert rendered.text.endswith("<think></think>") and not rendered.starts_in_reasoning
    off = agent.render(chat(enable_thinking=False), constrained=False)
    assert not off.starts_in_reasoning


def test_a_final_assistant_turn_is_continued_when_asked(agent):
    prefill = [
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content="Sure"),
    ]
    continued = agent.render(chat(prefill, continue_final_message=True), constrained=False)
    assert continued.text.endswith("<|im_start|>assistant\nSure")
    closed = agent.render(chat(prefill), constrained=False)
    assert closed.text.endswith("Sure<|im_end|>\n<|im_start|>assistant\n<think>")


def agent_system(directory: str) -> list[ChatMessage]:
    """An agent's system prompt naming its project directory mid-way (as Claude Code's
    memory paragraph and opencode's <env> block do), a URL and a question."""
    system = (
        "You are a coding agent.\n\nSee https://example.com/docs/agents for help.\n\n"
        f"Your notes live in `{directory}/.notes/`. Keep them short.\n\n"
        "Answer in English."
    )
    return [ChatMessage(role="system", content=system), ChatMessage(role="user", content="Hi")]


@pytest.mark.parametrize("fixture", ["plain", "agent", "one_system"])
def test_an_agents_directory_moves_after_what_every_project_shares(fixture, request):
    """Two projects' prompts share everything before the directory's paragraph, the tools
    included (after them: the fallback prompt's system message, a second system message for
    a template that renders tools itself, or the opening of the first user message where
    the template takes one system message); every word is still there."""
    prompt = request.getfixturevalue(fixture)
    assert prompt.tool_format.native is (fixture != "plain")
    texts = [
        prompt.render(chat(agent_system(d), tools=[WEATHER]), constrained=False).text
        for d in ("/srv/alpha", "/home/me/beta")
    ]
    paragraph = "Your notes live in `/srv/alpha/.notes/`. Keep them short."
    before = texts[0].index(paragraph)
    assert texts[0][:before] == texts[1][: texts[1].index("Your notes live in `/home/me/beta")]
    shared = texts[0][:before]
    assert "You are a coding agent." in shared and "Answer in English." in shared
    assert "https://example.com/docs/agents" in shared  # a URL's path stays where it was
    assert '"name": "get_weather"' in shared
    if fixture == "one_system":  # the first user turn opens with it
        assert f"user\n{paragraph}\n\nHi" in texts[0]
    # without tools (a plain chat) the system prompt is rendered as sent
    plain_chat = prompt.render(chat(agent_system("/srv/alpha")), constrained=False).text
    assert "Keep them short.\n\nAnswer in English." in plain_chat
