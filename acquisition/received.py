"""A worker's store of what the first host sent it, under MODEL_CACHE_DIR/received/.

    received/<model key>/full.json          a full copy this host holds: {"path": ...}
    received/<model key>/full/              a full copy received (MODEL_TRANSFER=full)
    received/<model key>/<share key>/       one rank's share (distributed/rank_share.py):
        share.json                          the receiver's record, written once complete:
                                            every file's size and its blocks' SHA-256
        <file>.part, <file>.part.blocks     a file still arriving, and its verified blocks

The model key names the model (acquisition/identity.py), the share key its split for one
rank (distributed/rank_share.share_key). The supervisor tells the worker's rank which model
to look for in MLX_RING_RECEIVED_MODEL (not a setting: only the supervisor sets it, for
remote ranks; rank 0 always resolves MODEL itself). Standard library only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECEIVED_ENV = "MLX_RING_RECEIVED_MODEL"
RECORD = "share.json"
FULL_POINTER = "full.json"
FULL_DIR = "full"


class NotReceived(RuntimeError):
    """The model this rank must load is not in its store; the message says what is there."""


def store(cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser().resolve() / "received"


def model_dir(cache_dir: Path, model_key: str) -> Path:
    return store(cache_dir) / model_key


def write_json(path: Path, value: Any) -> None:
    """Write atomically (a temporary file renamed over the old one) and durably."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as out:
        json.dump(value, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def full_copy(cache_dir: Path, model_key: str) -> Path | None:
    """The full copy this host holds of the model, as the receiver recorded it."""
    pointer = model_dir(cache_dir, model_key) / FULL_POINTER
    try:
        path = Path(json.loads(pointer.read_text())["path"])
    except (OSError, ValueError, KeyError):
        return None
    return path if (path / "config.json").is_file() else None


def complete_share(cache_dir: Path, model_key: str, share_key: str) -> Path | None:
    """The share's directory once it arrived whole (its record written), else None."""
    directory = model_dir(cache_dir, model_key) / share_key
    return directory if (directory / RECORD).is_file() else None


@dataclass(frozen=True)
class Received:
    """Where a worker's rank finds the model the supervisor named."""

    cache_dir: Path
    model_key: str

    @classmethod
    def from_env(cls, cache_dir: Path, environ: dict[str, str] | None = None) -> Received | None:
        key = (os.environ if environ is None else environ).get(RECEIVED_ENV, "").strip()
        return cls(Path(cache_dir), key) if key else None

    @property
    def directory(self) -> Path:
        return model_dir(self.cache_dir, self.model_key)

    def full_copy(self) -> Path | None:
        return full_copy(self.cache_dir, self.model_key)

    def config_dir(self) -> Path:
        """A directory holding this model's config.json: the full copy, else any share."""
        full = self.full_copy()
        if full is not None:
            return full
        for share in sorted(self.directory.glob(f"*/{RECORD}")):
            return share.parent
        raise NotReceived(self.describe())

    def share(self, share_key: str) -> Path:
        found = complete_share(self.cache_dir, self.model_key, share_key)
        if found is None:
            raise NotReceived(self.describe(share_key))
        return found

    def describe(self, share_key: str = "") -> str:
        held = sorted(p.parent.name for p in self.directory.glob(f"*/{RECORD}"))
        wanted = f"share {share_key} of " if share_key else ""
        return (
            f"this host holds no {wanted}model {self.model_key} in {self.directory} (complete "
            f"shares there: {', '.join(held) or 'none'}); the supervisor sends it before the "
            "ranks start: ./launch.sh restart"
        )
