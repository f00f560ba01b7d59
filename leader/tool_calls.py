"""Tool calls in the model's output: the format (markers and parser), parsing a finished
call block, and streaming a grammar-forced call as OpenAI-style argument pieces.

Native formats come from mlx-lm's tokenizer (it infers the family's markers and parser
from the chat template). Models without one use the fallback format the fallback prompt
teaches (leader/chat_prompt.py): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
the Hermes/Qwen format many models were trained on.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc.protocol import ToolCallDelta, ToolSpec

log = logging.getLogger("ring.scheduler")

Parser = Callable[[str, Any], Any]  # text between the markers, tools -> call dict(s)


def _parse_json_call(text: str, _tools: Any = None) -> Any:
    return json.loads(text.strip())


@dataclass(frozen=True)
class ToolFormat:
    """How this model writes tool calls: `start` ... `end` around each (an empty `end`:
    the calls run to the end of the answer), and the parser for the text between."""

    start: str
    end: str
    parse: Parser
    native: bool  # the chat template shows tools itself (else the fallback prompt does)

    @property
    def json_blocks(self) -> bool:
        """Calls are `<tool_call>` blocks of JSON: a forced call can be prefilled with the
        opening marker, so the model writes the JSON where it was trained to."""
        return self.start == "<tool_call>" and self.parse in (_parse_json_call, *_JSON_PARSERS)


FALLBACK_FORMAT = ToolFormat("<tool_call>", "</tool_call>", _parse_json_call, native=False)
_JSON_PARSERS: tuple[Parser, ...] = ()
try:  # mlx-lm's json_tools parser reads the same blocks
    from mlx_lm.tool_parsers import json_tools

    _JSON_PARSERS = (json_tools.parse_tool_call,)
except ImportError:  # pragma: no cover - mlx-lm always ships it
    pass


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(arguments: Any) -> str | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def parse_calls(
    tool_format: ToolFormat, text: str, tools: list[ToolSpec], first_index: int
) -> list[ToolCallDelta] | None:
    """The calls in one block's text, numbered from `first_index`; None when the text is
    not a call of an offered tool (the block is then kept as answer text)."""
    openai_tools = [tool_dict(tool) for tool in tools]
    try:
        parsed = tool_format.parse(text, openai_tools)
    except Exception as exc:  # parsers raise ValueError, JSONDecodeError, KeyError, ...
        log.info("a tool call block did not parse (%s); kept as text", type(exc).__name__)
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    names = {tool.name for tool in tools}
    calls = []
    for offset, item in enumerate(items):
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        arguments = _arguments_text(item.get("arguments", item.get("parameters", {})))
        if name not in names or arguments is None:
            log.info("a tool call names no offered tool or has no argument object; kept as text")
            return None
        call_id = item.get("id") if isinstance(item.get("id"), str) else new_call_id()
        index = first_index + offset
        calls.append(ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments))
    return calls


def tool_dict(tool: ToolSpec) -> dict[str, Any]:
    """A tool as chat templates and parsers take it (OpenAI's shape)."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


_FORCED_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class ForcedCallStream:
    """The text of a grammar-forced call, {"name": "f", "arguments": {...}}, as pieces:
    id and name once the head is complete, then the arguments as they grow. The last
    character is held back: when the grammar completes, it is the closing brace of the
    call, not of the arguments."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` already sent (head included)
        self.started = False

    def push(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        pieces = []
        if not self.started:
            head = _FORCED_HEAD.match(self.text)
            if head is None:
                return []
            self.started = True
            self.sent = head.end()
            name = json.loads(head.group(1))
            pieces.append(ToolCallDelta(index=0, id=new_call_id(), name=name))
        end = len(self.text) - 1
        if end > self.sent:
            pieces.append(ToolCallDelta(index=0, arguments=self.text[self.sent : end]))
            self.sent = end
        return pieces

    def finish(self, complete: bool) -> list[ToolCallDelta]:
        """The held-back rest; a complete call drops its closing brace."""
        if not self.started:
            return []
        rest = self.text[self.sent :]
        if complete and rest.endswith("}"):
            rest = rest[:-1]
        self.sent = len(self.text)
        return [ToolCallDelta(index=0, arguments=rest)] if rest else []
