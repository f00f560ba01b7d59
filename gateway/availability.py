"""Whether the API can serve now, and how it says so: one table from the cluster's state to
the HTTP status, Retry-After and /health reason every route uses.

The state is rank 0's own (ipc.status.RankState) while the API is connected to it;
otherwise what the connection says: `down` (no connection), `connecting` (no status yet),
or `stale` (connected, but no status answer for a while). Under launch.sh's supervisor
(ipc/supervisor_state.py), `supervised` tells that state with what the supervisor does
about it: `restarting` while it starts the ranks again (new requests may wait for them,
RESTART_WAIT_SECONDS), `failed` once it gave up, and the workers a degraded job left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ipc.status import RankState
from ipc.supervisor_state import SupervisorState

ClusterState = Literal[
    "ready",
    "loading",
    "warming",
    "stopping",
    "failed",
    "down",
    "connecting",
    "stale",
    "restarting",
]


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
    "warming": (503, 2, False),  # loaded; the first forwards run (leader/warmup.py)
    "stopping": (503, 5, False),
    "failed": (503, 30, False),
    "down": (503, 2, False),
    "connecting": (503, 1, False),
    # rank 0 answers requests on the same connection: send them, but /health warns
    "stale": (503, 2, True),
    # the supervisor is starting the ranks again: new requests wait (RESTART_WAIT_SECONDS)
    "restarting": (503, 5, False),
}
# While the supervisor runs one of these phases, a state that is not ready is a restart
# under way (it may not have noticed the end of the job yet: a few milliseconds).
_RESTARTING_PHASES = ("starting", "running", "restarting")
_DOWN_STATES = ("loading", "warming", "down", "connecting", "restarting")


def availability(state: ClusterState, reason: str) -> Availability:
    http_status, retry_after, takes_requests = TABLE[state]
    return Availability(state, reason, http_status, retry_after, takes_requests)


def from_rank_state(state: RankState, reason: str) -> Availability:
    return availability(state.value, reason)


def supervised(now: Availability, supervisor: SupervisorState | None) -> Availability:
    """`now` (the ranks as the API sees them) with what the supervisor is doing about it."""
    if supervisor is None:
        return now
    if supervisor.phase == "failed":
        return availability("failed", f"the supervisor {supervisor.summary()}")
    if now.state in _DOWN_STATES and supervisor.phase in _RESTARTING_PHASES:
        if supervisor.phase == "running":  # it has not seen the job end yet
            return availability("restarting", f"{now.reason}; the supervisor restarts them")
        return availability("restarting", f"the supervisor is {supervisor.summary()}")
    note = supervisor.degraded_note()
    if note and now.state == "ready":
        return Availability("ready", f"{now.reason}, {note}", *TABLE["ready"])
    return now


def waits_for_restart(now: Availability) -> bool:
    """Whether a new request should wait for the ranks rather than get 503 at once."""
    return now.state == "restarting"
