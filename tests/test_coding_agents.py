"""The three most used coding agents, run as they ship (pinned npm packages that
scripts/setup_agents.sh installs), against the real api.py and 2 real ranks serving a tiny
long-context model (SmolLM2's tokenizer, random weights, 64K positions: their 10-15K-token
prompts fit): Claude Code (`claude -p`, Anthropic Messages with max_tokens 128000),
Codex CLI (`codex exec`, the Responses API) and opencode (`opencode run`, chat completions
with max_tokens 32000). Each completes a turn with a tool call in it: the call reaches the
agent in its own API, the agent runs it (reads a file), the result comes back in the next
request and the turn ends, exit status 0.

The random model would never pick a tool: bench/agent_proxy.py forces the first
call by tool_choice (a grammar-forced call; the issue allows it: what is tested is the
protocol). Every other byte is the agent's own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.agent_proxy import AgentProxy, ForcedCall
from bench.agents import BIN, AgentMissing, Session, binary
from bench.agents import run as run_session
from launcher.local_cluster import Cluster
from tests.support.api_server import api_over
from tests.support.long_context_model import REPLY, write_long_context_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MARKER = "the-ring-file-says-4711"


def installed(name: str) -> None:
    try:
        binary(name)
    except AgentMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    work = tmp_path_factory.mktemp("agents-cluster")
    model = write_long_context_model(work / "tiny-long")
    with Cluster(model, ranks=2, workdir=work / "cluster") as cluster:
        status = cluster.status()
        assert status.max_sequence_length == 65536  # the model's own context
        with api_over(cluster, work / "api.log") as process:
            yield process


@pytest.fixture
def project(tmp_path):
    """A directory the agent works in, with the file it is asked to read."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "hello.txt").write_text(f"{MARKER}\n")
    return root


def run_agent(
    agent: str, ask: str, cwd: Path, home: Path, base_url: str, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    installed(agent)
    done = run_session(Session(agent, cwd, home, ask), base_url, extra)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return done


def check_round_trip(proxy: AgentProxy, path: str, tool: str) -> None:
    assert proxy.force is not None and proxy.force.done, f"no request offered {tool}"
    back = proxy.sent(MARKER)  # the tool's result, sent back by the agent
    assert back and all(p.startswith(path) for p in back), [p for p, _ in proxy.requests]
    first = next(i for i, (_, body) in enumerate(proxy.requests) if MARKER in json.dumps(body))
    assert first > 0  # a later request than the one that made the call


def test_claude_code_reads_a_file(api, project, tmp_path):
    proxy = AgentProxy(api.base_url, ForcedCall("Read", {"file_path": str(project / "hello.txt")}))
    try:
        ask = "What does hello.txt say?"
        extra = ("--allowedTools", "Read")
        done = run_agent("claude", ask, project, tmp_path, proxy.base_url, extra)
    finally:
        proxy.close()
    check_round_trip(proxy, "/v1/messages", "Read")
    main = [body for path, body in proxy.requests if len(body.get("tools") or []) > 5]
    assert main[0]["max_tokens"] >= 32000  # a cap far past what is left: answered, not refused
    assert REPLY in done.stdout


def test_codex_runs_a_shell_command(api, project, tmp_path):
    proxy = AgentProxy(api.base_url, ForcedCall("exec_command", {"cmd": "cat hello.txt"}))
    try:
        ask = "What does hello.txt say?"
        done = run_agent("codex", ask, project, tmp_path / "codex-home", proxy.base_url)
    finally:
        proxy.close()
    check_round_trip(proxy, "/v1/responses", "exec_command")
    assert REPLY in done.stdout


def test_opencode_reads_a_file(api, project, tmp_path_factory):
    home = tmp_path_factory.mktemp("opencode-home")  # its provider package is cached here
    proxy = AgentProxy(api.base_url, ForcedCall("read", {"filePath": str(project / "hello.txt")}))
    try:
        done = run_agent("opencode", "What does hello.txt say?", project, home, proxy.base_url)
    finally:
        proxy.close()
    check_round_trip(proxy, "/v1/chat/completions", "read")
    assert any(body.get("max_tokens", 0) >= 32000 for _, body in proxy.requests)
    assert REPLY in done.stdout


def test_the_clients_are_the_pinned_ones():
    """What runs is what tests/agents/package.json pins (not a global install)."""
    pins = json.loads((BIN.parent.parent / "package.json").read_text())["dependencies"]
    for package, version in pins.items():
        installed = BIN.parent / package / "package.json"
        if not installed.exists():
            pytest.skip("the coding agents are not installed: run scripts/setup_agents.sh")
        assert json.loads(installed.read_text())["version"] == version
    assert shutil.which("node"), "node runs the agents"
