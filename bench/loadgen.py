"""Load generator for any OpenAI-compatible chat endpoint (streaming).

    .venv/bin/python -m bench.loadgen --url http://127.0.0.1:8100 --concurrency 8 \
        --requests 8 --max-tokens 128 [--model default] [--json out.json]

Per request it records the time to first token (first non-empty content delta), the
mean inter-token latency and the decode rate ((completion tokens - 1) / time from the
first to the last content delta; tokens counted from the stream's `usage`, so a chunk
that carries several tokens does not skew it). Per run: the aggregate throughput
(completion tokens of all requests / wall time from the first send to the last end),
medians and p90s. Every prompt starts with a unique tag, so no server can answer it
from a prompt cache filled by an earlier request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import BaseModel

TOPICS = [
    "the history of the printing press",
    "how a steam engine works",
    "the life cycle of stars",
    "the water cycle on Earth",
    "how bridges are designed and built",
    "the invention of the telephone",
    "how vaccines train the immune system",
    "the rise and fall of the Roman Empire",
]
LONG_SENTENCE = (
    "In year {i} the village by the river built {n} new houses, planted {m} apple trees, "
    "repaired the old stone bridge and held a market where farmers sold grain, wool and "
    "honey to travellers from the northern towns."
)


# ---- statistics -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must be within 0..100")
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Stat(BaseModel):
    """Median and 90th percentile of one figure over the requests that have it."""

    median: float | None
    p90: float | None
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(median=percentile(values, 50), p90=percentile(values, 90), count=len(values))


@dataclass
class RequestResult:
    """What one streaming request saw; times in seconds from its send."""

    ok: bool = False
    error: str = ""
    start: float = 0.0  # time.perf_counter() at send
    end: float = 0.0  # seconds after start when the stream ended
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server reports as reused from its cache
    chunk_times: list[float] = field(default_factory=list)  # content deltas
    text: str = ""  # the answer

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def decode_seconds(self) -> float | None:
        """From the first to the last content delta; None when fewer than 2 tokens."""
        if self.completion_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return self.chunk_times[-1] - self.chunk_times[0]

    @property
    def itl(self) -> float | None:
        """Mean seconds between tokens after the first."""
        seconds = self.decode_seconds
        return None if not seconds else seconds / (self.completion_tokens - 1)

    @property
    def decode_tps(self) -> float | None:
        seconds = self.decode_seconds
        return None if not seconds else (self.completion_tokens - 1) / seconds


class Summary(BaseModel):
    """One workload's figures (JSON-ready)."""

    label: str
    concurrency: int
    requests: int
    errors: int
    error_samples: list[str]
    prompt_tokens_median: float | None
    completion_tokens_total: int
    completion_tokens_median: float | None
    wall_seconds: float
    throughput_tok_s: float | None  # completion tokens of all requests / wall time
    ttft_s: Stat
    itl_ms: Stat
    decode_tok_s: Stat
    server_cpu: dict[str, float] = {}  # % of one core by process role, filled by callers
    load_average: float | None = None  # the machine's 1-minute load average at the start


def summarize(label: str, concurrency: int, results: Sequence[RequestResult]) -> Summary:
    """Aggregate per-request results; failed requests count as errors only."""
    good = [r for r in results if r.ok]
    wall = 0.0
    if results:
        wall = max(r.start + r.end for r in results) - min(r.start for r in results)
    total = sum(r.completion_tokens for r in good)
    return Summary(
        label=label,
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(good),
        error_samples=sorted({r.error for r in results if not r.ok})[:3],
        prompt_tokens_median=percentile([r.prompt_tokens for r in good], 50),
        completion_tokens_total=total,
        completion_tokens_median=percentile([r.completion_tokens for r in good], 50),
        wall_seconds=round(wall, 4),
        throughput_tok_s=total / wall if good and wall > 0 else None,
        ttft_s=Stat.of([r.ttft for r in good if r.ttft is not None]),
        itl_ms=Stat.of([r.itl * 1000 for r in good if r.itl is not None]),
        decode_tok_s=Stat.of([r.decode_tps for r in good if r.decode_tps is not None]),
    )


# ---- prompts ----------------------------------------------------------------------------


def essay_prompt(index: int, tag: str) -> str:
    """A request that invites a long answer, so generation runs to max_tokens."""
    topic = TOPICS[index % len(TOPICS)]
    return (
        f"[{tag}] Write a long, detailed essay about {topic}. Explain every step, give many "
        "examples, and do not stop early."
    )


def long_prompt(target_tokens: int, tag: str, count: Callable[[str], int] | None = None) -> str:
    """A document of about `target_tokens` tokens and a request to summarize it.
    `count` measures tokens (a tokenizer); without it, 1.3 tokens per word is assumed."""
    count = count or (lambda text: round(len(text.split()) * 1.3))
    head = f"[{tag}] Read this chronicle of a village.\n\n"
    tail = "\n\nSummarize the chronicle above in detail, year by year."
    sentences: list[str] = []
    while count(head + " ".join(sentences) + tail) < target_tokens:
        i = len(sentences)
        sentences.append(LONG_SENTENCE.format(i=1700 + i, n=3 + i % 7, m=10 + i % 13))
    return head + " ".join(sentences) + tail


# ---- requests ---------------------------------------------------------------------------


@dataclass
class Endpoint:
    """Where and how to send chat completions."""

    url: str  # base URL, e.g. http://127.0.0.1:8100
    model: str = "default"  # empty: leave the field out
    api_key: str = ""
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0


