"""Edit and tool-argument workloads for speculation, written apart from the rule they judge:
files of 160 to 1,600 tokens in Python, JavaScript, Markdown and JSON (bench/workloads/),
whole-file edits asked before or after the file, an answer that opens with prose, a Claude
Code Edit call's old and new strings and a Codex apply_patch, plus a free text control.
Each is a chat any OpenAI-compatible server takes as it is. HELD_OUT is a second set
(bench/workloads/held_out/: Go, YAML, SQL, HTML, Rust; a file read in an earlier turn; a
second free-text control), written after the rule was last tuned and never used to tune it:
the check that the rule holds on prompts it has not seen. `own_files()` edits this
repository's own files and asks for eight free texts of other kinds (bench/spec_replay.py
replays them without a server). The default model (SmolLM2,
135M) follows some of them and not others (it does not copy the 1,600-token file): each
answer's share of copied tokens is reported beside its speed.

`copied` measures what an answer copies: the tokens that lie in runs of at least RUN
tokens found verbatim in the prompt; the share of them that speculation accepted is what
bench/spec_edits.py reports per workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from config.settings import PROJECT_DIR

FILES = Path(__file__).parent / "workloads"
RUN = 8  # tokens: a copy shorter than this is not counted as one


@dataclass(frozen=True)
class Workload:
    name: str
    messages: list[dict[str, str]]
    max_tokens: int
    edit: bool = True  # False: the free-text control


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

# (name, a file of this repository, its language, the change asked, max_tokens)
OWN_EDITS = [
    ("own: rename in python", "leader/burst.py", "python", "rename `burst` to `take_burst`", 600),
    ("own: comment in python", "leader/sampler.py", "python", "a comment line at the top", 1200),
    ("own: bash", "scripts/settings.sh", "bash", "print 'done' at the end", 600),
    ("own: toml", "pyproject.toml", "toml", "requires-python is >=3.12", 600),
    ("own: bash, names", "scripts/ranks.sh", "bash", "every local variable in upper case", 900),
]
FREE_ASKS = {
    "story": "Write a short story about a fox who learns to swim.",
    "list": "List ten tips for keeping houseplants alive, one line each.",
    "explain": "Explain how a bicycle's gears work to a ten-year-old.",
    "letter": "Write a cover letter for a job as a baker.",
    "table": "What are the differences between TCP and UDP? Answer in a table.",
    "poem": "Write a poem about winter mornings in the city.",
    "bullets": "Summarise the causes of the French Revolution in five bullet points.",
    "recipe": "Give me a recipe for lentil soup with quantities.",
}


def own_files() -> list[Workload]:
    """OWN_EDITS of this repository's files (read now: they change with it, and so do the
    answers, prompts nobody wrote for the rule) and FREE_ASKS, for bench.spec_replay."""
    edits = []
    for name, path, language, change, max_tokens in OWN_EDITS:
        user = (
            f"Here is {path}:\n\n```{language}\n{(PROJECT_DIR / path).read_text()}```\n\n"
            f"Return the whole file with one change: {change}. {WHOLE}"
        )
        edits.append(Workload(name, [{"role": "user", "content": user}], max_tokens))
    free = [
        Workload(f"free: {name}", [{"role": "user", "content": ask}], 300, edit=False)
        for name, ask in FREE_ASKS.items()
    ]
    return edits + free


SETS = {"tuned": WORKLOADS, "held-out": HELD_OUT, "all": WORKLOADS + HELD_OUT}


def copied(answer: list[int], prompt: list[int], run: int = RUN) -> list[bool]:
    """Per answer token: whether it lies in a run of at least `run` tokens that occur
    verbatim, in that order, in the prompt."""
    grams = {tuple(prompt[i : i + run]) for i in range(len(prompt) - run + 1)}
    mask = [False] * len(answer)
    for start in range(len(answer) - run + 1):
        if tuple(answer[start : start + run]) in grams:
            mask[start : start + run] = [True] * run
    return mask
