"""The one settings model, parsed once into typed values.

Environment variables override `.env`; `.env` overrides the defaults. Lists (WORKER_HOSTS,
WORKER_SSH, REMOTE_DIR) and RANK_WEIGHTS are written as comma lists and held as Python
lists; every process reads them from here and nowhere else.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

PROJECT_DIR = Path(__file__).resolve().parent.parent
REMOTE_PATH = re.compile(r"^[~A-Za-z0-9_./-]+$")  # used unquoted in the workers' shells

Parallelism = Literal["auto", "tensor", "pipeline"]
# MLX's CPU backend: the layers' weights [in, out] or [out, in] (engine/cpu_linear.py)
LinearLayout = Literal["transposed", "plain"]
# None: equal shares; "auto": by each rank's memory; else one positive number per rank.
RankWeights = list[float] | Literal["auto"] | None
CommaList = Annotated[list[str], NoDecode]


class SettingsError(ValueError):
    """Bad settings; `lines` holds one `error: ...` line per bad variable."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def split_list(value: object) -> object:
    """A comma (or space) separated setting as its non-empty parts; lists pass through."""
    if isinstance(value, str):
        return [part for part in value.replace(",", " ").split() if part]
    return value


def parse_rank_weights(text: str) -> RankWeights:
    """RANK_WEIGHTS text: '' -> None (equal), 'auto', or '2,1,1' -> [2.0, 1.0, 1.0]."""
    text = text.strip()
    if text == "auto":
        return "auto"
    if not text:
        return None
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        message = "must be empty, 'auto', or comma-separated numbers like 2,1,1"
        raise ValueError(message) from None
    if any(not weight > 0 for weight in weights):
        raise ValueError("every weight must be positive, for example 2,1,1")
    return weights


_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int | None:
    """'' -> None (the default); '0', '512MiB', '2GiB', '1.5G', '1048576' -> bytes."""
    if not text.strip():
        return None
    found = _BYTES.match(text)
    if found is None:
        raise ValueError("must be a size such as 0, 512MiB or 2GiB (empty: the default)")
    return int(float(found.group(1)) * _BYTE_UNITS[found.group(2).lower()])


def parse_optional(text: str) -> str | None:
    """'' -> None (the default); anything else is left to the field's validation."""
    return None if not text.strip() else text.strip()


