"""Mixed agent sessions for the agent soak (tests/test_agent_soak.py), and the memory of the
ranks sampled while they run.

Every client runs sessions one after another until the time is up. A session is what a
coding agent sends: a long system prompt and tool definitions shared by every session
(the prefix cache's work), an environment message of its own (working directory, date),
then turns, each resending the whole history: a question; a tool round trip (the
agent's read_file call and the file's text as its result); an edit ("return the whole
file with one change", which copies the file: speculation's work); a streamed answer the
client cancels after a few chunks (it closes the connection); a test run's long log as a
tool result and a question about it. A session ends once its history passes
`session_chars`. Greedy answers, streamed with usage.

Nothing may be lost: every request that was not cancelled ends with its usage, and every
cancelled one got the chunks it read. Memory: each rank's resident memory every second,
and the prefix cache's bytes on rank 0 (/cluster/status) every 10 s.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.loadgen import function_tool
from bench.stats import TokenCounts
from ipc.processes import rss_bytes

TOOLS = [
    function_tool(name, description, {arg: f"the {arg}"})
    for name, description, arg in (
        ("read_file", "Read a file of the project and return its text.", "path"),
        ("edit_file", "Replace a file's text with new text.", "path"),
        ("run_tests", "Run the project's tests and return their log.", "selection"),
        ("search", "Search the project for a pattern.", "pattern"),
    )
]
RULE = (
    "Rule {i}: before you change module_{i}.py read it, run its tests, keep its public names "
    "stable, explain each change in one line, and never edit generated files or vendored code."
)
EDITS = [
    "rename the method `fetch` to `load`",
    "change the default timeout from 30 to 45",
    "add a docstring to the class",
    "change the retry count from 3 to 5",
]


def system_prompt(chars: int) -> str:
    """The system text every session shares (about chars / 4 tokens)."""
    head = "You are a coding agent working in a large repository. Follow every rule.\n"
    rules: list[str] = []
    while len(head) + sum(len(rule) + 1 for rule in rules) < chars:
        rules.append(RULE.format(i=len(rules)))
    return head + "\n".join(rules)


def source_file(session: int, functions: int) -> str:
    """A Python file of its own for each session."""
    lines = [f'"""Module {session}: fetches and caches records."""', "", "import time", ""]
    lines += [f"class Store{session}:", "    def __init__(self, timeout=30, retries=3):"]
    lines += ["        self.timeout = timeout", "        self.retries = retries", ""]
    for i in range(functions):
        lines += [
            f"    def fetch_{i}(self, key):",
            f"        for attempt in range(self.retries):  # record kind {i}",
            f"            value = self._get(key, {i}, attempt)",
            "            if value is not None:",
            "                return value",
            "            time.sleep(0.1 * attempt)",
            "        return None",
            "",
        ]
    return "\n".join(lines) + "\n"


def test_log(session: int, cases: int) -> str:
    rows = [f"tests/test_store_{session}.py::test_case_{i} PASSED" for i in range(cases)]
    rows[cases // 2] = f"tests/test_store_{session}.py::test_case_{cases // 2} FAILED"
    return "\n".join(rows) + f"\n1 failed, {cases - 1} passed in 3.2s\n"


class TimeUp(Exception):
    """The soak's time is up: the session ends before its next turn."""


@dataclass
class Turn(TokenCounts):
    kind: str = "ask"  # ask, tool, edit, cancel, log
    ok: bool = False
    cancelled: bool = False
    chunks: int = 0
    seconds: float = 0.0
    error: str = ""
    text: str = ""


@dataclass
class SoakRun:
    seconds: float
    warmup_s: float
    turns: list[Turn] = field(default_factory=list)
    sessions: int = 0
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    prefix_bytes: list[tuple[float, int]] = field(default_factory=list)
    elapsed: float = 0.0

    def lost(self) -> list[Turn]:
        """Turns that neither finished with usage nor were cancelled by the client."""
        return [t for t in self.turns if not t.ok and not t.cancelled]

    def memory(self, window_s: float = 30.0) -> dict[str, tuple[int, int]]:
        """name: (median RSS in the window after the warm-up, median in the last window)."""
        out = {}
        for name, samples in self.rss.items():
            after = [v for t, v in samples if self.warmup_s <= t < self.warmup_s + window_s]
            last = [v for t, v in samples if t >= self.seconds - window_s]
            if after and last:
                out[name] = (int(statistics.median(after)), int(statistics.median(last)))
        return out

    def prefix_at(self, moment: float) -> int:
        """Rank 0's prefix-cache bytes at the sample nearest `moment`."""
        if not self.prefix_bytes:
            return 0
        return min(self.prefix_bytes, key=lambda sample: abs(sample[0] - moment))[1]

    def describe(self, budget: int) -> str:
        kinds: dict[str, int] = {}
        for turn in self.turns:
            kinds[turn.kind] = kinds.get(turn.kind, 0) + 1
        done = [t for t in self.turns if t.ok]
        prompt = sum(t.prompt_tokens for t in done)
        cached = sum(t.cached_tokens for t in done)
        lines = [
            f"{len(self.turns)} requests in {self.sessions} sessions over {self.elapsed:.0f} s "
            f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); "
            f"{len(done)} finished with usage, {sum(t.cancelled for t in self.turns)} "
            f"cancelled by the client, {len(self.lost())} lost; prompt tokens {prompt}, "
            f"{cached} of them cached ({cached / max(prompt, 1):.0%}); "
            f"{sum(t.completion_tokens for t in done)} completion tokens"
        ]
        start_prefix = self.prefix_at(self.warmup_s)
        end_prefix = self.prefix_at(self.seconds)
        for name, (start, end) in self.memory().items():
            growth = end - start
            lines.append(
                f"  {name}: RSS {start / 2**20:.0f} MiB after the warm-up, {end / 2**20:.0f} "
                f"MiB at the end ({growth / start:+.1%}); beyond the prefix cache's budget "
                f"({budget / 2**20:.0f} MiB): {(growth - budget) / start:+.1%}; beyond its "
                f"growth on rank 0 ({start_prefix / 2**20:.0f} -> {end_prefix / 2**20:.0f} "
                f"MiB): {(growth - (end_prefix - start_prefix)) / start:+.1%}"
            )
        return "\n".join(lines)


