"""Each rank's part of the prefix cache on its local disk (PREFIX_CACHE_DIR), so a conversation
survives memory's eviction and a restart.

Rank 0 decides everything (leader/prefix_disk_index.py) and the step plan carries it: save
memory entry E as disk key K, load K into memory entry E, drop K. Every rank does the same
with its own part (its heads or layers), in its own directory:
`PREFIX_CACHE_DIR/<model, split and KV bits digest>/rank-<r>/<key>.safetensors`, so a
changed model, split or KV_CACHE_BITS never reads another's entries.

- A save copies the entry's arrays to host memory at once and writes them on a thread
  behind the answer (a temporary file renamed into place), with a CRC-32 of each array in
  the file's metadata.
- A load reads the file, checks the key, the length, the layer count and every CRC, and
  puts the first positions the plan asks for in memory. The ranks then vote (one all_sum
  over the plan's loads): a load that failed on any rank (missing, corrupt, another
  layout) is dropped on every rank and rank 0 prefills those tokens instead. Nothing is
  ever served from a wrong entry.
- A disk that is read-only or full is said once in the log; saves stop, serving goes on.
- A clean stop finishes the saves still queued (a bounded wait, `close`): a turn answered
  just before `./launch.sh restart` is on every rank's disk after it. A save cut off
  (killed) leaves only a temporary file, which the next start removes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from safetensors import safe_open
from safetensors.numpy import save_file

log = logging.getLogger("ring.prefix")
FORMAT = 2  # bump when the file layout changes: older directories are never read
# 2: entries saved before engine/forward_order.py may hold a split's wrongly summed KV
STALE_DAYS = 7  # directories of other models or splits unused this long are removed
CLOSE_SECONDS = 8.0  # a stop's wait for queued saves: the supervisor signals the ranks 10 s
# after its shutdown message (a 12K-token turn of a 70B model is about a GB per rank: seconds)
LayerKV = tuple[Any, Any]  # as engine/prefix_store.py keeps them
_Write = tuple[int, dict[str, np.ndarray], dict[str, str]]  # key, host arrays, metadata


def token_key(tokens: Sequence[int]) -> int:
    """The 64-bit disk key of a cached token sequence."""
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def layout_digest(*parts: object) -> str:
    """A directory name for what decides the entries' layout (model, split, KV bits)."""
    text = json.dumps([FORMAT, *parts], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def _flat(layers: list[LayerKV]) -> dict[str, mx.array]:
    out = {}
    for index, (keys, values) in enumerate(layers):
        for name, part in (("k", keys), ("v", values)):
            parts = part if isinstance(part, tuple | list) else (part,)
            for j, array in enumerate(parts):
                out[f"{index}.{name}.{j}"] = array
    return out


def _to_host(array: mx.array) -> tuple[np.ndarray, str]:
    """numpy has no bfloat16: such arrays travel as their bits."""
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16)), "bfloat16"
    return np.array(array), ""


def _crc(array: np.ndarray) -> str:
    return f"{zlib.crc32(np.ascontiguousarray(array).tobytes()):08x}"


