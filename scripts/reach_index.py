"""Whether the package index answers from this host (scripts/setup_venv.sh reach-index):
the index pip would use here (PIP_INDEX_URL, else pip's own configuration), else PyPI; one
request of 5 s at most. Exit 0 when it answers; else 1 and the reason on stderr. Standard
library only: it runs before the venv exists."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request


def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
        )
        url = got.stdout.strip() if got.returncode == 0 else ""
    return url or "https://pypi.org/simple/"


def main() -> int:
    url = index_url()
    try:
        urllib.request.urlopen(url.rstrip("/") + "/pip/", timeout=5).close()
    except (OSError, ValueError) as exc:
        print(f"{url} does not answer: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
