"""Edit and tool-argument workloads for speculation, written apart from the rule they judge:
files of 160 to 1,600 tokens in Python, JavaScript, Markdown and JSON (bench/workloads/),
whole-file edits asked before or after the file, an answer that opens with prose, a Claude
Code Edit call's old and new strings and a Codex apply_patch, plus a free text control.
Each is a chat any OpenAI-compatible server takes as it is. HELD_OUT is a second set
(bench/workloads/held_out/: Go, YAML, SQL, HTML, Rust; a file read in an earlier turn; a
second free-text control), written after the rule was last tuned and never used to tune it:
the check that the rule holds on prompts it has not seen. FRESH is a third such set
(bench/workloads/fresh/: CSS, TypeScript, shell, C; an agent's edit whose file came back
from its read_file tool call, with tools in the request; a second change to the model's own
answer; a third free text). ASKS is a fourth (bench/workloads/asks/): requests whose
fields (a forced tool call, a JSON schema, logprobs, a penalty) switched speculation off
until 2026-12-01 (bench/own_workloads.py edits this repository's own files). The default
model (SmolLM2, 135M) follows some of them and not others (it does not copy the
1,600-token file): each answer's share of copied tokens is reported beside its speed.

`copied` measures what an answer copies: the tokens that lie in runs of at least RUN
tokens found verbatim in the prompt; the share of them that speculation accepted is what
bench/spec_edits.py reports per workload.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import function_tool

FILES = Path(__file__).parent / "workloads"
RUN = 8  # tokens: a copy shorter than this is not counted as one


@dataclass(frozen=True)
class Workload:
    name: str
    messages: list[dict[str, Any]]  # as /v1/chat/completions takes them
    max_tokens: int
    edit: bool = True  # False: the free-text control
    tools: list[dict[str, Any]] | None = None  # the request's tools, OpenAI's shape
    fields: dict[str, Any] | None = None  # more of the request (tool_choice, logprobs, ...)

    def body(self) -> dict[str, Any]:
        """The request a client sends (greedy, streamed by the sender)."""
        extra = {"tools": self.tools} if self.tools else {}
        more = self.fields or {}
        return {"messages": self.messages, "max_tokens": self.max_tokens, **extra, **more}


def _file(name: str) -> str:
    return (FILES / name).read_text()


def _first(change: str, name: str, language: str, ending: str) -> list[dict]:
    """The change asked first, the file after it."""
    user = f"Make one change to this file: {change}. {ending}\n\n```{language}\n{_file(name)}```"
    return [{"role": "user", "content": user}]


def _last(change: str, name: str, language: str, ending: str) -> list[dict]:
    """The file first, the change asked after it."""
    user = (
        f"Here is a {language} file:\n\n```{language}\n{_file(name)}```\n\n"
        f"Return the whole file with one change: {change}. {ending}"
    )
    return [{"role": "user", "content": user}]


WHOLE = "Reply with the complete file in one code block and nothing else."


def _prose_first() -> list[dict]:
    """An answer that opens with a sentence, then writes the file out."""
    user = (
        "Explain in one sentence what you will change, then write out the complete JSON with "
        f"one change: turn split_payments on.\n\n```json\n{_file('settings.json')}```"
    )
    return [{"role": "user", "content": user}]


def _edit_call() -> list[dict]:
    """Claude Code's Edit tool: its old_string copies the file, its new_string too, changed."""
    path = "/srv/app/server.js"
    return [
        {
            "role": "user",
            "content": f"Here is {path}:\n```javascript\n{_file('server.js')}```\n"
            "Write the JSON arguments of an Edit tool call that adds a /health route: "
            f'{{"file_path": "{path}", "old_string": <the request handler, copied exactly>, '
            '"new_string": <the same handler with a /health branch>}.',
        },
    ]