async def _turn(
    http: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    kind: str,
    cancel_after: int | None = None,
) -> Turn:
    turn = Turn(kind=kind)
    body = {
        "model": "default",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return turn
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    turn.error = str(event["error"])[:300]
                    break
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        turn.chunks += 1
                        turn.text += delta.get("content") or ""
                usage = event.get("usage")
                if usage:
                    turn.take_usage(usage)
                    turn.ok = not turn.error
                if cancel_after is not None and turn.chunks >= cancel_after:
                    turn.cancelled = True  # leaving the block closes the connection
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"[:300]
    turn.seconds = time.monotonic() - started
    if turn.cancelled and turn.ok:
        turn.cancelled = False  # it ended before the client could cancel it
    return turn


async def session(
    http: httpx.AsyncClient,
    url: str,
    system: str,
    number: int,
    run: SoakRun,
    chars: int,
    deadline: float,
) -> None:
    """One agent session: its turns, in order, until its history passes `chars` (or the
    soak's deadline comes)."""
    source = source_file(number, 6 + number % 5)
    path = f"src/store_{number}.py"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"<env>cwd: /home/dev/project-{number}; date: 2026-11-{1 + number % 28}"
            f"</env>\nLook at {path} and improve it.",
        },
    ]

    async def ask(kind: str, max_tokens: int, cancel_after: int | None = None) -> Turn:
        if time.monotonic() >= deadline:
            raise TimeUp
        turn = await _turn(http, url, messages, max_tokens, kind, cancel_after)
        run.turns.append(turn)
        return turn

    first = await ask("ask", 48)
    messages.append({"role": "assistant", "content": first.text or "I will read the file."})
    round_trips = 0
    while sum(len(str(m.get("content", ""))) for m in messages) < chars:
        round_trips += 1
        call_id = f"call_{number}_{round_trips}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": source})
        summary = await ask("tool", 64)
        messages.append({"role": "assistant", "content": summary.text or "It fetches records."})
        change = EDITS[(number + round_trips) % len(EDITS)]
        messages.append(
            {
                "role": "user",
                "content": f"Return the whole file {path} with one change: {change}. Reply "
                "with the complete file in one code block and nothing else.",
            }
        )
        edit = await ask("edit", 320)
        messages.append({"role": "assistant", "content": edit.text or source})
        messages.append({"role": "user", "content": "Explain the change in detail."})
        cancelled = await ask("cancel", 200, cancel_after=3 + (number + round_trips) % 6)
        messages.append({"role": "assistant", "content": cancelled.text})
        messages.append({"role": "user", "content": "Run the tests."})
        log_id = f"log_{number}_{round_trips}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": log_id,
                        "type": "function",
                        "function": {
                            "name": "run_tests",
                            "arguments": json.dumps({"selection": path}),
                        },
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": log_id, "content": test_log(number, 40 + number % 30)}
        )
        failed = await ask("log", 48)
        messages.append({"role": "assistant", "content": failed.text or "One test failed."})
        messages.append({"role": "user", "content": "Fix the failing case."})


async def soak(
    url: str,
    clients: int,
    seconds: float,
    warmup_s: float,
    pids: dict[str, int],
    system_chars: int = 10_000,
    session_chars: int = 14_000,
) -> SoakRun:
    """`clients` agents for `seconds`; RSS of `pids` (name: pid) every second."""
    run = SoakRun(seconds=seconds, warmup_s=warmup_s)
    run.rss = {name: [] for name in pids}
    started = time.monotonic()
    deadline = started + seconds
    system = system_prompt(system_chars)
    numbers = iter(range(1_000_000))

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            run.sessions += 1
            try:
                await session(http, url, system, next(numbers), run, session_chars, deadline)
            except TimeUp:
                return

    async def sampler(http: httpx.AsyncClient) -> None:
        tick = 0
        while time.monotonic() < deadline:
            now = time.monotonic() - started
            for name, pid in pids.items():
                rss = rss_bytes(pid)
                if rss is not None:
                    run.rss[name].append((now, rss))
            if tick % 10 == 0:
                try:
                    status = (await http.get(f"{url}/cluster/status", timeout=10)).json()
                    run.prefix_bytes.append((now, status["prefix_cache"]["bytes"]))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
            tick += 1
            await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        await asyncio.gather(sampler(http), *(client(http) for _ in range(clients)))
    run.elapsed = time.monotonic() - started
    return run
