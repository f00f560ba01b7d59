"""A recording pass-through between a real coding agent and api.py, for the agent tests and
the session benchmark.

It forwards every request unchanged (streams included) and keeps each request's path and
body, so a test can see what the agent sent (its tools, the tool result it sent back), and
the server's answer with the time each piece of it arrived (`exchanges`): what the server
reported (cached prompt tokens) and when its first token came.
On request it forces one tool call: the first request that offers the tool `force.name`
gets a tool_choice naming it and that tool's parameters narrowed to `force.arguments` (JSON
schema `const`s). The random test model would never choose a tool itself; the grammar then
makes rank 0 answer the call, in the agent's own API, and the agent runs it. What is tested
is the protocol: the call reaching the agent, the agent running it, its result coming back.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit


@dataclass
class ForcedCall:
    name: str
    arguments: dict[str, str]
    done: bool = False

    def schema(self) -> dict[str, Any]:
        properties = {key: {"const": value} for key, value in self.arguments.items()}
        required = list(self.arguments)
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,  # else the grammar lets the model add keys forever
        }

    def apply(self, path: str, body: dict[str, Any]) -> bool:
        """Force the call in `body` (once) if it offers the tool; whether it did."""
        tools = body.get("tools") or []
        if self.done:
            return False
        for tool in tools:
            if path.startswith("/v1/messages") and tool.get("name") == self.name:
                tool["input_schema"] = self.schema()
                body["tool_choice"] = {"type": "tool", "name": self.name}
            elif path.startswith("/v1/responses") and tool.get("name") == self.name:
                tool["parameters"] = self.schema()
                body["tool_choice"] = {"type": "function", "name": self.name}
            elif (tool.get("function") or {}).get("name") == self.name:
                tool["function"]["parameters"] = self.schema()
                body["tool_choice"] = {"type": "function", "function": {"name": self.name}}
            else:
                continue
            self.done = True
            return True
        return False


@dataclass
class Exchange:
    """One request and the server's answer: its pieces, each with the seconds since the
    request arrived here."""

    path: str
    body: dict[str, Any]
    pieces: list[tuple[float, bytes]] = field(default_factory=list)

    def events(self) -> Iterator[dict[str, Any]]:
        """The answer's JSON objects: each `data:` line of a stream, or the whole body."""
        raw = b"".join(piece for _, piece in self.pieces).decode(errors="replace")
        lines = [line[5:].strip() for line in raw.splitlines() if line.startswith("data:")]
        for text in lines or [raw]:
            try:
                found = json.loads(text)
            except ValueError:
                continue
            if isinstance(found, dict):
                yield found

    def cached_tokens(self) -> int:
        """The prompt tokens the server said it took from its prefix cache, in whichever
        API's words (Anthropic's cache_read_input_tokens, OpenAI's cached_tokens)."""
        return max((_largest(event, CACHED_KEYS) for event in self.events()), default=0)

    def first_text_s(self) -> float | None:
        """Seconds from the request to the first piece carrying generated text or a call's
        arguments (the time to first token as the agent saw it)."""
        for at, piece in self.pieces:
            if FIRST_OUTPUT.search(piece):
                return at
        return None


CACHED_KEYS = ("cache_read_input_tokens", "cached_tokens")
# A non-empty string under the key each API streams its output in: Anthropic's text and
# partial_json, the Responses API's delta, chat completions' content and arguments.
FIRST_OUTPUT = re.compile(rb'"(?:text|partial_json|delta|content|arguments)"\s*:\s*"(?!")')


def _largest(tree: Any, keys: tuple[str, ...]) -> int:
    if isinstance(tree, dict):
        found = [v for k, v in tree.items() if k in keys and isinstance(v, int)]
        return max([*found, *(_largest(v, keys) for v in tree.values())], default=0)
    if isinstance(tree, list):
        return max((_largest(v, keys) for v in tree), default=0)
    return 0


@dataclass
class AgentProxy:
    upstream: str  # api.py's base URL
    force: ForcedCall | None = None
    cap: int | None = None  # answers' tokens at most (the benchmark's: time to first token)
    exchanges: list[Exchange] = field(default_factory=list)

    @property
    def requests(self) -> list[tuple[str, dict[str, Any]]]:
        return [(exchange.path, exchange.body) for exchange in self.exchanges]

    def __post_init__(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self._forward(self.rfile.read(length))

            def _forward(self, raw: bytes | None) -> None:
                started = time.monotonic()
                exchange = None
                if raw:
                    body = json.loads(raw)
                    if proxy.force is not None:
                        proxy.force.apply(self.path, body)
                    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
                        if proxy.cap is not None and key in body:
                            body[key] = min(body[key], proxy.cap)
                    exchange = Exchange(self.path, body)
                    proxy.exchanges.append(exchange)
                    raw = json.dumps(body).encode()
                target = urlsplit(proxy.upstream)
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                skip = {"host", "content-length", "connection", "accept-encoding"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                upstream.request(self.command, self.path, body=raw, headers=headers)
                reply = upstream.getresponse()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := reply.read1(65536):
                    if exchange is not None:
                        exchange.pieces.append((time.monotonic() - started, chunk))
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                upstream.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def sent(self, text: str) -> list[str]:
        """Paths of the requests whose body holds `text` (a tool result, say)."""
        return [path for path, body in self.requests if text in json.dumps(body)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