def _apply_patch() -> list[dict]:
    """Codex's apply_patch: hunks whose context lines copy the file."""
    return [
        {
            "role": "user",
            "content": f"Here is server.js:\n```javascript\n{_file('server.js')}```\n"
            "Write an apply_patch patch (*** Begin Patch, *** Update File: server.js, @@ hunks "
            "with ' ' context, '-' and '+' lines, *** End Patch) that makes stats() also report "
            "the PORT.",
        },
    ]


WORKLOADS = [
    Workload(
        "python 160", _first("catch OSError, not ConnectionError", "retry.py", "python", WHOLE), 260
    ),
    Workload(
        "javascript 540",
        _last("serve /stats to GET requests from 127.0.0.1 only", "server.js", "javascript", WHOLE),
        700,
    ),
    Workload(
        "markdown 515",
        _first("the release to install is 4.3.0, not 4.2.1", "guide.md", "markdown", WHOLE),
        650,
    ),
    Workload(
        "json 300",
        _first("turn split_payments on and use 8 workers", "settings.json", "json", WHOLE),
        400,
    ),
    Workload("json 300, prose first", _prose_first(), 450),
    Workload(
        "javascript 1600", _last("products cost 10% more", "store.js", "javascript", WHOLE), 1800
    ),
    Workload("Claude Code Edit call", _edit_call(), 700),
    Workload("Codex apply_patch", _apply_patch(), 600),
    Workload(
        "free text",
        [
            {
                "role": "user",
                "content": "Write a short essay about how lighthouses were kept before "
                "electricity: the keepers, their days, the lamps and the storms.",
            },
        ],
        300,
        edit=False,
    ),
]


def _held(name: str) -> str:
    return _file(f"held_out/{name}")


def _earlier_turn() -> list[dict]:
    """The file read in an earlier turn (as an agent's tool result is), the edit asked now."""
    return [
        {
            "role": "user",
            "content": f"What does this page show?\n\n```html\n{_held('page.html')}```",
        },
        {
            "role": "assistant",
            "content": "It shows today's four tides at the harbour, with "
            "their times and heights, under a header with three links.",
        },
        {"role": "user", "content": "Change its title and heading to Harbour Tides. " + WHOLE},
    ]


HELD_OUT = [
    Workload(
        "go 600",
        _last("Stats also returns the number of entries", "held_out/cache.go", "go", WHOLE),
        800,
    ),
    Workload(
        "yaml 400",
        _first("run 5 replicas of image 2.8.0", "held_out/deploy.yaml", "yaml", WHOLE),
        550,
    ),
    Workload(
        "sql 250, prose first",
        [
            {
                "role": "user",
                "content": "Say in one sentence what you will change, then write the whole "
                "query with one change: count only orders from 2026.\n\n```sql\n"
                f"{_held('report.sql')}```",
            }
        ],
        400,
    ),
    Workload("html 350, an earlier turn", _earlier_turn(), 500),
    Workload(
        "rust 450",
        _first(
            "parse_line also accepts ':' between key and value", "held_out/parse.rs", "rust", WHOLE
        ),
        650,
    ),
    Workload(
        "free text 2",
        [
            {
                "role": "user",
                "content": "Tell me how a loaf of sourdough bread is made, from "
                "feeding the starter to the first slice.",
            }
        ],
        300,
        edit=False,
    ),
]


def _fresh(name: str) -> str:
    return _file(f"fresh/{name}")


AGENT_TOOLS = [
    function_tool("read_file", "Read a file of the project.", {"path": ""}),
    function_tool(
        "edit_file",
        "Replace old_string, copied exactly from the file, with new_string.",
        {"path": "", "old_string": "", "new_string": ""},
    ),
]