class DiskTier:
    """This rank's directory of entries, its writer thread and the ranks' vote."""

    def __init__(self, directory: Path, vote: Callable[[list[int]], list[int]]) -> None:
        self.directory = directory
        self._vote = vote  # all_sum of per-load failures over the ranks
        self._writes: queue.Queue[_Write | None] = queue.Queue()  # None: stop
        self.broken: str | None = None  # why saves stopped
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    @classmethod
    def open(
        cls, root: Path, layout: str, rank: int, vote: Callable[[list[int]], list[int]]
    ) -> DiskTier:
        """The tier in `root/layout/rank-<rank>`; an unwritable directory is logged and
        leaves saves off (loads then fail and the ranks compute)."""
        directory = root / layout / f"rank-{rank}"
        tier = cls(directory, vote)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
            for partial in directory.glob("*.partial"):  # a save cut off by a kill
                partial.unlink()
            os.utime(root / layout)  # in use: not stale for the other layouts' ranks
            _remove_stale(root, layout)
        except OSError as exc:
            tier.broken = f"{directory} is not writable ({exc.strerror or exc})"
            log.warning("prefix cache on disk: off on this rank: %s", tier.broken)
        return tier

    def path(self, key: int) -> Path:
        return self.directory / f"{key:016x}.safetensors"

    # ---- saves (behind the answer) -------------------------------------------------

    def save(self, key: int, layers: list[LayerKV], length: int) -> None:
        if self.broken or self.path(key).exists():
            return
        arrays, meta = {}, {"key": f"{key:016x}", "length": str(length), "layers": str(len(layers))}
        for name, array in _flat(layers).items():
            host, kind = _to_host(array)  # the copy here; checksums and the write behind
            arrays[name] = host
            if kind:
                meta[f"dtype.{name}"] = kind
        self._writes.put((key, arrays, meta))

    def _write_loop(self) -> None:
        while True:
            write = self._writes.get()
            if write is None:  # close(): every write before it is done
                self._writes.task_done()
                return
            key, arrays, meta = write
            target = self.path(key)
            partial = target.with_suffix(".partial")
            try:
                meta |= {f"crc.{name}": _crc(host) for name, host in arrays.items()}
                save_file(arrays, str(partial), metadata=meta)
                os.replace(partial, target)
            except OSError as exc:
                partial.unlink(missing_ok=True)
                if self.broken is None:
                    self.broken = f"cannot write {target.name} ({exc.strerror or exc})"
                    log.warning("prefix cache on disk: saves stop on this rank: %s", self.broken)
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait for the writes queued so far (tests)."""
        self._writes.join()

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Finish the writes queued so far, waiting at most `timeout` seconds (a clean
        stop); no save is taken after it. The writer is a daemon thread: without this a
        stop cut the last turn's save on whichever rank left first."""
        pending = self._writes.unfinished_tasks
        if pending:
            log.info("prefix cache on disk: finishing %d queued save(s) before stopping", pending)
        self.broken = self.broken or "stopped"
        self._writes.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            log.warning(
                "prefix cache on disk: saves still queued after %.0f s; stopping without them",
                timeout,
            )

    # ---- loads (every rank together) -----------------------------------------------

    def load_all(self, loads: list[tuple[int, int]]) -> list[list[LayerKV] | None]:
        """Each (key, length)'s layers, or None on every rank where any rank failed it. No
        loads, no vote: every rank runs the same plan, so all skip it alike (it had been an
        all_sum and a wait for the slowest rank in every step: a fifth to a quarter of a
        2-rank expert split's decode samples under py-spy)."""
        if not loads:
            return []
        mine = [self._load(key, length) for key, length in loads]
        failed = self._vote([1 if layers is None else 0 for layers in mine])
        return [layers if not bad else None for layers, bad in zip(mine, failed, strict=True)]

    def _load(self, key: int, length: int) -> list[LayerKV] | None:
        path = self.path(key)
        try:
            with safe_open(str(path), framework="numpy") as handle:
                meta = handle.metadata() or {}
                held = int(meta.get("length", "0"))
                if meta.get("key") != f"{key:016x}" or held < length:
                    raise ValueError(f"it holds {meta.get('key')} of {held} tokens")
                arrays = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
            for name, host in arrays.items():
                if meta.get(f"crc.{name}") != _crc(host):
                    raise ValueError(f"{name} fails its checksum")
            return [tree_map(lambda x: x[..., :length, :], pair) for pair in _layers(arrays, meta)]
        except FileNotFoundError:
            log.info("prefix cache on disk: %s is not on this rank; computing", path.name)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            log.warning("prefix cache on disk: %s is unusable (%s); computing", path.name, exc)
            path.unlink(missing_ok=True)
        return None

    def drop(self, key: int) -> None:
        self.path(key).unlink(missing_ok=True)


def _layers(arrays: dict[str, np.ndarray], meta: dict[str, str]) -> list[LayerKV]:
    count = int(meta["layers"])
    out: list[LayerKV] = []
    for index in range(count):
        pair = []
        for name in ("k", "v"):
            parts = []
            for j in range(3):
                full = f"{index}.{name}.{j}"
                if full not in arrays:
                    break
                array = mx.array(arrays[full])
                if meta.get(f"dtype.{full}") == "bfloat16":
                    array = array.view(mx.bfloat16)
                parts.append(array)
            if not parts:
                raise ValueError(f"layer {index} has no {name}")
            pair.append(parts[0] if len(parts) == 1 else tuple(parts))
        out.append((pair[0], pair[1]))
    if len(arrays) != sum(len(p) if isinstance(p, tuple) else 1 for kv in out for p in kv):
        raise ValueError("it holds arrays of another layout")
    return out


def _remove_stale(root: Path, layout: str) -> None:
    """Remove sibling layout directories unused for STALE_DAYS (other models or splits)."""
    cutoff = time.time() - STALE_DAYS * 86400
    for other in root.iterdir():
        if other.name != layout and other.is_dir() and other.stat().st_mtime < cutoff:
            shutil.rmtree(other, ignore_errors=True)
