"""Settings: `python -m config` with bad values exits 2 with one line per bad variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.settings import PROJECT_DIR

SETTING_NAMES = [
    "MODEL",
    "MODEL_CACHE_DIR",
    "IMPORT_DTYPE",
    "API_HOST",
    "API_PORT",
    "API_KEY",
    "SOCKET_PATH",
    "NUM_DEVICES",
    "WORKER_HOSTS",
    "WORKER_SSH",
    "REMOTE_DIR",
    "DISTRIBUTED_BACKEND",
    "PARALLELISM",
    "RANK_WEIGHTS",
    "MAX_SEQUENCE_LENGTH",
    "MAX_BATCH_SIZE",
    "DEFAULT_MAX_TOKENS",
    "REQUEST_TIMEOUT_SECONDS",
    "COLLECTIVE_TIMEOUT_SECONDS",
    "LOG_LEVEL",
]


def run_config(env: dict[str, str], env_file: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m config` with only `env` set among the settings (and ENV_FILE)."""
    clean = {k: v for k, v in os.environ.items() if k not in SETTING_NAMES and k != "MODEL_REPO"}
    clean["ENV_FILE"] = str(env_file) if env_file else "/nonexistent/.env"
    return subprocess.run(
        [sys.executable, "-m", "config"],
        cwd=PROJECT_DIR,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def parse(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines())


BAD_VALUES = [
    ("API_PORT", "70000", "less than or equal to 65535"),
    ("API_PORT", "http", "valid integer"),
    ("NUM_DEVICES", "0", "greater than or equal to 1"),
    ("DISTRIBUTED_BACKEND", "tcp", "one of 'ring', 'jaccl', 'mpi' or 'any'"),
    ("PARALLELISM", "diagonal", "one of 'auto', 'tensor' or 'pipeline'"),
    ("IMPORT_DTYPE", "int3", "one of 'auto', 'quantized', 'float32', 'float16' or 'bfloat16'"),
    ("LOG_LEVEL", "loud", "one of 'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
    ("RANK_WEIGHTS", "2,x", "comma-separated numbers like 2,1,1"),
    ("RANK_WEIGHTS", "1,-1", "every weight must be positive"),
    ("MAX_BATCH_SIZE", "many", "valid integer"),
    ("MAX_SEQUENCE_LENGTH", "8", "greater than or equal to 16"),
    ("REQUEST_TIMEOUT_SECONDS", "0", "greater than 0"),
    ("COLLECTIVE_TIMEOUT_SECONDS", "soon", "valid number"),
    ("KV_CACHE_BITS", "16", "'none', '8' or '4'"),
    ("PREFIX_CACHE_DISK_BYTES", "lots", "a size such as 0, 512MiB or 2GiB"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_bad_value_gives_one_line_and_exit_2(name, value, allowed):
    result = run_config({name: value})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: invalid setting {name}=")
    assert value.upper() in lines[0].upper()
    assert allowed in lines[0]


def test_cross_field_limit_names_both_variables():
    result = run_config({"DEFAULT_MAX_TOKENS": "5000", "MAX_SEQUENCE_LENGTH": "4096"})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: invalid settings: DEFAULT_MAX_TOKENS (5000) must be below "
        "MAX_SEQUENCE_LENGTH (4096)"
    )


def test_the_context_defaults_to_the_models():
    """Empty MAX_SEQUENCE_LENGTH: rank 0 takes the model's context (leader/context_window.py);
    a default cap then needs no relation to it."""
    for env in ({}, {"MAX_SEQUENCE_LENGTH": ""}, {"DEFAULT_MAX_TOKENS": "100000"}):
        result = run_config(env)
        assert result.returncode == 0, result.stderr
        assert parse(result.stdout)["MAX_SEQUENCE_LENGTH"] in ("", "None")
    bad = run_config({"MAX_SEQUENCE_LENGTH": "long"})
    assert bad.returncode == 2 and "MAX_SEQUENCE_LENGTH='long'" in bad.stderr


def test_two_bad_values_give_two_lines():
    result = run_config({"API_PORT": "0", "PARALLELISM": "both"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2
    assert {line.split("=")[0] for line in lines} == {
        "error: invalid setting API_PORT",
        "error: invalid setting PARALLELISM",
    }


def test_defaults_cover_every_setting():
    result = run_config({})
    assert result.returncode == 0, result.stderr
    values = parse(result.stdout)
    assert set(SETTING_NAMES) <= set(values)
    assert values["API_HOST"] == "127.0.0.1"
    assert values["API_PORT"] == "8100"
    assert values["IMPORT_DTYPE"] == "auto"
    assert values["MODEL"] == ""


def test_environment_overrides_env_file(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("API_PORT=9000\nLOG_LEVEL=debug\nMODEL_REPO=someone/model\n")
    from_file = parse(run_config({}, env_file).stdout)
    assert (from_file["API_PORT"], from_file["LOG_LEVEL"]) == ("9000", "DEBUG")
    assert from_file["MODEL"] == "someone/model"  # MODEL_REPO is an alias of MODEL
    overridden = parse(run_config({"API_PORT": "9100", "MODEL": "other/model"}, env_file).stdout)
    assert (overridden["API_PORT"], overridden["LOG_LEVEL"]) == ("9100", "DEBUG")
    assert overridden["MODEL"] == "other/model"


def test_bad_value_in_env_file_is_reported(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("NUM_DEVICES=-3\n")
    result = run_config({}, env_file)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: invalid setting NUM_DEVICES='-3'")
