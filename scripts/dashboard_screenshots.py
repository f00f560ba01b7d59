"""Screenshots of a running server's dashboard, idle and under load, for the docs.

    .venv/bin/python scripts/dashboard_screenshots.py http://127.0.0.1:8100 docs/

Writes dashboard-idle.png, then streams a few chat completions in the background and
writes dashboard-load.png while they run. Needs chromium and chromium-driver.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.browser import headless_chromium  # noqa: E402

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how bread rises, step by step.",
    "List ten rivers of Europe and one fact about each.",
    "Describe a walk through a forest in autumn.",
]


def load(url: str, key: str, stop: threading.Event, index: int) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while not stop.is_set():
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
            "max_tokens": 100,
        }
        index += 1
        try:
            httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
        except httpx.HTTPError:
            time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds of load first")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    with headless_chromium(1300, 1420) as browser:
        browser.get(f"{url}/")
        time.sleep(5)
        browser.save_screenshot(str(args.out / "dashboard-idle.png"))
        stop = threading.Event()
        workers = [
            threading.Thread(target=load, args=(url, args.api_key, stop, i), daemon=True)
            for i in range(args.clients)
        ]
        for worker in workers:
            worker.start()
        time.sleep(args.settle)
        browser.save_screenshot(str(args.out / "dashboard-load.png"))
        stop.set()
    print(f"wrote {args.out / 'dashboard-idle.png'} and {args.out / 'dashboard-load.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
