"""The real api.py in front of real ranks (2 ranks, ring, 127.0.0.1, tiny model), driven
with the `openai` SDK and httpx. One cluster for the module; the last test kills it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import mlx.core as mx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.local_cluster import Cluster
from tests.support.api_server import api_over, start_api, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
PROMPT = "The quick brown fox"
# Greedy on the tiny model, this prompt loops without EOS: a stream that lasts seconds.
LONG = {"model": "default", "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return tiny_llama


class HealthWatcher(threading.Thread):
    """Polls /health (and, while loading, a completion) until ready; records what it saw."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.states: list[str] = []
        self.loading_answers: list[tuple[int, str | None]] = []
        self.finished = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                state = httpx.get(f"{self.base_url}/health", timeout=5).json()["status"]
                if not self.states or self.states[-1] != state:
                    self.states.append(state)
                if state == "loading" and not self.loading_answers:
                    body = {"model": "default", "prompt": "a", "max_tokens": 1}
                    reply = httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=5)
                    self.loading_answers.append(
                        (reply.status_code, reply.headers.get("Retry-After"))
                    )
                if state == "ready":
                    break
            time.sleep(0.05)
        self.finished.set()


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    """api.py first (no ranks yet), then the cluster: api.py must connect on its own."""
    work = tmp_path_factory.mktemp("api-cluster")
    cluster = Cluster(model_dir, ranks=2, workdir=work / "cluster")
    env = {"SOCKET_PATH": str(cluster.socket_path), "REQUEST_TIMEOUT_SECONDS": "120"}
    api = start_api(env, work / "api.log")
    watcher = HealthWatcher(api.base_url)
    try:
        watcher.start()
        with cluster:
            assert watcher.finished.wait(30), f"api.py never became ready: {watcher.states}"
            yield SimpleNamespace(api=api, cluster=cluster, watcher=watcher)
    finally:
        api.stop()


@pytest.fixture(scope="module")
def cluster(stack):
    return stack.cluster


@pytest.fixture(scope="module")
def api(stack):
    return stack.api


@pytest.fixture(scope="module")
def sdk(api):
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def active_requests(base_url: str) -> int:
    return httpx.get(f"{base_url}/cluster/status", timeout=5).json()["active_requests"]


def wait_idle(base_url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while active_requests(base_url) != 0:
        assert time.monotonic() < deadline, "the request was not cancelled at rank 0"
        time.sleep(0.1)


def check_performance(performance: dict) -> None:
    assert performance["time_to_first_token"] > 0
    assert performance["prompt_tokens_per_second"] > 0
    assert performance["generation_tokens_per_second"] > 0


def test_api_started_before_the_ranks_connects_when_they_come_up(stack):
    states = stack.watcher.states
    assert states[0] == "down" and states[-1] == "ready", states
    for status, retry_after in stack.watcher.loading_answers:  # only if it caught "loading"
        assert status == 503 and retry_after == "5"


def test_chat_completion_matches_the_tokenizer(sdk, model_dir, tokenizer):
    reply = sdk.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == str(model_dir) or reply.model.endswith(model_dir.name)
    assert reply.system_fingerprint.startswith("fp_")
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert reply.usage.prompt_tokens == expected
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == expected + reply.usage.completion_tokens
    check_performance(reply.model_extra["performance"])


def test_streamed_chat_equals_the_plain_answer_and_reports_usage(sdk):
    plain = sdk.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, temperature=0
    )
    stream = sdk.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    check_performance(chunks[-1].model_extra["performance"])


