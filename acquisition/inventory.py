"""What a worker already holds of an offered share, checked block by block before anything
is sent, and whether the rest fits its disk (acquisition/receive.py runs it at every start;
`./launch.sh plan` asks for it without changing anything).

Every block a complete share's record lists, and every block a partial file's journal
lists, is read back and hashed: a block whose bytes no longer match (a flipped bit, a
truncated file, a file rewritten by hand) is needed again, and only that block is sent.
The hashing runs on every core: SHA-256 reads at about 1.8 GB/s per core on the
development machine's EPYC. A worker short of disk first gives up the shares it holds for
other models or splits (least recently used first); if that is not enough the offer is
refused with both numbers. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acquisition import received
from acquisition.identity import find_full_copy, free_bytes
from acquisition.wire import block_length, blocks_of, to_ranges

# Left free on a worker's disk after its share: macOS stalls (swap, updates, logs) when a
# disk fills up, and a rank writes its prefix cache beside the share.
DISK_RESERVE = 1 << 30
JOURNAL = ".blocks"


@dataclass
class FileState:
    """One offered file on this host: which blocks are already here and good."""

    name: str
    size: int
    block_size: int
    good: dict[int, str] = field(default_factory=dict)  # block -> sha256 of its bytes

    @property
    def blocks(self) -> int:
        return blocks_of(self.size, self.block_size)

    def missing(self) -> list[int]:
        return [i for i in range(self.blocks) if i not in self.good]

    def missing_bytes(self) -> int:
        return sum(block_length(self.size, i, self.block_size) for i in self.missing())


@dataclass
class Inventory:
    """The receiver's answer to an offer."""

    have: str  # "full": a full copy is here; "share": the whole share; else "partial"/"none"
    directory: Path
    files: list[FileState]
    verified_s: float = 0.0
    damaged: list[str] = field(default_factory=list)  # "file#block" found bad
    free: int = 0
    evicted: list[str] = field(default_factory=list)
    refused: str = ""

    @property
    def need_bytes(self) -> int:
        return sum(f.missing_bytes() for f in self.files)

    @property
    def have_bytes(self) -> int:
        return sum(f.size for f in self.files) - self.need_bytes

    def message(self) -> dict[str, Any]:
        return {
            "event": "inventory",
            "have": self.have,
            "directory": str(self.directory),
            "need": [[i, to_ranges(f.missing())] for i, f in enumerate(self.files) if f.missing()],
            "need_bytes": self.need_bytes,
            "have_bytes": self.have_bytes,
            "damaged": self.damaged[:20],
            "verified_s": round(self.verified_s, 3),
            "free_bytes": self.free,
            "evicted": self.evicted,
            "refused": self.refused,
        }


def _hash_block(path: Path, index: int, size: int, block: int) -> str:
    length = block_length(size, index, block)
    with open(path, "rb") as handle:
        data = os.pread(handle.fileno(), length, index * block)
    return hashlib.sha256(data).hexdigest() if len(data) == length else ""


def verify(
    path: Path, state: FileState, claimed: dict[int, str], pool: ThreadPoolExecutor
) -> list[int]:
    """Keep in `state.good` the claimed blocks whose bytes in `path` still hash to their
    digest; return the others."""
    if not path.is_file() or path.stat().st_size != state.size:
        return sorted(claimed)
    indices = sorted(i for i in claimed if i < state.blocks)
    digests = pool.map(lambda i: _hash_block(path, i, state.size, state.block_size), indices)
    bad = []
    for index, digest in zip(indices, digests, strict=True):
        if digest and digest == claimed[index]:
            state.good[index] = digest
        else:
            bad.append(index)
    return bad


def read_journal(path: Path) -> dict[int, str]:
    """A partial file's verified blocks (a torn last line is ignored)."""
    found: dict[int, str] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 64:
            found[int(parts[0])] = parts[1]
    return found


def write_journal(path: Path, good: dict[int, str]) -> None:
    path.write_text("".join(f"{i} {d}\n" for i, d in sorted(good.items())))


