"""API_KEY's one rule (gateway/auth.py), route by route: every route the app has, found
by walking the app (so a route added later is tested without being named here), needs the
key except the health probes and the pages that hold no state (the dashboard's page and
files, the API's docs). Requests go through the real app in process; no ranks run (a
route that passes the gate answers 503, 400 or 404 here, never 401)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Mount, Route

from config.settings import Settings
from gateway.app import create_app

KEY = "route-test-key"
# The rule, written out here on its own: what answers without the key.
OPEN = {
    ("GET", "/health"),
    ("GET", "/health/live"),
    ("GET", "/health/ready"),
    ("GET", "/dashboard"),
    ("GET", "/dashboard/static/app.js"),
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    ("GET", "/openapi.json"),
}
BROWSER = {"Accept": "text/html,application/xhtml+xml"}


def _client(tmp_path, api_key: str) -> TestClient:
    settings = Settings(api_key=api_key, socket_path=tmp_path / "no-ranks.sock")
    return TestClient(create_app(settings), raise_server_exceptions=False)


def routes(app, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, a path that reaches it) for every route of `app` (or router), included
    routers walked too (FastAPI 0.165 keeps them as objects with `original_router`); path
    parameters get a made-up value, a mount one of its files."""
    for route in app.routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from routes(included, prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            yield "GET", f"{prefix}{route.path}/app.js"
        elif isinstance(route, APIRoute | Route):
            path = prefix + re.sub(r"\{[^}]+\}", "x1", route.path)
            for method in sorted((route.methods or set()) - {"HEAD"}):
                yield method, path


def _send(client: TestClient, method: str, path: str, headers: dict[str, str]):
    body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
    return client.request(method, path, headers=headers, **body)


@pytest.fixture
def keyed(tmp_path) -> Iterator[TestClient]:
    with _client(tmp_path, KEY) as client:
        yield client


def test_every_route_needs_the_key_but_the_probes_and_stateless_pages(keyed) -> None:
    found = set(routes(keyed.app))
    # the walk sees the routes it must (a broken walk would test nothing)
    for must in ("/dashboard/state", "/metrics", "/cluster/status", "/v1/chat/completions"):
        assert any(path == must for _, path in found), (must, sorted(found))
    assert found >= OPEN, sorted(OPEN - found)
    wrong = []
    for method, path in sorted(found):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            status = _send(keyed, method, path, headers).status_code
            if (status == 401) == ((method, path) in OPEN):
                wrong.append(f"{method} {path} {headers or 'no key'}: {status}")
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            status = _send(keyed, method, path, headers).status_code
            if status == 401:
                wrong.append(f"{method} {path} with the key: 401")
    assert not wrong, "\n".join(wrong)


def test_the_root_is_the_page_for_a_browser_and_the_keyed_service_info_for_clients(keyed):
    assert keyed.get("/", headers=BROWSER).status_code == 200
    assert keyed.get("/", headers={"Accept": "application/json"}).status_code == 401
    info = keyed.get("/", headers={"Accept": "application/json", "x-api-key": KEY})
    assert info.status_code == 200 and info.json()["dashboard"] == "/dashboard"


def test_refusals_come_before_routing_and_in_each_apis_shape(keyed) -> None:
    openai = keyed.post("/v1/chat/completions", json={"bad": 1})  # unread, unvalidated
    assert openai.status_code == 401 and openai.headers["www-authenticate"] == "Bearer"
    assert openai.json()["error"]["code"] == "invalid_api_key"
    assert "Missing API key" in openai.json()["error"]["message"]
    anthropic = keyed.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert anthropic.status_code == 401
    assert anthropic.json()["error"]["type"] == "authentication_error"
    assert keyed.get("/v1/no-such-route").status_code == 401  # no route list without a key


def test_without_api_key_nothing_asks_for_one(tmp_path) -> None:
    with _client(tmp_path, "") as client:
        refused = [
            f"{method} {path}"
            for method, path in sorted(set(routes(client.app)))
            if _send(client, method, path, {}).status_code == 401
        ]
    assert not refused, refused
