"""What a client sees when a fault hits a cluster under launch.sh's supervisor, and how long
the cluster takes to serve again: the chaos tests' probes and their report rows.

- `stream_with_fault`: a greedy streaming chat that applies the fault after its Nth
  content chunk and reads on until the stream ends: with an SSE error event, a dropped
  connection, or its normal end.
- `stream_with_link_change`: a stream with a context (a delayed link) entered after its
  10th chunk; the median gap between chunks before and under it.
- `HealthWatch`: /health polled in the background; whether it stayed ready.
- `wait_ready_again`: /health polled every 0.1 s until it answers 200.
- `log_shows`: a log polled until it holds a line.
- `ask`: one short chat completion (a new request sent during the restart).
- `cluster_processes`: the project's processes by role, to prove none is left over.
- `report`: one row per fault, printed and, with CHAOS_REPORT=path, appended as JSON
  (docs/RELIABILITY.md is made from these rows).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from tests.support.process_list import project_processes

PROMPT = "Say anything."


@dataclass
class StreamEnd:
    """How a stream ended, seconds after the fault."""

    chunks: int  # content chunks before the end
    how: str  # "error event: <code>: <message>", "connection dropped: ...", "completed"
    after_fault_s: float
    error_code: str | None = None


def _stream_body(prompt: str, max_tokens: int) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_with_fault(
    url: str,
    fault: Callable[[], None],
    after_chunks: int = 5,
    max_tokens: int = 600,
    prompt: str = PROMPT,
) -> StreamEnd:
    body = _stream_body(prompt, max_tokens)
    chunks, faulted_at = 0, None
    how, code = "completed", None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    code = event["error"].get("code")
                    how = f"error event: {code}: {event['error'].get('message')}"
                    break
                if _has_text(event):
                    chunks += 1
                if chunks == after_chunks and faulted_at is None:
                    fault()
                    faulted_at = time.monotonic()
    except httpx.HTTPError as exc:
        how = f"connection dropped: {type(exc).__name__}"
    assert faulted_at is not None, f"the stream ended after {chunks} chunks, before the fault"
    return StreamEnd(chunks, how, time.monotonic() - faulted_at, code)


def _has_text(event: dict) -> bool:
    return bool(event.get("choices") and event["choices"][0]["delta"].get("content"))


def stream_with_link_change(
    url: str, change: AbstractContextManager[object], prompt: str, max_tokens: int
) -> tuple[float, float]:
    """Median seconds between chunks before and while `change` is in force (entered after
    the 10th chunk, left at the end); the stream must end normally with usage."""
    times: list[float] = []
    usage = None
    with contextlib.ExitStack() as stack:
        body = _stream_body(prompt, max_tokens)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
                if _has_text(event):
                    times.append(time.monotonic())
                    if len(times) == 10:
                        stack.enter_context(change)
    assert usage and usage["completion_tokens"] == max_tokens, usage
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps[:9]), statistics.median(gaps[11:])


class HealthWatch:
    """`with HealthWatch(url) as watch:` /health every 0.2 s; `watch.always_ready` after."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.always_ready = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            if health(self.url)[0] != 200:
                self.always_ready = False

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def health(url: str) -> tuple[int | None, dict]:
    """(status, body) of /health; (None, {}) when api.py does not answer."""
    try:
        answer = httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:
        return None, {}
    return answer.status_code, answer.json()


def wait_ready_again(url: str, since: float, timeout: float = 180) -> float:
    """Seconds from `since` (monotonic) until /health answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health(url)[0] == 200:
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"/health not ready {timeout:.0f} s after the fault: {health(url)}")


def log_shows(path: Path, text: str, timeout: float = 20) -> None:
    """Wait until the log at `path` holds `text`: a line written by a rank reaches the file
    later than the client sees its effect."""
    deadline = time.monotonic() + timeout
    while text not in (written := path.read_text()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{path.name} lacks {text!r} after {timeout:.0f} s:\n{written[-3000:]}"
            )
        time.sleep(0.2)


def ask(
    url: str, timeout: float = 180, served: list[float] | None = None
) -> tuple[int, float, str]:
    """(HTTP status, seconds, answer or error) of one short chat completion; `served`
    gets the time rank 0 took for it (its `performance.total_time`), when it answered."""
    started = time.monotonic()
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}]}
    try:
        reply = httpx.post(
            f"{url}/v1/chat/completions", json=body | {"max_tokens": 8}, timeout=timeout
        )
    except httpx.HTTPError as exc:
        return 0, time.monotonic() - started, type(exc).__name__
    seconds = time.monotonic() - started
    payload = reply.json()
    text = payload["choices"][0]["message"]["content"] if reply.status_code == 200 else payload
    if served is not None and reply.status_code == 200:
        served.append(payload["performance"]["total_time"])
    return reply.status_code, seconds, str(text)


def _role(command: str) -> str:
    for marker, role in (
        (" -tt ", "ssh"),  # mlx.launch's session to a remote rank (its command names server.py)
        ("launcher.supervisor", "supervisor"),
        ("mlx.launch", "mlx.launch"),
        ("server.py", "rank"),
        ("api.py", "api"),
    ):
        if marker in command:
            return role
    return "other: " + command[:120]


def cluster_processes(root: Path) -> Counter[str]:
    """Roles of the running processes that belong to the project copy at `root`."""
    return Counter(_role(command) for _, command in project_processes(root))


def settled_processes(root: Path, expected: Counter[str], timeout: float = 20) -> Counter[str]:
    """The project's processes once they match `expected` (short-lived helpers such as
    ranks.sh come and go), or what is there at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        found = cluster_processes(root)
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@dataclass
class Row:
    """One fault, as docs/RELIABILITY.md shows it."""

    fault: str
    client_saw: str
    detected_s: float  # fault -> the client's error (or /health not ready)
    ready_again_s: float  # fault -> /health 200
    lost: str
    leftovers: str


def restart_row(
    fault: str, end: StreamEnd, ready_again_s: float, lost: str, leftovers: str = "none"
) -> Row:
    """The row of a fault that ended the ranks' job: the stream's end, then the restart."""
    return Row(
        fault=fault,
        client_saw=f"SSE error event ({end.error_code}) after {end.chunks} chunks",
        detected_s=end.after_fault_s,
        ready_again_s=ready_again_s,
        lost=lost,
        leftovers=leftovers,
    )


def waited_and_succeeded(seconds: float) -> str:
    return (
        f"the stream in flight; a request sent during the restart waited {seconds:.1f} s "
        "and succeeded"
    )


def report(row: Row) -> None:
    print(
        f"\n{row.fault}: client saw {row.client_saw} after {row.detected_s:.2f} s; "
        f"/health ready again after {row.ready_again_s:.1f} s; lost: {row.lost}; "
        f"left over: {row.leftovers}"
    )
    target = os.environ.get("CHAOS_REPORT")
    if target:
        with open(target, "a") as out:
            out.write(json.dumps(asdict(row)) + "\n")