def inventory(offer: dict[str, Any], cache_dir: Path, change: bool = True) -> Inventory:
    """What of `offer` this host holds (see the module docs); `change`: record a full copy
    found, turn damaged complete files back into partial ones and make room on the disk
    (the receiver), or only look (`./launch.sh plan`)."""
    model = received.model_dir(cache_dir, offer["model_key"])
    full = _full_copy(offer, cache_dir, model, change)
    if full is not None:
        return Inventory("full", full, [], free=free_bytes(full))
    target = model / offer["share_key"]
    block = int(offer["block_size"])
    files = [FileState(f["name"], int(f["size"]), block_size=block) for f in offer["files"]]
    record = _record(target)
    started = time.monotonic()
    damaged: list[str] = []
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for state in files:
            damaged += [
                f"{state.name}#{i}" for i in _check_file(target, state, record, pool, change)
            ]
    whole = all(not f.missing() for f in files)
    if damaged and change:
        (target / received.RECORD).unlink(missing_ok=True)  # no longer complete
    have = "share" if whole and record else "partial" if any(f.good for f in files) else "none"
    found = Inventory(have, target, files, time.monotonic() - started, damaged)
    if have == "share" and change:
        os.utime(target)  # in use: the last to be given up for room
    _check_room(found, cache_dir, offer, change)
    return found


def _record(target: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((target / received.RECORD).read_text())["files"])
    except (OSError, ValueError, KeyError):
        return {}


def _check_file(
    target: Path,
    state: FileState,
    record: dict[str, Any],
    pool: ThreadPoolExecutor,
    change: bool,
) -> list[int]:
    """Verify what is here of one file (complete per the record, else per its journal);
    returns the damaged blocks. With `change`, a file missing blocks is kept as NAME.part
    with a journal of its good ones, and a whole one as NAME (a finish cut short by a stop
    is completed here)."""
    final, part = target / state.name, target / f"{state.name}.part"
    journal = target / f"{state.name}.part{JOURNAL}"
    done = record.get(state.name)
    if done is not None and done.get("size") == state.size:
        claimed = dict(enumerate(done["blocks"]))
    else:
        claimed = read_journal(journal)
    path = final if final.is_file() else part
    bad = verify(path, state, claimed, pool) if claimed else []
    if change and path.is_file():
        if state.missing() and path == final:
            os.replace(final, part)
            write_journal(journal, state.good)
        elif state.missing() and bad:
            write_journal(journal, state.good)
        elif not state.missing() and path == part:
            os.replace(part, final)
    return bad


def _full_copy(offer: dict[str, Any], cache_dir: Path, model: Path, change: bool) -> Path | None:
    """A full copy of the offered model on this host (MODEL_TRANSFER=share: any copy;
    a received one only once it is whole), recorded for the rank in full.json."""
    pointed = received.full_copy(cache_dir, offer["model_key"])
    if pointed is not None and pointed != model / received.FULL_DIR:
        return pointed
    if offer["share_key"] == received.FULL_DIR:
        return None  # a full copy is what is offered: its files are checked as a share's
    if pointed is not None and (pointed / received.RECORD).is_file():
        return pointed
    found = find_full_copy(offer["full_copy"], cache_dir)
    if found is not None and change:
        model.mkdir(parents=True, exist_ok=True)
        received.write_json(model / received.FULL_POINTER, {"path": str(found)})
    return found


def _others(cache_dir: Path, keep: Path) -> list[Path]:
    """Received shares and copies other than `keep`, least recently used first."""
    found = [
        path
        for path in received.store(cache_dir).glob("*/*")
        if path.is_dir() and path.resolve() != keep.resolve()
    ]
    return sorted(found, key=lambda path: path.stat().st_mtime)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_room(found: Inventory, cache_dir: Path, offer: dict[str, Any], change: bool) -> None:
    need = found.need_bytes
    found.free = free_bytes(found.directory)
    if not need or found.free >= need + DISK_RESERVE:
        return
    for other in _others(cache_dir, found.directory):
        if not change or found.free >= need + DISK_RESERVE:
            break
        size = _size(other)
        shutil.rmtree(other, ignore_errors=True)
        pointer = other.parent / received.FULL_POINTER
        if other.name == received.FULL_DIR:
            pointer.unlink(missing_ok=True)
        found.evicted.append(f"{other.parent.name}/{other.name} ({size / 2**20:.1f} MiB)")
        found.free = free_bytes(found.directory)
    if found.free < need + DISK_RESERVE:
        found.refused = (
            f"{Path(cache_dir).expanduser()} has {_human(found.free)} free; the share needs "
            f"{_human(need)} more and {_human(DISK_RESERVE)} stays free: free "
            f"{_human(need + DISK_RESERVE - found.free)} there, or point MODEL_CACHE_DIR at a "
            "larger disk"
        )


def _human(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / 2**30:.2f} GiB"
    return f"{count / 2**20:.1f} MiB"
