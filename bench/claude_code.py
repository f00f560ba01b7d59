"""Claude Code's first request as a workload: time to first token of its first turn and of a
later turn, ours against mlx_lm.server, at 1 and 2 ranks.

The request is Claude Code's own: the pinned client (scripts/setup_agents.sh) is run once
against a recording stub and its first Messages request (a system prompt of several
blocks, 12 tools, the user's question; about 13K tokens) is taken as it came. mlx_lm.server
speaks only OpenAI's chat API and drops tools its model's template cannot show, so both
servers get the same text: one system message (the system blocks, then the tools' JSON)
and the question; turn 2 resends it with the first answer and a follow-up, as an agent
does. The default model's 8,192 positions cannot hold the prompt, so both serve a copy of
it with 32,768 (the weights are the same; only the positions a rank admits change).

    .venv/bin/python -m bench.claude_code --ranks 1 2 --servers ours peer peer-rows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.compare import resolve_model_dir, token_counter
from bench.even_model import make_even_variant
from bench.loadgen import run_conversation
from bench.report import rows_table
from bench.run_setup import add_run_options, bench_environment
from bench.servers import BenchRefused, log, running, server_of
from bench.stats import RequestResult
from launcher.command import ROOT

CLAUDE = ROOT / "tests" / "agents" / "node_modules" / ".bin" / "claude"
FOLLOW_UP = "Now list the files you would read first, and why."


def capture_first_request(timeout: float = 60.0) -> dict[str, Any]:
    """Run the real Claude Code against a stub that records its requests; the first
    Messages request that offers tools."""
    if not CLAUDE.exists():
        raise BenchRefused("Claude Code is not installed: run scripts/setup_agents.sh")
    seen: list[dict[str, Any]] = []

    class Stub(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            seen.append(json.loads(body))
            self.send_response(529)  # overloaded: the client waits and retries
            self.end_headers()

    stub = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    home = Path(tempfile.mkdtemp(prefix="claude-home-"))
    env = os.environ | {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{stub.server_address[1]}",
        "ANTHROPIC_API_KEY": "unused",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    question = "Find where the server decides the answer's token budget and explain it."
    client = subprocess.Popen(
        [str(CLAUDE), "-p", question],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            found = [body for body in seen if len(body.get("tools") or []) >= 5]
            if found:
                return found[0]
            time.sleep(0.2)
    finally:
        client.kill()
        client.wait()
        stub.shutdown()
    raise BenchRefused("Claude Code sent no request with tools within a minute")


def as_chat(request: dict[str, Any]) -> tuple[str, str]:
    """(system text, question): the system blocks and the tools' JSON, and the last user
    message's text blocks."""
    system = request.get("system") or ""
    blocks = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
    tools = "\n".join(json.dumps(tool, separators=(",", ":")) for tool in request["tools"])
    content = request["messages"][-1]["content"]
    parts = [content] if isinstance(content, str) else [c.get("text", "") for c in content]
    question = "\n".join(p for p in parts if p)
    return "\n\n".join([*blocks, "# Tools\n" + tools]), question


def long_variant(model_dir: Path, target: Path, positions: int) -> Path:
    """`model_dir` with `positions` positions: the same weights (linked), its config's
    max_position_embeddings raised."""
    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        link = target / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--servers", nargs="+", choices=["ours", "peer", "peer-rows"], default=["ours", "peer"]
    )
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--positions", type=int, default=32768)
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an MLX directory whose context holds the prompt (both servers, every rank "
        "count); default: the default model given --positions",
    )
    add_run_options(parser)
    parser.add_argument("--json", type=Path, default=ROOT / "run" / "bench" / "claude_code.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = bench_environment(args.cache_dir, IMPORT_DTYPE="float32")
    base = args.model or resolve_model_dir(env)
    system, question = as_chat(capture_first_request())
    count = token_counter(base)
    log(f"Claude Code's first request: {count(system) + count(question)} tokens as chat text")
    workdir = Path(tempfile.mkdtemp(prefix="bench-claude-"))
    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        # 2 ranks: the even-head variant, which mlx_lm.server can split (bench.compare)
        if args.model:
            model = args.model
        else:
            even = make_even_variant(base, args.cache_dir / "even-smollm")
            source = base if ranks == 1 else even
            model = long_variant(source, args.cache_dir / f"long-{source.name}", args.positions)
        for kind in args.servers:
            with running(server_of(kind, ranks, env, model, workdir), args.max_load) as server:
                for n in range(args.conversations):
                    tagged = f"[conversation {time.time_ns():x}-{n}]\n{system}"
                    turns = asyncio.run(
                        run_conversation(
                            server.endpoint, tagged, [question, FOLLOW_UP], args.max_tokens
                        )
                    )
                    rows.append(_row(server.name, ranks, turns))
                    log(json.dumps(rows[-1]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}))
    print(report(rows))
    return 0


def _row(name: str, ranks: int, turns: list[RequestResult]) -> dict[str, Any]:
    first, later = turns
    return {
        "server": name,
        "ranks": ranks,
        "ok": first.ok and later.ok,
        "error": first.error or later.error,
        "ttft_first": first.ttft,
        "ttft_later": later.ttft,
        "prompt_first": first.prompt_tokens,
        "prompt_later": later.prompt_tokens,
    }


def report(rows: list[dict[str, Any]]) -> str:
    return rows_table(
        "ranks | server | turn 1: prompt tokens, TTFT (s) | turn 2: prompt tokens, TTFT (s)",
        rows,
        lambda row: (
            f"{row['prompt_first']}, {row['ttft_first']:.2f} | "
            f"{row['prompt_later']}, {row['ttft_later']:.2f}"
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
