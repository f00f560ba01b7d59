"""How the probes at start time a pass (distributed/machine_probe.py, row_probe.py,
step_probe.py): the median of a few samples after an untimed run, each sample longer where
a host's ranks outnumber its cores."""

from __future__ import annotations

import statistics
import time
from typing import Any

REPEATS = 5
# A pass this long is timed three times, not REPEATS, and without the shorter pass that
# takes an evaluation's fixed cost off (0.2 ms here for a layer's seven products, small
# ones included: 1% of such a pass). Past a 260 MB cache the probe took 4.9 s with both
# (3.4 without), twice a start: a 2-rank start took 43 s against 30 with 96 MB (33 now).
LONG_PASS_MS = 20.0
# Where a host's ranks outnumber its cores, each sample of a probe runs its pass again
# until this long has passed: a pass of a few ms either ran whole or waited out another
# rank's turn of the scheduler, so their median read either (3 ranks on the Xeon host's 2
# cores, nine starts: attention 8.4-17.9 GFLOP/s, the products at a prefill's rows 53-118,
# one row 5.7-11.7 GB/s), and the 3-rank pipeline's prefill was predicted -6% to -35%;
# with these samples, six starts: attention 8.8-13.0, the pipeline's prefill -1% to -17%
CROWDED_SAMPLE_MS = 60.0


def median_ms(run: Any, repeats: int, enough_ms: float = 0.0, floor_ms: float = 0.0) -> float:
    """The median ms of a run over `repeats` timed samples after one untimed run; three do
    where they took `enough_ms` together (never for a collective: every rank must run it
    alike). With `floor_ms`, a sample runs `run` again until that long has passed and
    counts its mean (three samples): see CROWDED_SAMPLE_MS."""
    run()
    times: list[float] = []
    for _ in range(repeats):
        started, runs = time.perf_counter(), 0
        while True:
            run()
            runs += 1
            took = (time.perf_counter() - started) * 1e3
            if took >= floor_ms:
                break
        times.append(took / runs)
        if len(times) >= 3 and (floor_ms or (enough_ms and sum(times) >= enough_ms)):
            break
    return statistics.median(times)
