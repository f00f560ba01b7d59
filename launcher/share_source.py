"""The bytes the first host sends one worker: its share's files (distributed/rank_share.py)
or, with MODEL_TRANSFER=full, the model's own files, each readable block by block.

A share's tensor file is produced as it is sent: its safetensors header is known from the
lazy parameters' shapes and dtypes alone, and each parameter is evaluated (the loader's own
slice of its source tensor) only when a block that holds its bytes is read, then released
once the blocks have moved past it. Blocks are read in order, so the first host holds one
parameter (and, while it is sliced, its source tensor) at a time per worker, never a copy of
the share on its disk.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from acquisition.identity import ModelIdentity
from distributed.plan import Plan
from distributed.plan_text import describe
from distributed.rank_share import (
    LAYOUT_FILE,
    META_FILE,
    SHARE_FORMAT,
    TENSOR_FILE,
    checkpoint_layout,
    file_groups,
    rank_parameters,
    safetensors_header,
    share_key,
)


class SourceFile:
    """One file of an offer: its name, size and bytes by range."""

    name: str
    size: int

    def read(self, start: int, length: int) -> bytes:
        raise NotImplementedError


@dataclass
class RawFile(SourceFile):
    """A file of the model directory, sent as it is."""

    name: str
    size: int
    path: Path

    def read(self, start: int, length: int) -> bytes:
        with open(self.path, "rb") as handle:
            return os.pread(handle.fileno(), length, start)


@dataclass
class MemoryFile(SourceFile):
    """A small file the sender writes (the layout, the share's meta data)."""

    name: str
    content: bytes

    @property
    def size(self) -> int:  # type: ignore[override]
        return len(self.content)

    def read(self, start: int, length: int) -> bytes:
        return self.content[start : start + length]


class TensorFile(SourceFile):
    """A safetensors file of lazy parameters, evaluated as their bytes are read."""

    def __init__(self, name: str, arrays: list[tuple[str, mx.array]]) -> None:
        self.name = name
        self.header = safetensors_header(arrays)
        self.arrays: list[mx.array | None] = [array for _, array in arrays]
        self.starts: list[int] = []
        offset = len(self.header)
        for _, array in arrays:
            self.starts.append(offset)
            offset += array.nbytes
        self.size = offset
        self.weight_bytes = offset - len(self.header)
        self._held: tuple[int, memoryview] | None = None

    def _bytes(self, index: int) -> memoryview:
        if self._held is not None and self._held[0] == index:
            return self._held[1]
        array = self.arrays[index]
        if array is None:
            raise RuntimeError(f"{self.name}: parameter {index} was read after it was released")
        mx.eval(array)
        view = memoryview(array).cast("B")  # type: ignore[arg-type]  # mx.array is a buffer
        self._held = (index, view)
        return view

    def read(self, start: int, length: int) -> bytes:
        end = start + length
        pieces = []
        if start < len(self.header):
            pieces.append(self.header[start : min(end, len(self.header))])
        for index, first in enumerate(self.starts):
            array = self.arrays[index]
            last = first + (array.nbytes if array is not None else 0)
            if array is None or last <= start or first >= end:
                continue
            view = self._bytes(index)
            pieces.append(bytes(view[max(start, first) - first : min(end, last) - first]))
        self._release_before(end)
        return b"".join(pieces)

    def _release_before(self, offset: int) -> None:
        """Drop the parameters that end at or before `offset` (blocks come in order)."""
        for index, first in enumerate(self.starts):
            array = self.arrays[index]
            if array is not None and first + array.nbytes <= offset:
                self.arrays[index] = None
                if self._held is not None and self._held[0] == index:
                    self._held = None


@dataclass
class Offer:
    """What the first host offers one worker: the files and the key of their directory."""

    share_key: str
    files: list[SourceFile]
    weight_bytes: int  # the parameters' bytes (the rest: headers, config, tokenizer)
    description: str

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _small(model_dir: Path, identity: ModelIdentity) -> list[SourceFile]:
    return [
        RawFile(name, (model_dir / name).stat().st_size, model_dir / name)
        for name in identity.small_files
    ]


def share_offer(model_dir: Path, plan: Plan, rank: int, identity: ModelIdentity) -> Offer:
    """Rank `rank`'s share under `plan` (reads only headers until blocks are read)."""
    model_dir = Path(model_dir)
    key = share_key(identity.key, plan, rank)
    layout = json.dumps(checkpoint_layout(model_dir), separators=(",", ":")).encode()
    meta = {
        "format": SHARE_FORMAT,
        "model_key": identity.key,
        "share_key": key,
        "rank": rank,
        "plan": plan.model_dump(),
    }
    tensors = [
        TensorFile(TENSOR_FILE.format(index=i), group)
        for i, group in enumerate(file_groups(rank_parameters(model_dir, plan, rank)), start=1)
    ]
    files: list[SourceFile] = [
        *_small(model_dir, identity),
        MemoryFile(LAYOUT_FILE, layout),
        MemoryFile(META_FILE, json.dumps(meta).encode()),
        *tensors,
    ]
    line = describe(plan)[1 + rank].split(": ", 1)[-1].strip()  # without "rank r (weight w)"
    return Offer(key, files, sum(t.weight_bytes for t in tensors), line)


def full_offer(model_dir: Path, identity: ModelIdentity) -> Offer:
    """The whole model (MODEL_TRANSFER=full): its weight files and small files as they are."""
    from acquisition.received import FULL_DIR

    model_dir = Path(model_dir)
    weights: list[SourceFile] = [
        RawFile(w.name, w.size, model_dir / w.name) for w in identity.weights
    ]
    files = [*_small(model_dir, identity), *weights]
    total = sum(w.size for w in identity.weights)
    return Offer(FULL_DIR, files, total, "the whole model (MODEL_TRANSFER=full)")
