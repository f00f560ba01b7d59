"""An agent's conversation across `./launch.sh restart`: the next turn's time to first token
before the restart (the prefix cache in memory) and after it (read back from disk).

    .venv/bin/python -m bench.prefix_restart [--ranks 2] [--system-tokens 1500] [--trials 3]

Starts our cluster with launch.sh (NUM_DEVICES, its own port, socket and PREFIX_CACHE_DIR),
sends turn 1 (a system prompt of about --system-tokens tokens and a question), then turn 2
(the history and the next question), timed; restarts; sends turn 2 again, timed, and
reads `cached_tokens`. Each trial uses its own conversation. Greedy, 32 tokens an answer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import httpx

from bench.compare import resolve_model_dir, token_counter
from bench.loadgen import Endpoint, stream_chat
from bench.prompts import AGENT_QUESTIONS, agent_system_prompt
from bench.run_setup import add_run_options, bench_environment
from bench.servers import Ours, log, wait_quiet


async def turn(endpoint: Endpoint, messages: list[dict], max_tokens: int):
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        return await stream_chat(client, endpoint, messages, max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="", help="MODEL setting ('' = default SmolLM2)")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    add_run_options(parser)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    env = bench_environment(
        args.cache_dir, MODEL=args.model, PREFIX_CACHE_DIR=str(workdir / "disk")
    )
    model_dir = resolve_model_dir(env)
    count = token_counter(model_dir)
    server = Ours(args.ranks, env, model_dir, workdir)
    wait_quiet(args.max_load, 600)
    server.start()
    rows = []
    try:
        for trial in range(args.trials):
            system = agent_system_prompt(args.system_tokens, f"restart-{trial}", count)
            history = [{"role": "system", "content": system}]
            history.append({"role": "user", "content": AGENT_QUESTIONS[0]})
            first = asyncio.run(turn(server.endpoint, history, args.max_tokens))
            history.append({"role": "assistant", "content": first.text})
            history.append({"role": "user", "content": AGENT_QUESTIONS[1]})
            before = asyncio.run(turn(server.endpoint, history, args.max_tokens))
            server.restart()
            after = asyncio.run(turn(server.endpoint, history, args.max_tokens))
            rows.append((before, after))
            log(
                f"trial {trial}: prompt {after.prompt_tokens} tokens; time to first token "
                f"{before.ttft:.3f} s before the restart ({before.cached_tokens} cached), "
                f"{after.ttft:.3f} s after ({after.cached_tokens} cached)"
            )
    finally:
        server.stop()
    before_s = statistics.median(b.ttft for b, _ in rows if b.ttft)
    after_s = statistics.median(a.ttft for _, a in rows if a.ttft)
    print(
        f"median time to first token of the next turn, {args.ranks} rank(s): {before_s:.3f} s "
        f"before the restart, {after_s:.3f} s after: {after_s / before_s:.2f}x "
        f"(cached tokens after: {[a.cached_tokens for _, a in rows]})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