# Variables written as text with their own syntax, and the parser of each.
_TEXT_PARSERS: dict[str, Callable[[str], object]] = {
    "rank_weights": parse_rank_weights,
    "prefix_cache_bytes": parse_bytes,
    "response_store_bytes": parse_bytes,
    "prefix_cache_disk_bytes": parse_bytes,
    "max_sequence_length": parse_optional,
    "prefix_cache_dir": parse_optional,
}


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
    served_model_name: str = Field(default="", max_length=256)
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
    worker_hosts: CommaList = Field(default_factory=list)
    worker_ssh: CommaList = Field(default_factory=list)
    remote_dir: CommaList = Field(default_factory=lambda: ["~/mlx-ring"])
    distributed_backend: Literal["ring", "jaccl", "mpi", "any"] = "ring"
    parallelism: Parallelism = "auto"
    rank_weights: Annotated[RankWeights, NoDecode] = None
    # Remote mode: what each worker receives from the first host (launcher/model_sender.py)
    model_transfer: Literal["share", "full"] = "share"
    transfer_streams: int = Field(default=4, ge=1, le=32)

    # Generation
    # None: the model's own context, lowered where memory says so (leader/context_window.py)
    max_sequence_length: Annotated[int | None, NoDecode] = Field(default=None, ge=16)
    max_batch_size: int = Field(default=8, ge=1, le=256)
    default_max_tokens: int = Field(default=512, ge=1)
    # Sampling when a request sets none and the model has no generation_config.json value
    default_temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    default_top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    default_top_k: int = Field(default=0, ge=0)
    default_min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # prompt tokens a step prefills while no answer decodes (and the most in any step):
    # mlx-lm's prefill step; fewer steps of fixed cost (leader/prefill_budget.py)
    prefill_chunk_size: int = Field(default=2048, ge=16)
    # beside running answers the prefill may make steps at most this many times a decode
    # step, on average (leader/prefill_budget.py); 0: every step prefills PREFILL_CHUNK_SIZE
    prefill_slowdown: float = Field(default=2.0, ge=0.0, le=100.0)
    # a request reaching an idle cluster waits up to this long for more (leader/burst.py)
    burst_window_ms: float = Field(default=20.0, ge=0.0, le=1000.0)
    # auto: decode steps run one mx.compile'd forward where the caches allow it
    compiled_decode: Literal["auto", "off"] = "auto"
    # auto: before it reports ready, rank 0 runs a few requests of its own through every
    # rank, so that the first client's forwards find their kernels compiled and traced
    # (leader/warmup.py); off: the first requests pay that
    warm_up: Literal["auto", "off"] = "auto"
    # auto: rank 0 proposes up to SPEC_TOKENS tokens a row by prompt lookup and every rank
    # verifies them in the step's one forward (leader/speculation.py)
    speculative: Literal["auto", "always", "off"] = "auto"
    spec_tokens: int = Field(default=8, ge=1, le=64)
    # a smaller model with the served model's tokenizer, run on rank 0 alone, that proposes
    # where prompt lookup finds nothing (leader/draft_model.py); empty: none. Resolved as
    # MODEL is (a directory, a Hugging Face repo id, a .gguf file)
    draft_model: str = ""
    linear_layout: LinearLayout = "plain"
    # the KV cache's bits on every rank (engine/quantized_kv.py): none keeps the model's
    # float type; 8 or 4 quantize keys and values in groups of 64 along the head
    kv_cache_bits: Literal["none", "8", "4"] = "none"
    # off: no native kernel (native/sgemm_rows.c) in any rank's preload (launcher/cpu_layer.py)
    native_kernels: Literal["auto", "off"] = "auto"
    # per rank; None: 25% of the memory each rank has left after its weights
    prefix_cache_bytes: Annotated[int | None, NoDecode] = Field(default=None, ge=0)
    # the prefix cache on each rank's disk (engine/prefix_disk.py); None: MODEL_CACHE_DIR's
    # prefix-cache/; bytes None: 8 GiB per rank, 0: off
    prefix_cache_dir: Annotated[Path | None, NoDecode] = None
    prefix_cache_disk_bytes: Annotated[int | None, NoDecode] = Field(default=None, ge=0)
    # api.py's stored Responses (previous_response_id); None: 128 MiB
    response_store_bytes: Annotated[int | None, NoDecode] = Field(default=None, ge=0)

    # Timeouts and logging
    request_timeout_seconds: float = Field(default=300.0, gt=0)
    collective_timeout_seconds: float = Field(default=60.0, gt=0)
    keep_warm_seconds: float = Field(default=60.0, ge=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # Supervision (launcher/supervisor.py restarts the ranks and api.py)
    restart_wait_seconds: float = Field(default=30.0, ge=0)
    restart_limit: int = Field(default=5, ge=1)
    restart_window_seconds: float = Field(default=600.0, gt=0)
    degraded_mode: Literal["off", "auto"] = "off"

    # Debug switches
    ring_profile_collectives: bool = Field(
        default=False, description="time every in-forward all_sum (adds sync points)"
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("worker_hosts", "worker_ssh", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return split_list(value)

    @field_validator(
        "rank_weights",
        "prefix_cache_bytes",
        "response_store_bytes",
        "prefix_cache_disk_bytes",
        "prefix_cache_dir",
        "max_sequence_length",
        mode="before",
    )
    @classmethod
    def _parse_text(cls, value: object, info: ValidationInfo) -> object:
        return _TEXT_PARSERS[str(info.field_name)](value) if isinstance(value, str) else value

    @field_validator("remote_dir", mode="before")
    @classmethod
    def _check_remote_dir(cls, value: object) -> object:
        dirs = split_list(value)
        if not isinstance(dirs, list) or not dirs:
            raise ValueError("must name a directory, for example ~/mlx-ring")
        bad = [d for d in dirs if not REMOTE_PATH.match(str(d))]
        if bad:
            raise ValueError(
                f"{bad[0]!r} must be a plain path (letters, digits, ~ _ . / -); give one "
                "path for every worker or a comma list with one per worker"
            )
        return dirs

    @model_validator(mode="after")
    def _check_together(self) -> Settings:
        """The rules between variables, the first broken one reported."""
        dirs, hosts = self.remote_dir, self.worker_hosts
        if hosts and len(dirs) > 1 and len(dirs) != len(hosts):
            raise ValueError(
                f"REMOTE_DIR has {len(dirs)} paths but WORKER_HOSTS has {len(hosts)}: give "
                "one path for every worker, or one per worker in the order of WORKER_HOSTS"
            )
        context = self.max_sequence_length
        if context is not None and self.default_max_tokens >= context:
            raise ValueError(
                f"DEFAULT_MAX_TOKENS ({self.default_max_tokens}) must be below "
                f"MAX_SEQUENCE_LENGTH ({self.max_sequence_length})"
            )
        return self

    @property
    def kv_bits(self) -> int | None:
        """KV_CACHE_BITS as a number; None for the model's float type."""
        return None if self.kv_cache_bits == "none" else int(self.kv_cache_bits)

    @property
    def prefix_disk(self) -> tuple[Path, int]:
        """Where each rank keeps its part of the prefix cache on disk, and how many bytes."""
        directory = self.prefix_cache_dir or self.model_cache_dir / "prefix-cache"
        size = 8 * 2**30 if self.prefix_cache_disk_bytes is None else self.prefix_cache_disk_bytes
        return directory.expanduser(), size

    @property
    def remote_mode(self) -> bool:
        return bool(self.worker_hosts)

    @property
    def remote_dirs(self) -> list[str]:
        """The project directory of each worker, in WORKER_HOSTS order."""
        count = len(self.worker_hosts)
        dirs = self.remote_dir
        return dirs * count if len(dirs) == 1 else dirs[:count]  # count checked above

    def as_env(self) -> dict[str, str]:
        """KEY=value strings as .env writes them (the inverse of parsing)."""
        return {key.upper(): _env_text(value) for key, value in self.model_dump().items()}


def _env_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(f"{item:g}" if isinstance(item, float) else str(item) for item in value)
    return str(value)


def _describe(error: Any) -> str:
    field = str(error["loc"][0]) if error["loc"] else "settings"
    name = field.upper()
    given = error.get("input")
    allowed = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "literal_error":
        allowed = "one of " + error["ctx"]["expected"]
    if not error["loc"]:
        return f"invalid settings: {allowed}"
    return f"invalid setting {name}={given!r}: {allowed}"


def load_settings(**overrides: Any) -> Settings:
    """Read the settings; SettingsError with one line per bad variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError([f"error: {_describe(error)}" for error in exc.errors()]) from None


def run_with_settings(body: Callable[[Settings], int], *expected: type[Exception]) -> int:
    """An entry point's body, given the settings. Bad settings print one `error:` line per
    variable and give exit status 2; so does an `expected` error (its message, one line)."""
    try:
        return body(load_settings())
    except SettingsError as exc:
        print(exc, file=sys.stderr)
    except expected as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 2