async def stream_chat(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    result: RequestResult | None = None,
) -> RequestResult:
    """Send one greedy streaming chat completion (a user prompt, or whole messages) and
    time its content deltas (into `result` when given: a cancelled caller keeps them)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body: dict = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **endpoint.extra_body,
    }
    if endpoint.model:
        body["model"] = endpoint.model
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    result = result or RequestResult()
    result.start = time.perf_counter()
    url = endpoint.url.rstrip("/") + "/v1/chat/completions"
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                done = _read_event(line, result)
                if done:
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    finally:
        result.end = time.perf_counter() - result.start
    if not result.error:
        if result.completion_tokens == 0:  # no usage in the stream: count content deltas
            result.completion_tokens = len(result.chunk_times)
        result.ok = bool(result.chunk_times)
        result.error = "" if result.ok else "the stream carried no content"
    return result


def _read_event(line: str, result: RequestResult) -> bool:
    """Apply one SSE line to `result`; True at the end of the stream."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return True
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            result.chunk_times.append(time.perf_counter() - result.start)
            result.text += content
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0
    return False


async def run_load(
    endpoint: Endpoint, prompts: Sequence[str], concurrency: int, max_tokens: int
) -> list[RequestResult]:
    """Send every prompt, `concurrency` at a time (each worker sends its next as soon as
    its last one ends); results in prompt order."""
    results: list[RequestResult | None] = [None] * len(prompts)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(prompts)):
        queue.put_nowait(index)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(endpoint.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                results[index] = await stream_chat(client, endpoint, prompts[index], max_tokens)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


async def run_conversation(
    endpoint: Endpoint, system: str, questions: Sequence[str], max_tokens: int
) -> list[RequestResult]:
    """An agent's conversation: each turn resends the whole history (system prompt, every
    question and answer so far) plus the next question; one result per turn."""
    messages = [{"role": "system", "content": system}]
    results = []
    timeout = httpx.Timeout(endpoint.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        for question in questions:
            messages.append({"role": "user", "content": question})
            result = await stream_chat(client, endpoint, list(messages), max_tokens)
            results.append(result)
            messages.append({"role": "assistant", "content": result.text})
    return results


def agent_system_prompt(target_tokens: int, tag: str, count: Callable[[str], int]) -> str:
    """A coding agent's long system prompt (tools, rules, a project map) of about
    `target_tokens` tokens, unique per `tag`."""
    rule = (
        "Rule {i}: before you change file module_{i}.py, read it, run its tests, keep the "
        "public names stable, explain the change in one line and never touch generated code."
    )
    head = f"[{tag}] You are a coding agent working in a large repository.\n"
    rules: list[str] = []
    while count(head + "\n".join(rules)) < target_tokens:
        rules.append(rule.format(i=len(rules)))
    return head + "\n".join(rules)


AGENT_QUESTIONS = [
    "List the three rules you consider most important.",
    "Which module would you read first, and why?",
    "Summarize your plan in two sentences.",
    "What will you check before you finish?",
]


# ---- output -----------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summaries: Sequence[Summary]) -> str:
    """A plain-text table of summaries (one row each)."""
    header = (
        f"{'workload':<22}{'C':>3}{'ok':>5}{'tok':>6}{'agg tok/s':>11}{'ttft s':>9}"
        f"{'p90':>8}{'itl ms':>9}{'p90':>8}{'dec tok/s':>11}{'p90':>8}"
    )
    rows = [header, "-" * len(header)]
    for s in summaries:
        ok = f"{s.requests - s.errors}/{s.requests}"
        rows.append(
            f"{s.label:<22}{s.concurrency:>3}{ok:>5}{s.completion_tokens_total:>6}"
            f"{_fmt(s.throughput_tok_s, 1):>11}{_fmt(s.ttft_s.median, 3):>9}"
            f"{_fmt(s.ttft_s.p90, 3):>8}{_fmt(s.itl_ms.median, 1):>9}{_fmt(s.itl_ms.p90, 1):>8}"
            f"{_fmt(s.decode_tok_s.median, 1):>11}{_fmt(s.decode_tok_s.p90, 1):>8}"
        )
    for s in summaries:
        for sample in s.error_samples:
            rows.append(f"error in {s.label}: {sample}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8100", help="base URL")
    parser.add_argument("--model", default="default", help="model field ('' leaves it out)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--concurrency", "-c", type=int, default=1)
    parser.add_argument("--requests", "-n", type=int, default=None, help="default: C")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="send a long document of about N tokens"
    )
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first, unmeasured")
    parser.add_argument("--extra", default="{}", help='JSON merged into each body: {"top_k": 1}')
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    endpoint = Endpoint(args.url, args.model, args.api_key, json.loads(args.extra))
    count = args.requests or args.concurrency
    stamp = f"{time.time_ns():x}"

    def prompt(i: int) -> str:
        tag = f"{stamp}-{i}"
        return long_prompt(args.prompt_tokens, tag) if args.prompt_tokens else essay_prompt(i, tag)

    if args.warmup:
        asyncio.run(run_load(endpoint, [prompt(-1 - i) for i in range(args.warmup)], 1, 8))
    results = asyncio.run(
        run_load(endpoint, [prompt(i) for i in range(count)], args.concurrency, args.max_tokens)
    )
    summary = summarize(f"c{args.concurrency} x {args.max_tokens}", args.concurrency, results)
    print(table([summary]))
    if args.json:
        args.json.write_text(summary.model_dump_json(indent=2) + "\n")
    return 0 if summary.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
