"""Rank 0's chat prompt: a conversation (with tool calls and results), the offered tools
and the thinking switch, rendered through the model's chat template.

Tools reach the model natively when its template shows them and mlx-lm knows how to parse
its calls; otherwise through the fallback prompt below (tools described in the system
message, earlier calls and results rewritten as text), whose `<tool_call>` blocks the
fallback format parses. A forced call (tool_choice required or a function) or an output
format turns thinking off and, for `<tool_call>` formats, opens the block in the prompt.
An agent's system prompt has its paragraphs that name a directory moved last
(leader/volatile_system.py), so sessions in other projects share the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ipc.protocol import ChatMessage, Submit, ToolSpec
from leader.tool_calls import FALLBACK_FORMAT, ToolFormat, tool_dict
from leader.volatile_system import PARAGRAPH_BREAK, split_volatile

PROBE_TOOL = ToolSpec(name="probe_7f3a_tool", description="probe")

FALLBACK_TOOLS_PROMPT = """# Tools

You may call one or more functions to answer. Each is described by a JSON schema:
<tools>
{tools}
</tools>

To call a function, answer with one block per call and nothing after the last block:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}
</tool_call>
If no function is needed, answer normally, without any <tool_call> block."""


def forced_call(submit: Submit) -> bool:
    return bool(submit.tools) and submit.tool_choice.mode in ("required", "function")


def offered_tools(submit: Submit) -> list[ToolSpec]:
    """The tools the model sees: none for tool_choice none."""
    return [] if submit.tool_choice.mode == "none" else submit.tools


def choice_rule(submit: Submit) -> str:
    """The fallback prompt's line for tool_choice and parallel_tool_calls."""
    lines = []
    if submit.tool_choice.mode == "required":
        lines.append("You must call at least one function.")
    elif submit.tool_choice.mode == "function":
        lines.append(f"You must call the function {submit.tool_choice.name}.")
    if not submit.parallel_tool_calls:
        lines.append("Call at most one function.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Rendered:
    """The prompt text and how the answer starts: inside an open thinking block, or (a
    forced call) inside an opened tool block."""

    text: str
    starts_in_reasoning: bool


class ChatPrompt:
    """Renders chats for one tokenizer; knows its tool format and thinking markers."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer
        native = bool(getattr(tokenizer, "has_tool_calling", False)) and self._shows_tools()
        if native:
            start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
            self.tool_format = ToolFormat(start, end, tokenizer.tool_parser, native=True)
        else:
            self.tool_format = FALLBACK_FORMAT
        self.think: tuple[str, str] | None = None
        if getattr(tokenizer, "has_thinking", False):
            self.think = (tokenizer.think_start, tokenizer.think_end)

    def _shows_tools(self) -> bool:
        """Does the template render a tool it is given? (A template that knows no tools
        silently ignores them.)"""
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}],
                tools=[tool_dict(PROBE_TOOL)],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception:  # a template that refuses tools does not show them
            return False
        return PROBE_TOOL.name in text

    def describe(self) -> str:
        tools = "native" if self.tool_format.native else "fallback prompt"
        think = f"{self.think[0]} ... {self.think[1]}" if self.think else "none"
        return f"tool calls: {tools} ({self.tool_format.start}); thinking markers: {think}"

    def render(self, submit: Submit, constrained: bool) -> Rendered:
        """The prompt for a chat Submit; `constrained`: a grammar decides the answer."""
        assert submit.messages is not None
        tools = offered_tools(submit)
        history, last_paragraphs = directories_last(submit.messages, tools)
        if self.tool_format.native:
            messages = [native_message(m) for m in history]
        else:
            messages = fallback_messages(history, tools, choice_rule(submit), last_paragraphs)
        kwargs: dict[str, Any] = {}
        if constrained:
            kwargs["enable_thinking"] = False
        elif submit.enable_thinking is not None:
            kwargs["enable_thinking"] = submit.enable_thinking
        if tools and self.tool_format.native:
            kwargs["tools"] = [tool_dict(tool) for tool in tools]
        last = submit.messages[-1]
        prefill = submit.continue_final_message and last.role == "assistant"
        prefill = prefill and bool(last.content) and not last.tool_calls
        if prefill:  # the answer continues the last turn: no new assistant turn is opened
            kwargs["continue_final_message"] = True
        if self.tool_format.native and last_paragraphs:
            text = self._directories_after_tools(messages, last_paragraphs, prefill, kwargs)
        else:
            text = self._template(messages, prefill, kwargs)
        if forced_call(submit) and self.tool_format.json_blocks:
            return Rendered(text + self.tool_format.start + "\n", starts_in_reasoning=False)
        return Rendered(text, starts_in_reasoning=self._open_thinking(text))

    def _template(self, messages: list[dict[str, Any]], prefill: bool, kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=not prefill, tokenize=False, **kwargs
        )

    def _directories_after_tools(
        self, messages: list[dict[str, Any]], paragraphs: str, prefill: bool, kwargs: dict
    ) -> str:
        """A native template renders the tools after the first system message: the
        directory's paragraphs go in a second system message after it, where the template
        renders one; else (it refuses or drops it) wherever more of the prompt comes before
        them: the opening of the first user message (after the tools, where the template
        renders them in the system turn) or the end of the first system message."""
        apart = [messages[0], {"role": "system", "content": paragraphs}, *messages[1:]]
        text = self._rendered_with(apart, paragraphs, prefill, kwargs)
        if text is not None:
            return text
        first = {**messages[0], "content": _joined(messages[0]["content"], paragraphs)}
        in_system = self._template([first, *messages[1:]], prefill, kwargs)
        placed: list[str | None] = [in_system]
        user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if user is not None and isinstance(messages[user]["content"], str):
            opened = {**messages[user], "content": _joined(paragraphs, messages[user]["content"])}
            in_user = [*messages[:user], opened, *messages[user + 1 :]]
            placed.append(self._rendered_with(in_user, paragraphs, prefill, kwargs))
        where = paragraphs.strip()
        kept = [text for text in placed if text is not None and where in text]
        # the later the paragraphs, the more two projects share; a tie keeps the system's
        return max(kept, key=lambda text: text.index(where), default=in_system)

    def _rendered_with(
        self, messages: list[dict[str, Any]], paragraphs: str, prefill: bool, kwargs: dict
    ) -> str | None:
        """`messages` rendered, where the template takes them and keeps `paragraphs`."""
        try:
            text = self._template(messages, prefill, kwargs)
        except Exception:  # a template that refuses the layout
            return None
        return text if paragraphs.strip() in text else None

    def _open_thinking(self, text: str) -> bool:
        """The prompt ends inside a thinking block (the template opened it)."""
        if self.think is None:
            return False
        return text.rfind(self.think[0]) > text.rfind(self.think[1])


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # templates render it as given


def native_message(message: ChatMessage) -> dict[str, Any]:
    """A message as tool-aware templates take it: call arguments as objects (some
    templates iterate them), content never None (it would be dropped before rendering)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def call_block(name: str, arguments: str) -> str:
    call = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"{FALLBACK_FORMAT.start}\n{call}\n{FALLBACK_FORMAT.end}"


def _joined(*parts: str) -> str:
    return PARAGRAPH_BREAK.join(part for part in parts if part)


def directories_last(
    history: list[ChatMessage], tools: list[ToolSpec]
) -> tuple[list[ChatMessage], str]:
    """With tools offered, the history with its first system message less the paragraphs
    that name a path, and those paragraphs (leader/volatile_system.py); else as it is."""
    if not tools or not history or history[0].role != "system":
        return history, ""
    stable, volatile = split_volatile(history[0].content)
    if not volatile:
        return history, ""
    return [history[0].model_copy(update={"content": stable}), *history[1:]], volatile


def fallback_messages(
    history: list[ChatMessage], tools: list[ToolSpec], rule: str, after_tools: str = ""
) -> list[dict[str, str]]:
    """Plain system/user/assistant turns any template renders: the tools block in the
    system message (then `after_tools`), calls as `<tool_call>` blocks, results as
    `<tool_response>` blocks in a user turn (consecutive results share one)."""
    names = {call.id: call.name for m in history for call in m.tool_calls}
    out: list[dict[str, str]] = []
    previous = ""
    for message in history:
        if message.role == "tool":
            name = message.name or names.get(message.tool_call_id or "", "")
            result = json.dumps({"name": name, "content": message.content}, ensure_ascii=False)
            block = f"<tool_response>\n{result}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            content = message.content
            if message.tool_calls:
                blocks = [call_block(call.name, call.arguments) for call in message.tool_calls]
                content = "\n".join([content, *blocks] if content else blocks)
            out.append({"role": message.role, "content": content})
        previous = message.role
    if tools:
        listed = "\n".join(json.dumps(tool_dict(t), ensure_ascii=False) for t in tools)
        block = FALLBACK_TOOLS_PROMPT.format(tools=listed) + (f"\n{rule}" if rule else "")
        if out and out[0]["role"] == "system":
            out[0]["content"] = _joined(out[0]["content"], block, after_tools)
        else:
            out.insert(0, {"role": "system", "content": _joined(block, after_tools)})
    return out
