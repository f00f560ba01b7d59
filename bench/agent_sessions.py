"""New sessions of the real coding agents (bench/agents.py): the time to first token of each
session's first request, cold, in a second session, and after `./launch.sh restart`, and
of a later turn, with the prompt tokens the server took from its prefix cache.

    .venv/bin/python -m bench.agent_sessions [--ranks 1 2] [--agents claude codex opencode]
        [--model DIR]

The server is ours through launch.sh, serving the tests' long-context model (SmolLM2's
tokenizer and chat template, 1 layer, 64K positions: tests/support/long_context_model.py;
the agents' prompts run 6-13K tokens, which the 135M model prefills in minutes on a CPU)
or --model, its prefix cache on disk in a fresh directory. Each session is a new
process, each in a project directory of its own (PROJECTS) with one home directory; the
recording proxy (bench/agent_proxy.py) forces the first request's tool call (the agent
reads a file, so a later turn follows with the result) and caps answers at --max-tokens:
what is measured is the prompt's reuse, not the answer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.agent_proxy import AgentProxy, Exchange, ForcedCall
from bench.agents import AGENTS, Session, run
from bench.run_setup import add_run_options, run_each
from bench.servers import Ours, log, wait_quiet

ASKS = ["What does notes.txt say?", "Summarize notes.txt in one word.", "Is notes.txt empty?"]
# each session's project, as a user starting an agent in another checkout: the agents name
# it in their prompts (leader/volatile_system.py)
PROJECTS = ["alpha-service", "tools/beta-app", "gamma"]


def forced(agent: str) -> ForcedCall:
    """The tool call each agent's first request makes: read notes.txt. Its arguments are
    fixed in the request's tool schema, so they name no project: with the absolute path
    there, a session in another project shared the tools only up to that tool's schema (a
    later turn follows whether or not the agent's tool takes a relative path)."""
    target = "notes.txt"
    return {
        "claude": ForcedCall("Read", {"file_path": target}),
        "codex": ForcedCall("exec_command", {"cmd": "cat notes.txt"}),
        "opencode": ForcedCall("read", {"filePath": target}),
    }[agent]


def numbered(agent: str, work: Path, number: int) -> Session:
    """`agent`'s session `number` under `work`: its question, and its project (made, with
    the notes.txt it asks about); one home directory for all of an agent's sessions."""
    project = work / PROJECTS[number] / agent
    project.mkdir(parents=True, exist_ok=True)
    (project / "notes.txt").write_text("remember the ring\n")
    return Session(agent, project, work / f"{agent}-home", ASKS[number])


def session(agent: str, base_url: str, work: Path, number: int, cap: int) -> list[dict[str, Any]]:
    """Session `number` (its question and project); per request with tools: its time to
    first output and cached tokens."""
    proxy = AgentProxy(base_url, forced(agent), cap=cap)
    try:
        done = run(numbered(agent, work, number), proxy.base_url)
    finally:
        proxy.close()
    if done.returncode != 0:
        log(f"{agent} exited {done.returncode}: {done.stderr[-300:]}")
    return [_figures(e) for e in proxy.exchanges if e.body.get("tools")]


def _figures(exchange: Exchange) -> dict[str, Any]:
    return {"ttft_s": exchange.first_text_s(), "cached_tokens": exchange.cached_tokens()}


def run_ranks(ranks: int, args: argparse.Namespace, env: dict[str, str], model: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench-agent-sessions-"))
    env = env | {"PREFIX_CACHE_DIR": str(workdir / "prefix-cache"), "KEEP_WARM_SECONDS": "0"}
    server = Ours(ranks, env, model, workdir)
    wait_quiet(args.max_load, args.load_patience)
    rows: dict[str, dict[str, Any]] = {}
    server.start()
    try:
        for agent in args.agents:
            first = session(agent, server.endpoint.url, workdir, 0, args.max_tokens)
            second = session(agent, server.endpoint.url, workdir, 1, args.max_tokens)
            rows[agent] = {"first": first, "second": second}
            log(f"{ranks} rank(s), {agent}: {json.dumps(rows[agent])}")
        server.restart()
        for agent in args.agents:
            rows[agent]["restart"] = session(
                agent, server.endpoint.url, workdir, 2, args.max_tokens
            )
            log(f"{ranks} rank(s), {agent} after restart: {json.dumps(rows[agent]['restart'])}")
    finally:
        server.stop()
    return rows


def _cell(requests: list[dict[str, Any]], index: int) -> str:
    if len(requests) <= index or requests[index]["ttft_s"] is None:
        return "-"
    request = requests[index]
    return f"{request['ttft_s']:.2f} s ({request['cached_tokens']} cached)"


def markdown(results: dict[int, dict], started: str, args: argparse.Namespace) -> str:
    lines = [
        f"Agent sessions ({started}, `python -m bench.agent_sessions --ranks "
        f"{' '.join(map(str, args.ranks))}`): time to first token (cached prompt tokens)",
        "",
        "| ranks | agent | first session, first request | its later turn | second session "
        "| after restart |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ranks, by_agent in results.items():
        for agent, row in by_agent.items():
            lines.append(
                f"| {ranks} | {agent} | {_cell(row['first'], 0)} | {_cell(row['first'], 1)} | "
                f"{_cell(row['second'], 0)} | {_cell(row.get('restart', []), 0)} |"
            )
    return "\n".join(lines) + "\n"


def _tiny_long(directory: Path) -> Path:
    from tests.support.long_context_model import write_long_context_model

    if not (directory / "model.safetensors").exists():
        write_long_context_model(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--agents", nargs="+", choices=AGENTS, default=list(AGENTS))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, help="an MLX model directory (default: tiny)")
    add_run_options(parser, "agent_sessions")
    args = parser.parse_args(argv)
    return run_each(
        args,
        lambda env: args.model or _tiny_long(args.cache_dir / "tiny-long-context"),
        run_ranks,
        lambda results, started: markdown(results, started, args),
    )


if __name__ == "__main__":
    raise SystemExit(main())
