"""A worker rank's whole service once its model is loaded: report ready to rank 0, then
sleep on the wake channel, and when woken take each step plan rank 0 broadcasts, check it
against this rank's batch, apply it and run its forward, until a sleep plan (back to the
wake channel) or a stop plan (exit 0).

A rank whose batch is not rank 0's (a plan it cannot decode or apply) stops the job; one
whose collective fails because a peer is gone, or whose wake channel closes, exits with
one line, no traceback (distributed/exits.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from distributed.broadcast import Broadcaster
from distributed.exits import EXIT_DIVERGED, EXIT_PEER_GONE, die, peer_lost
from distributed.wake import WakeError, WakeReceiver
from engine.batch_engine import BatchEngine, PlanMismatchError
from engine.step_plan import PlanDecodeError, StepPlan

log = logging.getLogger("ring")


def serve_worker(
    engine: BatchEngine, broadcaster: Broadcaster, wake: WakeReceiver, report: dict[str, Any]
) -> int:
    """Report `report` (this rank's status) to rank 0, then step until told to stop."""
    wake.send_ready(report)
    log.info("ready; waiting for work")
    try:
        _step_loop(engine, broadcaster, wake)
    except RuntimeError as exc:
        if not peer_lost(exc):
            raise
        die(EXIT_PEER_GONE, f"a collective failed ({exc}): a peer rank is gone; this rank exits")
    return 0


def _step_loop(engine: BatchEngine, broadcaster: Broadcaster, wake: WakeReceiver) -> None:
    while True:
        try:
            wake.wait()
            log.debug("woken at %.6f", time.time())
        except WakeError as exc:
            die(EXIT_PEER_GONE, f"{exc}; this rank exits")
        while True:
            try:
                plan = StepPlan.decode(broadcaster.broadcast(None))
                engine.check(plan)
                if plan.stop:
                    log.info("stop plan received; exiting")
                    return
                engine.apply(plan)
            except (PlanDecodeError, PlanMismatchError) as exc:
                die(EXIT_DIVERGED, f"stopping the job: {exc}")
            if plan.sleep:
                engine.advance_idle()
                break
            engine.run()
