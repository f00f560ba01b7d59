"""Debian's chromium, headless, driven through chromedriver (selenium), for page tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

# Without the background-networking flags chromium tries hosts this machine cannot reach.
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def browser_missing() -> str | None:
    """Why no browser can run here, or None."""
    for name in ("chromium", "chromedriver"):
        if shutil.which(name) is None:
            return f"{name} is not installed (apt-get install chromium chromium-driver)"
    return None


@contextmanager
def headless_chromium(width: int = 1300, height: int = 1400) -> Iterator[webdriver.Chrome]:
    """A headless chromium; a start that fails says so with chromedriver's log."""
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    log = Path(profile) / "chromedriver.log"
    try:
        try:
            driver = _start(width, height, Path(profile) / "data", log)
        except WebDriverException as error:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"chromium did not start: {error.msg}\n{tail}") from None
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _start(width: int, height: int, data_dir: Path, log: Path) -> webdriver.Chrome:
    options = Options()
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument(f"--user-data-dir={data_dir}")
    options.binary_location = shutil.which("chromium") or "chromium"
    # Not the OpenBLAS that test.sh preloads for the ranks: chromium's renderer dies with it
    # ("Unable to receive message from renderer"), which is how CI failed.
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    service = Service(shutil.which("chromedriver") or "chromedriver", log_output=str(log), env=env)
    return webdriver.Chrome(service=service, options=options)