def test_text_completion_plain_and_streamed(sdk, tokenizer, api):
    plain = sdk.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0)
    assert plain.object == "text_completion"
    assert plain.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    chunks = list(
        sdk.completions.create(
            model="default", prompt=PROMPT, max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    # The raw stream ends with the SSE terminator.
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    raw = httpx.post(f"{api.base_url}/v1/completions", json=body, timeout=60).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_stop_sequence_cuts_the_text(sdk):
    base = sdk.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    assert stop, f"greedy text too short to pick a stop sequence: {text!r}"
    cut = sdk.completions.create(
        model="default", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_same_seed_same_text_at_temperature_0_8(sdk):
    def sample(seed: int) -> str:
        reply = sdk.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=12, temperature=0.8, seed=seed
        )
        return reply.choices[0].message.content

    assert sample(1234) == sample(1234)


def test_logprobs_shapes(sdk):
    chat = sdk.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob >= max(top.logprob for top in item.top_logprobs) - 1e-4
    text = sdk.completions.create(
        model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = text.choices[0].logprobs
    count = text.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == count
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == count
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_model_names_and_listing(sdk, model_dir, api):
    listed = sdk.models.list().data
    assert len(listed) == 1
    served = listed[0].id
    for alias in (served, model_dir.name, "default"):
        reply = sdk.completions.create(model=alias, prompt="a", max_tokens=1)
        assert reply.model == served
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.completions.create(model="gpt-4o", prompt="a", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"


def test_errors_from_the_ranks_and_limits(sdk, api):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="default", prompt="x" * 5000, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "5000 tokens" in caught.value.body["message"]  # both numbers: prompt, context
    assert "MAX_SEQUENCE_LENGTH=" in caught.value.body["message"]
    # a cap past the context is a cap (docs/ARCHITECTURE.md): the answer ends with the context
    capped = sdk.completions.create(model="default", prompt="x" * 4090, max_tokens=100_000)
    assert capped.choices[0].finish_reason == "length"
    assert (capped.usage.prompt_tokens, capped.usage.total_tokens) == (4090, 4096)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="default", messages=MESSAGES, n=2)
    assert caught.value.body["param"] == "n"


def test_info_status_and_metrics(api, cluster, model_dir):
    info = httpx.get(f"{api.base_url}/model/info").json()
    assert info["ranks"] == 2 and info["architecture"] == "llama"
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert info["parameters"] == sum(array.size for array in weights.values())
    assert info["context_length"] > 0
    status = httpx.get(f"{api.base_url}/cluster/status").json()
    assert status["state"] == "ready" and status["backend"] == "ring"
    assert [rank["rank"] for rank in status["ranks"]] == [0, 1]
    assert status["missing_ranks"] == [] and len(status["hosts"]) == 1
    metrics = httpx.get(f"{api.base_url}/metrics").text
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert counts["api_time_to_first_token_seconds_count"] >= 5
    assert counts['api_tokens_total{kind="completion"}'] > 0
    assert counts["ranks_up"] == 1


@st.composite
def edge_sampling(draw) -> dict:
    """Valid requests at the edges of every sampling range."""
    body = {
        "model": "default",
        "max_tokens": draw(st.integers(1, 3)),
        "temperature": draw(st.sampled_from([0, 1e-6, 0.7, 2])),
        "top_p": draw(st.sampled_from([1e-9, 0.5, 1])),
        "top_k": draw(st.sampled_from([0, 1, 100_000])),
        "min_p": draw(st.sampled_from([0, 0.5, 1])),
        "seed": draw(st.sampled_from([None, 0, -1, 2**63 - 1])),
        "presence_penalty": draw(st.sampled_from([-2, 0, 2])),
        "frequency_penalty": draw(st.sampled_from([-2, 0, 2])),
        "repetition_penalty": draw(st.sampled_from([1e-3, 1, 10])),
        "stream": draw(st.booleans()),
    }
    if draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=20))}]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=20))
        body["logprobs"] = draw(st.sampled_from([None, 0, 20]))
    return body


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=edge_sampling())
def test_edge_parameters_never_break_the_ranks(api, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{api.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, (body, response.text)
    if body["stream"]:
        assert response.text.rstrip().endswith("data: [DONE]"), (body, response.text[-300:])
        assert '"error"' not in response.text, (body, response.text[-300:])
    assert httpx.get(f"{api.base_url}/health").status_code == 200


def test_client_disconnect_cancels_the_request(api):
    with httpx.stream("POST", f"{api.base_url}/v1/completions", json=LONG, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # the API answers with its cached status where rank 0 takes over 2 s (a loaded
        # host): ask again until a fresh one counts the streaming request
        deadline = time.monotonic() + 10
        while (active := active_requests(api.base_url)) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert active == 1
    wait_idle(api.base_url)
    assert "cancelled at rank 0" in api.log()


def test_timeout_gives_504_and_cancels(cluster, tmp_path):
    timeout = {"REQUEST_TIMEOUT_SECONDS": "0.5"}
    with api_over(cluster, tmp_path / "api-timeout.log", timeout) as short:
        body = {**LONG, "stream": False}
        response = httpx.post(f"{short.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout"
        wait_idle(short.base_url)


def test_api_restart_keeps_the_ranks_and_serves_without_reload(api, cluster, tmp_path):
    loads_before = cluster.log_path.read_text().count("ready")
    pids_before = cluster.rank_pids()
    api.stop()
    env = {"SOCKET_PATH": str(cluster.socket_path)}
    restarted = start_api(env, tmp_path / "api-restarted.log")
    try:
        wait_ready(restarted.base_url, timeout=15)
        body = {"model": "default", "prompt": PROMPT, "max_tokens": 3}
        response = httpx.post(f"{restarted.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
    finally:
        api.process = restarted.process  # the module fixture stops whichever runs now
        api.port = restarted.port
    assert cluster.rank_pids() == pids_before
    assert cluster.log_path.read_text().count("ready") == loads_before


def test_ranks_killed_mid_stream_end_the_stream_with_an_error(api, cluster):
    events: list[dict] = []
    with httpx.stream("POST", f"{api.base_url}/v1/completions", json=LONG, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        events.append(json.loads(next(lines)[6:]))
        killed_at = time.monotonic()
        os.kill(cluster.rank_pids()[1], signal.SIGKILL)  # one rank dies; the job follows
        for line in lines:
            events.append(json.loads(line[6:]))
        ended_after = time.monotonic() - killed_at
    assert "error" in events[-1], events[-3:]
    assert events[-1]["error"]["code"] == "ranks_unavailable"
    assert ended_after < 10
    health = httpx.get(f"{api.base_url}/health")
    assert health.status_code == 503 and health.json()["ready"] is False
    retry = httpx.post(f"{api.base_url}/v1/completions", json={**LONG, "stream": False})
    assert retry.status_code == 503 and "Retry-After" in retry.headers
