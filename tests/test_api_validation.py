"""api.py with no ranks running: every refusal is OpenAI-shaped with the right status.

These requests never reach a rank: bad bodies get 400, a missing/wrong key 401, unknown
routes 404/405, big bodies 413, and valid requests 503 with Retry-After.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.support.api_server import PROJECT_DIR, running_api

KEY = "test-secret-key"
MAX_BYTES = 4096
GOOD_CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
GOOD_TEXT = {"model": "default", "prompt": "hi", "max_tokens": 4}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
GOOD_MESSAGES = {
    "model": "claude-x",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-validation")
    env = {
        "SOCKET_PATH": str(tmp / "no-ranks.sock"),
        "API_KEY": KEY,
        "MAX_REQUEST_BYTES": str(MAX_BYTES),
    }
    with running_api(env, tmp / "api.log") as process:
        yield process


@pytest.fixture(scope="module")
def client(api):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=api.base_url, headers=headers, timeout=10) as http:
        yield http


def assert_openai_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def chat(**changes):
    body = {**GOOD_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(temperature=-0.5), "temperature"),
        (chat(temperature=2.5), "temperature"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=-3), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(top_p=0), "top_p"),
        (chat(top_p=1.5), "top_p"),
        (chat(min_p=2), "min_p"),
        (chat(top_k=-1), "top_k"),
        (chat(messages=[]), "messages"),
        (chat(messages=...), "messages"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages.0"),
        (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), None),
        (chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), None),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}), None),
        (chat(tools=[WEATHER, WEATHER]), "tools"),
        (chat(response_format={"type": "json_schema"}), None),
        (chat(response_format={"type": "xml"}), "response_format"),
        (chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
        (chat(messages=[{"role": "user"}]), "messages.0"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(stop=""), "stop"),
        (chat(n=2), "n"),
        (chat(top_logprobs=3), None),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(model=""), "model"),
        (chat(stream="yes please"), "stream"),
    ],
)
def test_chat_invalid_parameters_get_400(client, body, param):
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert "JSON object" not in error["message"], error  # says what is wrong, not a generic line


def test_cross_field_errors_say_what_is_wrong(client):
    body = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400)
    assert "'nope'" in error["message"] and "get_weather" in error["message"]


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "'image'"),
        ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "server tool"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_anthropic_invalid_requests_get_anthropic_errors(client, changes, needle):
    response = client.post("/v1/messages", json={**GOOD_MESSAGES, **changes})
    assert needle in assert_anthropic_error(response, 400, "invalid_request_error")


def test_anthropic_routes_answer_in_their_shape(api):
    url = f"{api.base_url}/v1/messages"
    assert_anthropic_error(httpx.post(url, json=GOOD_MESSAGES), 401, "authentication_error")
    ok = httpx.post(url, json=GOOD_MESSAGES, headers={"x-api-key": KEY})  # older clients' header
    assert_anthropic_error(ok, 503, "overloaded_error")
    big = {**GOOD_MESSAGES, "system": "x" * (MAX_BYTES + 10)}
    too_big = httpx.post(url, json=big, headers={"x-api-key": KEY})
    assert_anthropic_error(too_big, 413, "request_too_large")
    count = httpx.post(f"{url}/count_tokens", json=GOOD_MESSAGES, headers={"x-api-key": KEY})
    assert_anthropic_error(count, 503, "overloaded_error")


def test_service_info_lists_the_endpoints_with_the_key(api):
    assert httpx.get(f"{api.base_url}/").status_code == 401  # API_KEY's rule: gateway/auth.py
    info = httpx.get(f"{api.base_url}/", headers={"x-api-key": KEY}).json()
    assert info["service"] == "MLX ring inference" and info["model"] is None
    assert info["ready"] is False and info["state"] == "down"
    listed = {(e["method"], e["path"]) for e in info["endpoints"]}
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/health"):
        assert any(path == route for _, path in listed), route
    assert ("GET", "/model/info") in listed and ("GET", "/health/live") in listed
    assert all(e["description"] for e in info["endpoints"])


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"echo": True}, None),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_completions_invalid_parameters_get_400(client, changes, param):
    response = client.post("/v1/completions", json={**GOOD_TEXT, **changes})
    assert_openai_error(response, 400, param=param)


def test_n_above_one_is_refused_with_a_reason(client):
    error = assert_openai_error(client.post("/v1/chat/completions", json=chat(n=3)), 400, "n")
    assert "n=3 is not supported" in error["message"]


def test_broken_bodies_get_400_not_fastapis_422(client):
    url = "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    error = assert_openai_error(client.post(url, content=b'{"model": ', headers=headers), 400)
    assert error["code"] == "invalid_json"
    assert_openai_error(client.post(url, content=b"[1, 2]", headers=headers), 400)
    assert_openai_error(client.post(url, content=b"", headers=headers), 400)
    nan = json.dumps(GOOD_CHAT).replace('"max_tokens": 4', '"temperature": NaN')
    assert_openai_error(client.post(url, content=nan.encode(), headers=headers), 400, "temperature")


def test_auth_missing_wrong_and_right_key(api):
    url = f"{api.base_url}/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(url, json=GOOD_CHAT, headers=headers)
        error = assert_openai_error(response, 401, code="invalid_api_key")
        assert error["type"] == "invalid_request_error"
    # Auth is checked before the body: a bad body without a key is still 401.
    assert httpx.post(url, json={"bad": 1}).status_code == 401
    assert httpx.get(f"{api.base_url}/v1/models").status_code == 401
    # Probes stay open so orchestrators can reach them.
    assert httpx.get(f"{api.base_url}/health/live").status_code == 200
    ok = httpx.post(url, json=GOOD_CHAT, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 503


def test_unknown_route_and_wrong_method(client):
    error = assert_openai_error(client.get("/v1/nothing-here"), 404, code="not_found")
    assert "/v1/nothing-here" in error["message"]
    assert_openai_error(client.get("/v1/chat/completions"), 405, code="method_not_allowed")


def test_body_over_the_limit_gets_413(client):
    big = chat(messages=[{"role": "user", "content": "x" * (MAX_BYTES + 10)}])
    error = assert_openai_error(client.post("/v1/chat/completions", json=big), 413)
    assert "MAX_REQUEST_BYTES=4096" in error["message"]

    def chunked():  # no Content-Length: the limit must hold while reading
        yield json.dumps(big).encode()

    response = client.post(
        "/v1/chat/completions", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response, 413, code="request_too_large")


def test_valid_requests_get_503_with_retry_after_while_ranks_are_down(client):
    for path, body in (("/v1/chat/completions", GOOD_CHAT), ("/v1/completions", GOOD_TEXT)):
        for stream in (False, True):
            response = client.post(path, json={**body, "stream": stream})
            error = assert_openai_error(response, 503, code="ranks_unavailable")
            assert int(response.headers["Retry-After"]) >= 1
            assert "not running" in error["message"], error["message"]
    assert_openai_error(client.get("/v1/models"), 503)
    assert_openai_error(client.get("/model/info"), 503)


def test_health_says_why_it_is_not_ready(client):
    for path in ("/health", "/health/ready"):
        response = client.get(path)
        assert response.status_code == 503
        body = response.json()
        assert body["ready"] is False and body["status"] == "down"
        assert "does not exist" in body["reason"], body
        assert "Retry-After" in response.headers
    assert client.get("/health/live").json() == {"status": "alive"}
    status = client.get("/cluster/status")
    assert status.status_code == 200
    assert status.json()["state"] == "down" and status.json()["ranks"] == []


def test_metrics_count_requests_and_errors(client):
    client.post("/v1/chat/completions", json=chat(temperature=-1))
    text = client.get("/metrics").text
    assert 'api_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert "api_time_to_first_token_seconds_bucket" in text
    assert "ranks_up 0.0" in text


def test_openapi_schema_is_served(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)


def test_api_never_imports_mlx():
    code = (
        "import sys, api\n"
        "from config.settings import Settings\n"
        "from gateway.app import create_app\n"
        "app = create_app(Settings(socket_path='/nonexistent.sock'))\n"
        "app.openapi()\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