def _after_read() -> list[dict[str, Any]]:
    """An agent's turn: the file came back from its read_file call; the edit is next."""
    call = {"path": "gym/scheduler.py"}
    return [
        {"role": "system", "content": "You are a coding agent. Use the tools to read and edit."},
        {
            "role": "user",
            "content": "In gym/scheduler.py, make book() refuse a member whose email is "
            "empty with a BookingError.",
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps(call)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": _fresh("scheduler.py")},
    ]


def _second_change() -> list[dict[str, Any]]:
    """A second change to a file the model already returned changed: the answer copies
    the model's own earlier answer."""
    source = _fresh("ring_buffer.c")
    changed = source.replace("#define RING_CAPACITY 64", "#define RING_CAPACITY 128")
    return [
        {
            "role": "user",
            "content": f"```c\n{source}```\n\nSet RING_CAPACITY to 128. {WHOLE}",
        },
        {"role": "assistant", "content": f"```c\n{changed}```"},
        {"role": "user", "content": f"Now make ring_mean return 0 for a NULL ring too. {WHOLE}"},
    ]


# A third set, written on 2026-11-29 after every tuning of the rule (C, CSS, TypeScript,
# shell, an agent's edit after its read_file call, a second change to the model's own
# answer), and a third free-text control.
FRESH = [
    Workload("css 400", _first("the accent is #8f3f2f", "fresh/theme.css", "css", WHOLE), 550),
    Workload(
        "typescript 700",
        _last("TAX_RATE is 0.19", "fresh/invoices.ts", "typescript", WHOLE),
        900,
    ),
    Workload(
        "shell 250, prose first",
        [
            {
                "role": "user",
                "content": "Say in one sentence what you will change, then give the whole "
                "script with one change: keep 30 snapshots.\n\n```bash\n"
                f"{_fresh('backup.sh')}```",
            }
        ],
        400,
    ),
    Workload("python 850, after read_file", _after_read(), 500, tools=AGENT_TOOLS),
    Workload("c 600, a second change", _second_change(), 800),
    Workload(
        "free text 3",
        [
            {
                "role": "user",
                "content": "Describe a walk along a river at dawn in early spring: the "
                "light, the birds, the people you meet.",
            }
        ],
        300,
        edit=False,
    ),
]


def _invoice() -> list[dict[str, Any]]:
    """Fields copied out of a text into a schema's JSON (asks/invoice.schema.json)."""
    return [
        {"role": "user", "content": f"Extract the invoice's fields.\n\n{_file('asks/invoice.txt')}"}
    ]


EDIT_FILE = {"type": "function", "function": {"name": "edit_file"}}

# A fourth set, written on 2026-12-01: requests whose fields turned speculation off until
# that day (a forced tool call, a JSON schema, logprobs, a penalty), each an edit or an
# extraction that copies its prompt.
ASKS = [
    Workload(
        "edit_file forced, after read_file",
        _after_read(),
        500,
        tools=AGENT_TOOLS,
        fields={"tool_choice": EDIT_FILE},
    ),
    Workload(
        "invoice, a JSON schema",
        _invoice(),
        400,
        fields={
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "invoice",
                    "schema": json.loads(_file("asks/invoice.schema.json")),
                },
            }
        },
    ),
    Workload(
        "python 160, logprobs",
        _first("catch OSError, not ConnectionError", "retry.py", "python", WHOLE),
        260,
        fields={"logprobs": True, "top_logprobs": 2},
    ),
    Workload(
        "markdown 515, presence_penalty",
        _first("the release to install is 4.3.0, not 4.2.1", "guide.md", "markdown", WHOLE),
        650,
        fields={"presence_penalty": 0.1},
    ),
]

SETS = {
    "tuned": WORKLOADS,
    "held-out": HELD_OUT,
    "fresh": FRESH,
    "asks": ASKS,
    "all": WORKLOADS + HELD_OUT + FRESH + ASKS,
}


def copied(answer: list[int], prompt: list[int], run: int = RUN) -> list[bool]:
    """Per answer token: whether it lies in a run of at least `run` tokens that occur
    verbatim, in that order, in the prompt."""
    grams = {tuple(prompt[i : i + run]) for i in range(len(prompt) - run + 1)}
    mask = [False] * len(answer)
    for start in range(len(answer) - run + 1):
        if tuple(answer[start : start + run]) in grams:
            mask[start : start + run] = [True] * run
    return mask
