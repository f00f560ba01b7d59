"""HTTP and port checks that launch.sh runs for api.py (standard library and the project's
standard-library-only ipc/processes.py: starts fast).

api_check.py health URL                        one line: ready / not ready and why (exit 1)
api_check.py wait URL --timeout S [--pid P]    until /health is 200; exit 1 if P dies first
api_check.py chat URL [--prompt TEXT]          a chat completion: answer, usage, performance
api_check.py bindable HOST PORT                exit 1 and say why when api.py could not bind
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.processes import pid_alive  # noqa: E402  (the project root, put on the path above)


def _request(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['API_KEY']}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}


def _reason(payload: dict) -> str:
    for key in ("reason", "detail", "status", "state"):
        if isinstance(payload.get(key), str):
            return payload[key]
    error = payload.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(payload)[:200]


def health(url: str) -> int:
    try:
        code, payload = _request(f"{url}/health", timeout=3.0)
    except (OSError, ValueError) as exc:
        print(f"down: no answer from {url} ({getattr(exc, 'reason', exc)})")
        return 1
    print(f"{'ready' if code == 200 else 'not ready'} (HTTP {code}): {_reason(payload)}")
    return 0 if code == 200 else 1


def wait(url: str, timeout: float, pid: int | None) -> int:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if pid is not None and not pid_alive(pid):
            print(f"api.py (pid {pid}) exited before /health was ready", file=sys.stderr)
            return 1
        try:
            code, payload = _request(f"{url}/health", timeout=2.0)
            if code == 200:
                return 0
            last = f"HTTP {code}: {_reason(payload)}"
        except (OSError, ValueError) as exc:
            last = str(getattr(exc, "reason", exc))
        time.sleep(0.2)
    print(f"/health not ready within {timeout:.0f} s (last answer: {last})", file=sys.stderr)
    return 1


def chat(url: str, prompt: str, max_tokens: int) -> int:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    _, models = _request(f"{url}/v1/models")
    if models.get("data"):
        body["model"] = models["data"][0]["id"]
    started = time.perf_counter()
    try:
        code, payload = _request(f"{url}/v1/chat/completions", body, timeout=300.0)
    except OSError as exc:
        print(f"error: no answer from {url} ({getattr(exc, 'reason', exc)})", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    if code != 200:
        print(f"error: HTTP {code}: {_reason(payload)}", file=sys.stderr)
        return 1
    answer = payload["choices"][0]["message"]["content"]
    usage = payload.get("usage", {})
    perf = payload.get("performance", {})
    print(f"prompt:  {prompt}")
    print(f"answer:  {answer.strip()}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    print(
        f"usage:   {usage.get('prompt_tokens')} prompt"
        + (f" ({cached} cached)" if cached is not None else "")
        + f" + {usage.get('completion_tokens')} completion tokens, {elapsed:.2f} s round trip"
    )
    if perf:
        print("perf:    " + ", ".join(f"{key} {value}" for key, value in perf.items()))
    return 0


def bindable(host: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind((host, port))
        except OSError as exc:
            print(exc.strerror or exc)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="api_check.py")
    parser.add_argument("command", choices=["health", "wait", "chat", "bindable"])
    parser.add_argument("url", help="base URL, e.g. http://127.0.0.1:8100 (bindable: host)")
    parser.add_argument("port", nargs="?", type=int, help="bindable: the port")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--pid", type=int, default=None)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.command == "bindable":
        return bindable(args.url, args.port)
    url = args.url.rstrip("/")
    if args.command == "health":
        return health(url)
    if args.command == "wait":
        return wait(url, args.timeout, args.pid)
    return chat(url, args.prompt, args.max_tokens)


if __name__ == "__main__":
    raise SystemExit(main())
