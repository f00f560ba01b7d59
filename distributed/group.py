"""Initialise the MLX distributed group and describe this rank (host, rank, world size)."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx


# MLX's ring backend gives a rank about 31 s to reach its neighbour (measured: `[ring]
# Couldn't connect (error: 111)` after 31.2 s with no listener), then raises.
JOIN_FAILED = "could not join the group"


class GroupJoinError(RuntimeError):
    """The distributed backend gave up reaching a peer before the group formed."""


@dataclass(frozen=True)
class RankIdentity:
    """Who this process is inside the job."""

    rank: int
    world_size: int
    host: str
    backend: str

    @property
    def role(self) -> str:
        """Short log role, e.g. `r0`."""
        return f"r{self.rank}"

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_group(backend: str) -> tuple[mx.distributed.Group, RankIdentity]:
    """Join the job's group with DISTRIBUTED_BACKEND (`any` lets MLX choose).

    A single process started without mlx.launch gets a group of size 1. Raises
    GroupJoinError when the backend could not reach a peer.
    """
    import mlx.core as mx  # here: the supervisor reads JOIN_FAILED without loading MLX

    hostfile = os.environ.get("MLX_HOSTFILE", "")
    if hostfile and os.path.isfile(hostfile) and not Path(hostfile).read_text().strip():
        # `mlx.launch -n 1` writes an empty hostfile, which the ring backend cannot parse.
        del os.environ["MLX_HOSTFILE"]
    try:
        group = mx.distributed.init(strict=False, backend=backend)
    except RuntimeError as exc:
        rank = os.environ.get("MLX_RANK", "?")
        raise GroupJoinError(
            f"rank {rank} {JOIN_FAILED} ({backend}): {exc}; a peer rank was not listening yet"
            " (still starting, or its host unreachable)"
        ) from None
    identity = RankIdentity(
        rank=group.rank(),
        world_size=group.size(),
        host=socket.gethostname(),
        backend=backend if group.size() > 1 else "single",
    )
    return group, identity


def leader_address() -> str:
    """Rank 0's IP as the other ranks reach it, from the launcher's environment.

    ring: the first address of rank 0 in MLX_HOSTFILE; jaccl: MLX_JACCL_COORDINATOR;
    otherwise 127.0.0.1 (all ranks on one host).
    """
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    if hostfile and os.path.isfile(hostfile):
        try:
            with open(hostfile) as handle:
                hosts = json.load(handle)
            first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
            return str(first).rsplit(":", 1)[0]
        except (ValueError, IndexError, KeyError, TypeError):
            pass
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR", "")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return "127.0.0.1"
