"""The dashboard in a real headless browser (Debian's chromium) against real ranks and
the real api.py: every rank is listed with its memory, the tokens/s plot moves after a
request, the chat panel streams an answer, the page asks for API_KEY once (its state
needs the key, as every route but the probes and the static pages), an idle page never
wakes the ranks, and a model transfer the supervisor reports shows while it runs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from ipc.supervisor_state import STATE_ENV, SupervisorState, TransferView, write_state
from launcher.local_cluster import Cluster
from tests.support.api_server import running_api
from tests.support.browser import browser_missing, headless_chromium

pytestmark = pytest.mark.cluster
KEY = "dashboard-test-key"


@pytest.fixture(scope="module")
def state_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where api.py looks for a supervisor's state (none there unless a test writes it)."""
    return tmp_path_factory.mktemp("supervisor") / "supervisor.json"


@pytest.fixture(scope="module")
def stack(
    endless_llama: Path, state_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    missing = browser_missing()
    if missing:
        pytest.fail(f"the dashboard test needs a browser: {missing}")
    # The chat panel sends no temperature: greedy, this model streams to max_tokens every
    # time. (Sampled at temperature 1, the tiny random model ended at once in 1 of 40 tries,
    # and a CI run saw that empty answer.)
    with Cluster(endless_llama, ranks=2, env={"KEEP_WARM_SECONDS": "0"}) as cluster:
        env = {"SOCKET_PATH": str(cluster.socket_path), "API_KEY": KEY, STATE_ENV: str(state_file)}
        log = tmp_path_factory.mktemp("dashboard") / "api.log"
        with running_api(env, log) as api, headless_chromium() as browser:
            browser.get(f"{api.base_url}/")
            # the first poll of /dashboard/state answers 401: the page asks for the key
            alert = wait(browser, expected_conditions.alert_is_present())
            alert.send_keys(KEY)
            alert.accept()
            yield cluster, api, browser


def wait(browser: Any, check: Callable[[Any], Any], timeout: float = 20.0) -> Any:
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(check)


def test_api_clients_still_get_the_service_info(stack) -> None:
    _, api, _ = stack
    headers = {"Accept": "application/json", "x-api-key": KEY}
    info = httpx.get(f"{api.base_url}/", headers=headers).json()
    paths = {endpoint["path"] for endpoint in info["endpoints"]}
    assert info["dashboard"] == "/dashboard" and "/v1/chat/completions" in paths


def test_the_page_lists_every_rank_with_its_memory(stack) -> None:
    _, _, browser = stack
    wait(browser, lambda b: b.find_element(By.ID, "state").text == "ready")
    rows = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#ranks .rank-row"))
    assert [row.get_attribute("data-rank") for row in rows] == ["0", "1"]
    for row in rows:
        detail = row.find_element(By.CLASS_NAME, "rank-detail").text
        assert "weights" in detail and "KiB" in detail and "of " in detail, detail
        assert row.find_elements(By.CSS_SELECTOR, ".dot.up")
    assert "tensor" in browser.find_element(By.ID, "plan-headline").text


def test_an_idle_page_never_wakes_the_ranks(stack) -> None:
    cluster, _, _ = stack
    before = cluster.status().counters.steps
    time.sleep(6)  # three polls of /dashboard/state
    assert cluster.status().counters.steps == before


def test_the_tokens_per_second_plot_moves_after_a_request(stack) -> None:
    _, api, browser = stack
    plot = browser.find_element(By.ID, "tps-plot")
    assert float(plot.get_attribute("data-max")) <= 1.0  # nothing decoded yet
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    headers = {"Authorization": f"Bearer {KEY}"}
    reply = httpx.post(
        f"{api.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60
    )
    assert reply.status_code == 200
    wait(browser, lambda b: float(plot.get_attribute("data-max")) > 1.0)
    rows = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#recent tbody tr"))
    assert rows[0].find_elements(By.TAG_NAME, "td")[3].text == str(
        reply.json()["usage"]["completion_tokens"]
    )


def test_the_chat_panel_streams_with_the_key_the_page_asked_for(stack) -> None:
    _, _, browser = stack
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys("Hello there")
    browser.find_element(By.ID, "chat-send").click()
    assert not _alert_open(browser)  # the page has the key already
    wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    wait(browser, lambda b: b.find_element(By.ID, "chat-send").is_enabled(), timeout=60)
    final = browser.find_element(By.ID, "chat-output")
    assert "error" not in (final.get_attribute("class") or ""), final.text
    # the answer arrived as server-sent events, shown delta by delta
    assert final.text and int(final.get_attribute("data-chunks") or 0) >= 2
    box.send_keys("And again")
    browser.find_element(By.ID, "chat-send").click()
    wait(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2)
    assert not _alert_open(browser)  # the key was kept in the page


def _alert_open(browser: Any) -> bool:
    try:
        browser.switch_to.alert.text  # noqa: B018
    except Exception:  # noqa: BLE001 - selenium raises NoAlertPresentException
        return False
    return True


def test_the_speculation_and_disk_figures_follow_the_status(stack) -> None:
    cluster, _, browser = stack
    deadline = time.monotonic() + 120
    while (status := cluster.status()).active_requests and time.monotonic() < deadline:
        time.sleep(0.5)  # the chat panel's answer streams on; its figures still grow
    assert not status.active_requests, status
    figures = status.speculation
    state = "prompt lookup, up to" if figures.enabled else "off"
    counts = f"{figures.proposed_tokens} / {figures.accepted_tokens}"
    _shows(browser, "speculation", [state, counts])
    _shows(browser, "cache", ["on disk", f"{status.prefix_cache.disk_entries} ("])


def _shows(browser: Any, element: str, parts: list[str]) -> None:
    """Wait until the element's text holds every part (the page polls every 2 s)."""
    text = lambda b: b.find_element(By.ID, element).text  # noqa: E731
    try:
        wait(browser, lambda b: all(part in text(b) for part in parts))
    except TimeoutException:
        pytest.fail(f"#{element} never showed {parts}: {text(browser)!r}")


def test_a_model_transfer_shows_while_it_runs(stack, state_file: Path) -> None:
    _, _, browser = stack
    sending = TransferView(
        rank=1,
        host="me@mac2",
        phase="sending",
        share="layers 31-60 (30)",
        done_bytes=3 * 2**30,
        total_bytes=12 * 2**30,
        rate=1.1e9,
        eta_s=8.4,
    )
    done = TransferView(rank=2, host="me@mac3", phase="done", done_bytes=2**30, total_bytes=2**30)
    state = SupervisorState(
        pid=os.getpid(), phase="starting", since=time.time(), transfer=[sending, done]
    )
    write_state(state_file, state)  # as the supervisor writes it before a start
    try:
        rows = wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#transfer .rank-row"))
        assert [row.get_attribute("data-rank") for row in rows] == ["1", "2"]
        detail = rows[0].find_element(By.CLASS_NAME, "rank-detail").text
        assert "me@mac2 · sending · 3.0 GiB of 12.0 GiB · 1.0 GiB/s · 8 s left" in detail, detail
        bar = rows[0].find_element(By.CSS_SELECTOR, ".progress span").get_attribute("style")
        assert "width: 25%" in bar, bar
        assert browser.find_element(By.ID, "transfer-section").is_displayed()
    finally:
        state_file.unlink()
    wait(browser, lambda b: not b.find_element(By.ID, "transfer-section").is_displayed())
