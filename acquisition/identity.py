"""What identifies a resolved model directory across hosts, from its files' names, sizes and
safetensors headers (never by hashing its weights: that would read the whole model at every
start).

Where the directory says what it is, its place does: a Hugging Face snapshot's path holds
the commit (hub/models--owner--name/snapshots/<commit>), a GGUF import's the GGUF's SHA-256
and the import variant (gguf/<name>-<sha>-<variant>-v<format>); both are named relative to
MODEL_CACHE_DIR, so a worker that downloaded or imported the same model into its own cache
holds the same thing. Any other directory is named by its absolute path, and its files'
modification times join the key: a model rewritten in place gets a new key (its shares are
sent again) even where its shapes stayed the same.

The key names the model in every worker's store (acquisition/received.py). Standard
library only: the receiver on a worker uses it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Weight formats that never travel as "small files" beside a share.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".ckpt")
# The largest non-weight file sent with a share (tokenizer.json of a 256k vocabulary is
# about 30 MB); larger ones are left out and named in the log.
SMALL_FILE_LIMIT = 64 << 20
CACHE_PARTS = ("hub", "gguf")  # MODEL_CACHE_DIR's content-addressed places


@dataclass(frozen=True)
class WeightFile:
    """One checkpoint file as a worker can compare it: name, size, header digest."""

    name: str
    size: int
    header: str  # sha256 of the safetensors header (names, dtypes, shapes, offsets)


@dataclass(frozen=True)
class ModelIdentity:
    """A model directory as every host can recognize it."""

    locator: str  # relative to MODEL_CACHE_DIR (hub/..., gguf/...) or an absolute path
    weights: list[WeightFile]
    key: str
    small_files: list[str] = field(default_factory=list)  # config, tokenizer, ...

    def offer(self) -> dict[str, Any]:
        """What a worker needs to look for a full copy of its own."""
        return {
            "locator": self.locator,
            "weights": [w.__dict__ for w in self.weights],
        }


def header_digest(path: Path) -> str:
    """SHA-256 of a safetensors file's length prefix and JSON header."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return ""
        (length,) = struct.unpack("<Q", prefix)
        if length > 1 << 30:
            return ""
        return hashlib.sha256(prefix + handle.read(length)).hexdigest()


def weight_files(directory: Path) -> list[WeightFile]:
    """The checkpoint files mlx-lm loads (model*.safetensors), as a worker compares them."""
    return [
        WeightFile(path.name, path.stat().st_size, header_digest(path))
        for path in sorted(Path(directory).glob("model*.safetensors"))
    ]


def small_files(directory: Path) -> tuple[list[str], list[str]]:
    """(sent, left out): the directory's top-level files other than weights (config,
    tokenizer, templates, generation config, custom code), the index of the original
    checkpoint files excepted; those over SMALL_FILE_LIMIT are left out."""
    sent: list[str] = []
    left: list[str] = []
    for path in sorted(Path(directory).iterdir()):
        name = path.name
        if name.startswith(".") or not path.is_file():
            continue
        if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".safetensors.index.json"):
            continue
        (sent if path.stat().st_size <= SMALL_FILE_LIMIT else left).append(name)
    return sent, left


def locator(model_dir: Path, cache_dir: Path) -> str:
    """Where the model is, as every host would name it (see the module docs)."""
    model_dir = Path(model_dir).resolve()
    cache = Path(cache_dir).expanduser().resolve()
    try:
        relative = model_dir.relative_to(cache)
    except ValueError:
        return str(model_dir)
    return (
        relative.as_posix()
        if relative.parts[:1] and relative.parts[0] in CACHE_PARTS
        else str(model_dir)
    )


def identify(model_dir: Path, cache_dir: Path) -> ModelIdentity:
    """The identity of a resolved model directory (reads its headers only)."""
    model_dir = Path(model_dir).resolve()
    where = locator(model_dir, cache_dir)
    weights = weight_files(model_dir)
    sent, _ = small_files(model_dir)
    parts: list[Any] = [where, [w.__dict__ for w in weights], sent]
    if where.startswith("/"):  # not content-addressed by its place: its files' times count
        parts.append([(model_dir / name).stat().st_mtime_ns for name in sent])
        parts.append([(model_dir / w.name).stat().st_mtime_ns for w in weights])
    parts.append(_digest(model_dir / "config.json"))
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]
    return ModelIdentity(where, weights, key, sent)


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def find_full_copy(offer: dict[str, Any], cache_dir: Path) -> Path | None:
    """This host's own full copy of the offered model (same place, same weight files,
    sizes and headers, and a config.json), or None."""
    where = str(offer["locator"])
    candidate = Path(where) if where.startswith("/") else Path(cache_dir) / where
    if not (candidate / "config.json").is_file():
        return None
    wanted = [WeightFile(**w) for w in offer["weights"]]
    try:
        have = weight_files(candidate)
    except OSError:
        return None
    return candidate if wanted and have == wanted else None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize
