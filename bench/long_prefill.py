"""A long prompt arriving while answers stream: how much the answers slow while it prefills,
and its time to first token, ours against mlx_lm.server in the same run.

The model is the tests' long-context one (tests/support/long_context_model.py: SmolLM2's
tokenizer, 4 layers, 64K positions) with its end-of-sequence rows zeroed, so the answers
never end by themselves. STREAMS greedy answers stream; after --before seconds a prompt of
about --tokens tokens arrives. Ratio = the answers' mean inter-token latency from the long
prompt's send to its first token, over theirs in the --before seconds before it (tokens
counted by arrival time, over all streams).

    .venv/bin/python -m bench.long_prefill --ranks 2 --tokens 32000 --servers ours peer-rows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import httpx

from bench.loadgen import Endpoint, stream_chat
from bench.report import rows_table
from bench.run_setup import add_run_options, bench_environment
from bench.servers import log, running, server_of
from bench.stats import RequestResult
from launcher.command import ROOT

STREAMS = 4


def endless_model(directory: Path) -> Path:
    """The long-context test model whose special tokens never win a greedy step."""
    from tests.support.long_context_model import write_endless_model

    if not (directory / "model.safetensors").exists():
        write_endless_model(directory, layers=4)
    return directory


def _rate(results: list[RequestResult], start: float, end: float) -> float | None:
    """Tokens a second of one stream, averaged over the streams, between two times (s on
    the perf_counter clock)."""
    counts = [
        sum(start <= r.start + t <= end for t in r.chunk_times) for r in results if r.chunk_times
    ]
    if not counts or end <= start:
        return None
    return mean(counts) / (end - start)


async def long_prompt_beside_streams(
    endpoint: Endpoint, tokens: int, before: float
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=STREAMS + 2)
    async with httpx.AsyncClient(timeout=endpoint.timeout, limits=limits) as client:
        # the same length of prompt alone first (its own tag: no cache holds it)
        alone = await stream_chat(client, endpoint, f"[{time.time_ns():x}]" + " hello" * tokens, 4)
        results = [RequestResult() for _ in range(STREAMS)]
        streams = [
            asyncio.create_task(
                stream_chat(client, endpoint, f"Story number {i}: once upon a time", 20000, r)
            )
            for i, r in enumerate(results)
        ]
        await asyncio.sleep(before + 2.0)  # their first tokens, then the window before
        sent = time.perf_counter()
        tag = f"[{time.time_ns():x}]"  # no prefix cache (memory or disk) holds it
        long = await stream_chat(client, endpoint, tag + " hello" * tokens, 4)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return _figures(results, long, sent, before, alone)


def _figures(
    results: list[RequestResult],
    long: RequestResult,
    sent: float,
    before: float,
    alone: RequestResult,
) -> dict[str, Any]:
    first = sent + (long.ttft or 0.0)
    rate_before = _rate(results, sent - before, sent)
    rate_during = _rate(results, sent, first)
    return {
        "ok": long.ok and alone.ok,
        "error": long.error or alone.error,
        "prompt_tokens": long.prompt_tokens,
        "ttft_s": long.ttft,
        "ttft_alone_s": alone.ttft,
        "itl_before_ms": 1000 / rate_before if rate_before else None,
        "itl_during_ms": 1000 / rate_during if rate_during else None,
        "ratio": rate_before / rate_during if rate_before and rate_during else None,
    }


def _plan(endpoint: Endpoint) -> str:
    """Our cluster's split, from its status."""
    status = httpx.get(f"{endpoint.url}/cluster/status", timeout=30).json()
    return str(status.get("plan", {}).get("strategy", "single"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument(
        "--servers", nargs="+", choices=["ours", "peer", "peer-rows"], default=["ours", "peer"]
    )
    parser.add_argument("--tokens", type=int, default=32000, help="the long prompt's words")
    parser.add_argument("--before", type=float, default=3.0)
    parser.add_argument("--trials", type=int, default=1)
    add_run_options(parser)
    parser.add_argument("--json", type=Path, default=ROOT / "run" / "bench" / "long_prefill.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The split pinned (unless PARALLELISM is set), so runs compare: this 4-layer model's
    # two splits are predicted within this VM's noise (the link read 70-250 us a collective
    # from one start to the next), so auto chose a pipeline in some starts, whose prompt
    # alone took 17-20 s against the head split's 7-8 s (docs/BENCHMARKS.md). A 32K
    # prefill beside answers, on a CPU, outlasts the default request timeout.
    env = bench_environment(
        args.cache_dir,
        PARALLELISM=os.environ.get("PARALLELISM", "tensor"),
        MAX_SEQUENCE_LENGTH="65536",
        KEEP_WARM_SECONDS="0",
        REQUEST_TIMEOUT_SECONDS="3600",
    )
    model = endless_model(args.cache_dir / "endless-long-context")
    workdir = Path(tempfile.mkdtemp(prefix="bench-long-prefill-"))
    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        for kind in args.servers:
            with running(server_of(kind, ranks, env, model, workdir), args.max_load) as server:
                name = server.name
                if kind == "ours":  # the split it runs
                    name += f" ({_plan(server.endpoint)})"
                for _ in range(args.trials):
                    figures = asyncio.run(
                        long_prompt_beside_streams(server.endpoint, args.tokens, args.before)
                    )
                    rows.append({"server": name, "ranks": ranks, **figures})
                    log(json.dumps(rows[-1]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}))
    print(report(rows))
    return 0


def report(rows: list[dict[str, Any]]) -> str:
    return rows_table(
        "ranks | server (our plan) | prompt tokens "
        "| time to first token: alone, beside answers (s) "
        "| answers' ITL before / during (ms) | answers keep",
        rows,
        _cells,
    )


def _cells(row: dict[str, Any]) -> str:
    before, during, ratio = row["itl_before_ms"], row["itl_during_ms"], row["ratio"]
    alone, beside = row["ttft_alone_s"], row["ttft_s"]
    return (
        f"{row['prompt_tokens']} | {alone:.1f}, {beside:.1f} ({beside / alone:.2f}x) "
        f"| {before or 0:.1f} / {during or 0:.1f} | {1 / ratio if ratio else 0:.2f}x"
    )


if __name__ == "__main__":
    raise SystemExit(main())
