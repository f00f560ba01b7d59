"""The three coding agents as their users run them, pointed at a server: Claude Code
(`claude -p`, Anthropic Messages), Codex CLI (`codex exec`, the Responses API) and opencode
(`opencode run`, chat completions). The pinned npm packages of tests/agents/package.json
(scripts/setup_agents.sh installs them); each session runs in a new process, in a working
directory, with a home directory that holds the agent's configuration and state.

The tests (tests/test_coding_agents.py, tests/test_agent_sessions.py) and the session
benchmark (bench/agent_sessions.py) run them through here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.anthropic.convert import message_submit
from gateway.anthropic.protocol import MessagesRequest
from gateway.core import Limits
from gateway.openai.convert import chat_submit
from gateway.openai.protocol import ChatCompletionRequest
from gateway.responses.convert import conversation, parse_items, to_submit
from gateway.responses.protocol import ResponsesRequest
from launcher.command import ROOT
from leader.request_setup import RequestSetup

AGENTS = ("claude", "codex", "opencode")
BIN = ROOT / "tests" / "agents" / "node_modules" / ".bin"
QUIET = {  # no update checks, telemetry or error reports: the machine has no network
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "NO_COLOR": "1",
}
# The request path each agent's turns take on the server.
PATHS = {"claude": "/v1/messages", "codex": "/v1/responses", "opencode": "/v1/chat/completions"}


class AgentMissing(RuntimeError):
    """The agent is not installed here; the message says how to install it."""


@dataclass(frozen=True)
class Session:
    """One run of an agent: `ask` in `cwd`, its state under `home`."""

    agent: str
    cwd: Path
    home: Path
    ask: str


def binary(agent: str) -> Path:
    path = BIN / agent
    if not path.exists():
        raise AgentMissing(f"{agent} is not installed: run scripts/setup_agents.sh (needs npm)")
    return path


def command(
    session: Session, base_url: str, extra: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions of `session` against `base_url` (api.py's,
    or a recording proxy's); writes the agent's configuration under its home."""
    home, agent = session.home, session.agent
    home.mkdir(parents=True, exist_ok=True)
    if agent == "claude":
        argv = [str(binary(agent)), "-p", session.ask, *extra]
        env = {"HOME": str(home), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "unused"}
    elif agent == "codex":
        (home / "config.toml").write_text(
            'model = "default"\nmodel_provider = "ring"\n[model_providers.ring]\nname = "ring"\n'
            f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "RING_KEY"\n'
            "request_max_retries = 0\nstream_max_retries = 0\n"
        )
        argv = [str(binary(agent)), "exec", "--skip-git-repo-check"]
        argv += ["--dangerously-bypass-approvals-and-sandbox", session.ask, *extra]
        env = {"CODEX_HOME": str(home), "RING_KEY": "unused", "HOME": str(home)}
    elif agent == "opencode":
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "ring": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "ring",
                    "options": {"baseURL": f"{base_url}/v1", "apiKey": "unused"},
                    "models": {"default": {"name": "default"}},
                }
            },
            "model": "ring/default",
        }
        (home / "config" / "opencode").mkdir(parents=True, exist_ok=True)
        (home / "config" / "opencode" / "opencode.json").write_text(json.dumps(config))
        argv = [str(binary(agent)), "run", session.ask, *extra]
        env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / "config")}
    else:
        raise ValueError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}")
    return argv, env


def run(
    session: Session, base_url: str, extra: tuple[str, ...] = (), timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run one session to its end (stdin closed, output captured); prints its exit and time."""
    argv, env = command(session, base_url, extra)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "OPENAI"))}
    session.cwd.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    done = subprocess.run(
        argv,
        cwd=session.cwd,
        # opencode reads its directory from PWD
        env={**clean, **QUIET, "PWD": str(session.cwd), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    took = time.monotonic() - started
    print(f"{session.agent} in {session.cwd.name}: exit {done.returncode} in {took:.1f} s")
    return done


def rendered(path: str, body: dict[str, Any], setup: RequestSetup) -> list[int]:
    """The prompt tokens rank 0 renders for an agent's request to `path`: the request
    through its API's conversion and rank 0's chat prompt, as the server would."""
    limits = Limits(default_max_tokens=1)
    if path.startswith("/v1/messages"):
        submit = message_submit(MessagesRequest.model_validate(body), "rendered", limits)
    elif path.startswith("/v1/responses"):
        request = ResponsesRequest.model_validate(body)
        dialogue = conversation(parse_items(body["input"]))
        submit = to_submit(request, dialogue, "rendered", limits)
    else:
        submit = chat_submit(ChatCompletionRequest.model_validate(body), "rendered", limits)
    return setup.prepare(submit).prompt
