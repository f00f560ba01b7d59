"""REMOTE_DIR: one project directory for every worker, or one per worker in order."""

from __future__ import annotations

import subprocess
import sys

import pytest

from config.settings import PROJECT_DIR, Settings
from launcher import detect
from tests.test_settings import run_config


def make(**values: object) -> Settings:
    return Settings(_env_file=None, **values)


def test_one_path_serves_every_worker() -> None:
    settings = make(worker_hosts="10.0.5.2,10.0.5.3", remote_dir="~/mlx-ring")
    assert settings.remote_dirs == ["~/mlx-ring", "~/mlx-ring"]


def test_a_list_gives_each_worker_its_own_path_in_order() -> None:
    settings = make(worker_hosts="10.0.5.2,10.0.5.3", remote_dir="/srv/a, ~/b")
    assert settings.remote_dirs == ["/srv/a", "~/b"]
    assert settings.remote_dir == ["/srv/a", "~/b"]


def test_a_list_is_not_checked_in_local_mode() -> None:
    assert make(remote_dir="/a,/b").remote_dirs == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"WORKER_HOSTS": "10.0.5.2,10.0.5.3", "REMOTE_DIR": "/a,/b,/c"},
            "error: invalid settings: REMOTE_DIR has 3 paths but WORKER_HOSTS has 2: give "
            "one path for every worker, or one per worker in the order of WORKER_HOSTS",
        ),
        (
            {"REMOTE_DIR": "/a,/b;rm"},
            "error: invalid setting REMOTE_DIR='/a,/b;rm': '/b;rm' must be a plain path "
            "(letters, digits, ~ _ . / -); give one path for every worker or a comma list "
            "with one per worker",
        ),
        (
            {"REMOTE_DIR": ","},
            "error: invalid setting REMOTE_DIR=',': must name a directory, for example ~/mlx-ring",
        ),
    ],
)
def test_a_bad_remote_dir_is_one_line_naming_the_fix(env: dict, message: str) -> None:
    done = run_config(env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [message]


def test_hostfile_workers_prints_rank_destination_and_directory(tmp_path) -> None:
    env_file = tmp_path / "remote.env"
    env_file.write_text(
        "WORKER_HOSTS=10.0.5.2,10.0.5.3\nWORKER_SSH=me@mac2,me@mac3\nREMOTE_DIR=/srv/a,~/b\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "launcher.hostfile", "workers"],
        cwd=PROJECT_DIR,
        env={"PATH": "/usr/bin:/bin", "ENV_FILE": str(env_file)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1 me@mac2 /srv/a", "2 me@mac3 ~/b"]


def test_a_version_mismatch_names_the_venv_to_delete() -> None:
    here = detect.local_facts()
    there = here.model_copy(update={"mlx_lm": "0.20.0", "venv": True})
    (problem,) = detect.compare("me@mac2", here, there, "/srv/a")
    assert problem.startswith(f"me@mac2: mlx-lm 0.20.0, here {here.mlx_lm}: delete /srv/a/.venv")
