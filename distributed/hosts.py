"""The machines under the ranks: host name, cores and memory of every rank, gathered once.

The planner reads them (RANK_WEIGHTS=auto weighs ranks by memory; local ranks that
outnumber a host's cores run pipeline parallel), so every rank must see the same list:
each rank describes itself and one all_gather gives everyone the whole list.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import mlx.core as mx
import numpy as np
from pydantic import BaseModel

_RECORD_BYTES = 256  # one rank's JSON description, zero padded


class RankHost(BaseModel):
    """The machine a rank runs on."""

    host: str
    cores: int
    memory_bytes: int


def local_memory_bytes() -> int:
    """This machine's memory: the accelerator's working set where MLX reports it, else RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def largest_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache this machine reports (its last level, in bytes; Linux's sysfs),
    0 where it reports none."""
    sizes = [0]
    for path in caches.glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system tells, as under
    `taskset`), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def this_host() -> RankHost:
    return RankHost(
        host=socket.gethostname()[:64],
        cores=usable_cores(),
        memory_bytes=local_memory_bytes(),
    )


def gather_hosts(group: mx.distributed.Group) -> list[RankHost]:
    """Every rank's RankHost in rank order (a collective: all ranks must call it)."""
    mine = this_host()
    if group.size() == 1:
        return [mine]
    record = np.zeros(_RECORD_BYTES, dtype=np.uint8)
    encoded = mine.model_dump_json().encode()[:_RECORD_BYTES]
    record[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    gathered = mx.distributed.all_gather(mx.array(record), group=group)
    rows = np.array(gathered).reshape(group.size(), _RECORD_BYTES)
    return [RankHost.model_validate(json.loads(row.tobytes().rstrip(b"\0"))) for row in rows]


def crowded_host(hosts: list[RankHost]) -> tuple[str, int, int] | None:
    """(host, ranks on it, its cores) for a host whose ranks outnumber its cores, else None."""
    for name in dict.fromkeys(host.host for host in hosts):
        on_host = [host for host in hosts if host.host == name]
        if len(on_host) > on_host[0].cores:
            return name, len(on_host), on_host[0].cores
    return None
