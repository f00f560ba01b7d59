"""The one settings model. Environment variables override `.env`; `.env` overrides defaults."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_DIR = Path(__file__).resolve().parent.parent
REMOTE_PATH = re.compile(r"^[~A-Za-z0-9_./-]+$")  # used unquoted in the workers' shells


class Settings(BaseSettings):
    """Every variable the project reads. `.env.example` documents each one."""

    model_config = SettingsConfigDict(
        env_file=os.environ.get("ENV_FILE", PROJECT_DIR / ".env"),
        env_file_encoding="utf-8",
        extra="ignore",
        populate_by_name=True,
    )

    # Model
    model: str = Field(
        default="",
        validation_alias=AliasChoices("MODEL", "MODEL_REPO"),
        description="Local MLX directory, Hugging Face repo id, .gguf path; empty = default",
    )
    model_cache_dir: Path = Field(default=Path.home() / ".cache" / "mlx-ring")
    import_dtype: Literal["auto", "quantized", "float32", "float16", "bfloat16"] = "auto"

    # API
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8100, ge=1, le=65535)
    api_key: str = ""
    socket_path: Path = Field(default=PROJECT_DIR / "run" / "rank0.sock")
    max_request_bytes: int = Field(default=1_048_576, ge=1024)

    # Cluster
    num_devices: int = Field(default=2, ge=1, le=64)
    worker_hosts: str = ""
    worker_ssh: str = ""
    remote_dir: str = "~/mlx-ring"
    distributed_backend: Literal["ring", "jaccl", "mpi", "any"] = "ring"
    parallelism: Literal["auto", "tensor", "pipeline"] = "auto"
    rank_weights: str = ""

    # Generation
    max_sequence_length: int = Field(default=4096, ge=16)
    max_batch_size: int = Field(default=8, ge=1, le=256)
    default_max_tokens: int = Field(default=512, ge=1)
    prefill_chunk_size: int = Field(default=256, ge=16)

    # Timeouts and logging
    request_timeout_seconds: float = Field(default=300.0, gt=0)
    collective_timeout_seconds: float = Field(default=60.0, gt=0)
    keep_warm_seconds: float = Field(default=60.0, ge=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("rank_weights")
    @classmethod
    def _check_rank_weights(cls, value: str) -> str:
        value = value.strip()
        if value in ("", "auto"):
            return value
        try:
            weights = [float(part) for part in value.split(",")]
        except ValueError:
            message = "must be empty, 'auto', or comma-separated numbers like 2,1,1"
            raise ValueError(message) from None
        if any(weight <= 0 for weight in weights):
            raise ValueError("every weight must be positive, for example 2,1,1")
        return value

    @field_validator("remote_dir")
    @classmethod
    def _check_remote_dir(cls, value: str) -> str:
        dirs = _split_list(value)
        if not dirs:
            raise ValueError("must name a directory, for example ~/mlx-ring")
        bad = [d for d in dirs if not REMOTE_PATH.match(d)]
        if bad:
            raise ValueError(
                f"{bad[0]!r} must be a plain path (letters, digits, ~ _ . / -); give one "
                "path for every worker or a comma list with one per worker"
            )
        return ",".join(dirs)

    @model_validator(mode="after")
    def _check_remote_dir_count(self) -> Settings:
        dirs, hosts = _split_list(self.remote_dir), self.worker_host_list
        if hosts and len(dirs) > 1 and len(dirs) != len(hosts):
            raise ValueError(
                f"REMOTE_DIR has {len(dirs)} paths but WORKER_HOSTS has {len(hosts)}: give "
                "one path for every worker, or one per worker in the order of WORKER_HOSTS"
            )
        return self

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.default_max_tokens >= self.max_sequence_length:
            raise ValueError(
                f"DEFAULT_MAX_TOKENS ({self.default_max_tokens}) must be below "
                f"MAX_SEQUENCE_LENGTH ({self.max_sequence_length})"
            )
        return self

    @property
    def worker_host_list(self) -> list[str]:
        """WORKER_HOSTS split on commas and spaces, empty entries dropped."""
        return _split_list(self.worker_hosts)

    @property
    def remote_dir_list(self) -> list[str]:
        """The project directory of each worker, in WORKER_HOSTS order."""
        dirs, count = _split_list(self.remote_dir), len(self.worker_host_list)
        return dirs * count if len(dirs) == 1 else dirs[:count]  # count checked above

    def parsed_rank_weights(self, world_size: int) -> list[float] | None:
        """Explicit per-rank weights, None for equal or `auto` (resolved by the planner)."""
        if self.rank_weights in ("", "auto"):
            return None
        return [float(part) for part in self.rank_weights.split(",")]


def _split_list(value: str) -> list[str]:
    """A comma (or space) separated setting as its non-empty parts."""
    return [part for part in value.replace(",", " ").split() if part]


def _describe(error: dict) -> str:
    field = str(error["loc"][0]) if error["loc"] else "settings"
    name = field.upper()
    given = error.get("input")
    allowed = error["msg"].removeprefix("Value error, ")
    if error["type"] == "literal_error":
        allowed = "one of " + error["ctx"]["expected"]
    if not error["loc"]:
        return f"invalid settings: {allowed}"
    return f"invalid setting {name}={given!r}: {allowed}"


def load_settings(**overrides: object) -> Settings:
    """Read the settings; on a bad value print one line per problem and exit with status 2."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        for error in exc.errors():
            print(f"error: {_describe(error)}", file=sys.stderr)
        raise SystemExit(2) from None
