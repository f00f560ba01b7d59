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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.prompts import essay_prompt, long_prompt
from bench.stats import RequestResult, summarize, table


@dataclass
class Endpoint:
    """Where and how to send chat completions."""

    url: str  # base URL, e.g. http://127.0.0.1:8100
    model: str = "default"  # empty: leave the field out
    api_key: str = ""
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0


def function_tool(name: str, description: str, arguments: dict[str, str]) -> dict[str, Any]:
    """An OpenAI function tool whose arguments are required strings, each with its
    description (none where it is empty)."""
    properties = {
        key: {"type": "string", **({"description": text} if text else {})}
        for key, text in arguments.items()
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(arguments)},
        },
    }


async def stream_chat(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    prompt: str | list[dict[str, Any]],
    max_tokens: int,
    result: RequestResult | None = None,
    tools: list[dict[str, Any]] | None = None,
    fields: dict[str, Any] | None = None,
) -> RequestResult:
    """Send one greedy streaming chat completion (a user prompt, or whole messages, with
    `tools` and more request `fields` where given) and time its content deltas (into
    `result` when given: a cancelled caller keeps them)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body: dict = {
        "messages": messages,
        **({"tools": tools} if tools else {}),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(fields or {}),
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
        delta = choice.get("delta") or {}
        calls = delta.get("tool_calls") or []  # a tool call's arguments arrive as text too
        content = (delta.get("content") or "") + "".join(
            (call.get("function") or {}).get("arguments") or "" for call in calls
        )
        if content:
            result.chunk_times.append(time.perf_counter() - result.start)
            result.text += content
    usage = event.get("usage")
    if usage:
        result.take_usage(usage)
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
