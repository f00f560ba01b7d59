"""Rank 0's index of the prefix cache's entries on disk (engine/prefix_disk.py): which token
sequences every rank has saved, the longest one a prompt starts with, and the least
recently used ones to drop past PREFIX_CACHE_DISK_BYTES.

Kept in rank 0's directory as `index.json` (token lists and last use), rewritten after
each change (a temporary file renamed into place), and read at start: after a restart the
conversations saved before it are found again. A key whose file is missing on rank 0 is
left out when read; a file missing on another rank fails that load, and the ranks compute.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("ring.prefix")


@dataclass
class DiskEntry:
    tokens: list[int]
    used: float  # time.time() of the last save or load


class DiskIndex:
    """Entries on disk by key; `budget_tokens` bounds their tokens (the largest rank's KV
    bytes per token into PREFIX_CACHE_DISK_BYTES)."""

    def __init__(self, directory: Path, budget_tokens: int) -> None:
        self.manifest = directory / "index.json"
        self.budget_tokens = budget_tokens
        self.entries: dict[int, DiskEntry] = {}
        self.loading: set[int] = set()  # keys a plan loads now
        self.loads = 0  # entries read back (after eviction or a restart)
        self.load_failures = 0
        self._read(directory)

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries.values())

    def _read(self, directory: Path) -> None:
        try:
            saved = json.loads(self.manifest.read_text())
            for key, item in saved.items():
                if (directory / f"{int(key, 16):016x}.safetensors").exists():
                    self.entries[int(key, 16)] = DiskEntry(list(item["tokens"]), item["used"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "prefix cache on disk: %s is unreadable (%s); starting empty", self.manifest, exc
            )
            self.entries.clear()
        if self.entries:
            log.info(
                "prefix cache on disk: %d entries, %d tokens from %s",
                len(self.entries),
                self.tokens,
                self.manifest.parent,
            )

    def _write(self) -> None:
        data = {f"{k:016x}": {"tokens": e.tokens, "used": e.used} for k, e in self.entries.items()}
        partial = self.manifest.with_suffix(".partial")
        try:
            partial.write_text(json.dumps(data))
            os.replace(partial, self.manifest)
        except OSError as exc:
            log.warning("prefix cache on disk: cannot write %s (%s)", self.manifest, exc)

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(key, tokens) of the entry sharing the longest start with `prompt`; (0, 0): none."""
        best, best_length = 0, 0
        wanted = np.array(prompt, dtype=np.int64)
        for key, entry in self.entries.items():
            if key in self.loading:
                continue
            n = min(len(entry.tokens), len(wanted))
            differ = np.flatnonzero(np.array(entry.tokens[:n], dtype=np.int64) != wanted[:n])
            length = int(differ[0]) if differ.size else n
            if length > best_length:
                best, best_length = key, length
        return best, best_length

    def record(self, key: int, tokens: list[int], protected: set[int]) -> list[int]:
        """A new entry every rank saves; the keys to drop (least recently used first) to stay
        within the budget. An entry longer than the whole budget is not recorded."""
        if len(tokens) > self.budget_tokens:
            return []
        self.entries[key] = DiskEntry(list(tokens), time.time())
        drops = []
        for old in sorted(self.entries, key=lambda k: self.entries[k].used):
            if self.tokens <= self.budget_tokens:
                break
            if old != key and old not in protected and old not in self.loading:
                del self.entries[old]
                drops.append(old)
        self._write()
        return drops

    def loaded(self, key: int, ok: bool) -> None:
        self.loading.discard(key)
        if ok:
            self.loads += 1
            if key in self.entries:
                self.entries[key].used = time.time()
        else:
            self.load_failures += 1
            self.entries.pop(key, None)
        self._write()
