"""What a rank holds of the job once it joined the group: who it is, the group, the
collective watchdog, the step-plan broadcaster and (RING_PROFILE_COLLECTIVES=1) the
collective profiler. Both roles' compositions take it (engine/worker.py, leader/serve.py)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from distributed.broadcast import Broadcaster
from distributed.group import RankIdentity
from distributed.profile import CollectiveProfiler
from distributed.watchdog import CollectiveWatchdog


@dataclass(frozen=True)
class RankRuntime:
    ident: RankIdentity
    group: mx.distributed.Group
    watchdog: CollectiveWatchdog
    broadcaster: Broadcaster
    profiler: CollectiveProfiler | None  # every rank installs it, or none does

    @classmethod
    def start(
        cls,
        ident: RankIdentity,
        group: mx.distributed.Group,
        collective_timeout_s: float,
        profile_collectives: bool,
    ) -> RankRuntime:
        watchdog = CollectiveWatchdog(collective_timeout_s)
        # Every rank installs the profiler, so the sync points it adds match across ranks.
        profiler = CollectiveProfiler().install() if profile_collectives else None
        return cls(ident, group, watchdog, Broadcaster(group, watchdog), profiler)
