"""A copy of the project that launch.sh runs in, for the tests that drive launch.sh itself:
its own run/, logs, .env and API port, sharing the project's .venv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from config.settings import PROJECT_DIR, Settings
from ipc.processes import cpu_seconds
from tests.support.api_server import free_port
from tests.support.process_list import project_processes

START_TIMEOUT = 600


class Project:
    """A copy of the working tree with its own .env, sharing the project's .venv."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port

    def launch(
        self, *args: str, env: dict | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if k.upper() not in setting_names()}
        clean.pop("ENV_FILE", None)
        return subprocess.run(
            ["./launch.sh", *args],
            cwd=self.root,
            env={**clean, **(env or {})},
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )

    def pid(self, name: str) -> int:
        return int((self.root / "run" / name).read_text().strip())

    def pid_or_none(self, name: str) -> int | None:
        """The pid in run/NAME, None while it is missing (the supervisor restarts that)."""
        try:
            return self.pid(name)
        except (FileNotFoundError, ValueError):
            return None


def setting_names() -> set[str]:
    return {name.upper() for name in Settings.model_fields} | {"MODEL_REPO"}


def cpu_used(pid: int) -> float:
    used = cpu_seconds(pid)
    assert used is not None, f"process {pid} is gone"
    return used


def ours(root: Path) -> list[str]:
    """Command lines of running processes that belong to this copy of the project."""
    return [f"{pid}: {command}" for pid, command in project_processes(root)]


def copy_project(root: Path, env: str) -> Project:
    """A copy of the working tree at `root` sharing the .venv, with `env` as .env plus a
    free API_PORT and, unless `env` names one, a PREFIX_CACHE_DIR of its own."""
    root.mkdir()
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=PROJECT_DIR,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, files.decode().split("\0")):
        source = PROJECT_DIR / name
        if source.is_file():
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)
    (root / ".venv").symlink_to((PROJECT_DIR / ".venv").resolve())
    port = free_port()
    if "PREFIX_CACHE_DIR=" not in env:  # not the user's ~/.cache/mlx-ring, which every
        # copy shared: 275 entries of earlier runs' tiny models were loaded there at start
        env = f"PREFIX_CACHE_DIR={root / 'prefix-cache'}\n{env}"
    (root / ".env").write_text(f"API_PORT={port}\n{env}")
    return Project(root, port)
