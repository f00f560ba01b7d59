"""Whether the API can serve now, and how it says so: one table from the cluster's state to
the HTTP status, Retry-After and /health reason every route uses.

The state is rank 0's own (ipc.protocol.RankState) while the API is connected to it;
otherwise what the connection says: `down` (no connection), `connecting` (no status yet),
or `stale` (connected, but no status answer for a while).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ipc.protocol import RankState

ClusterState = Literal["ready", "loading", "stopping", "failed", "down", "connecting", "stale"]


@dataclass(frozen=True)
class Availability:
    """What the API answers in one cluster state."""

    state: ClusterState
    reason: str
    http_status: int  # /health (and /health/ready)
    retry_after: int | None  # seconds, on 503 answers
    takes_requests: bool  # whether a new generation request is sent to rank 0


# state -> (/health status, Retry-After, whether new requests go to rank 0)
TABLE: dict[ClusterState, tuple[int, int | None, bool]] = {
    "ready": (200, None, True),
    "loading": (503, 5, False),
    "stopping": (503, 5, False),
    "failed": (503, 30, False),
    "down": (503, 2, False),
    "connecting": (503, 1, False),
    # rank 0 answers requests on the same connection: send them, but /health warns
    "stale": (503, 2, True),
}


def availability(state: ClusterState, reason: str) -> Availability:
    http_status, retry_after, takes_requests = TABLE[state]
    return Availability(state, reason, http_status, retry_after, takes_requests)


def from_rank_state(state: RankState, reason: str) -> Availability:
    return availability(state.value, reason)
