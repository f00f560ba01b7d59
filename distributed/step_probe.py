"""Measure at start what the step-time model needs of the machines and the link under the
ranks (distributed/step_model.py), in about a second (a few where a CPU's cache is large).

- The machine: each rank's rates (distributed/machine_probe.py). The ranks probe at once,
  so ranks sharing a host's cores measure the rate they will get together; they probe
  each decode row count after a barrier, and then each alone in turn (a pipeline's
  stage's rates).
- The link: the ranks time all_sums of a step's sizes (the 4 KiB step plan, the hidden
  state of 1, 8, 16 and PREFILL_ROWS rows, and of BULK_ROWS, a prefill chunk's) before
  the machine's probe and again after it, and fit a fixed cost plus a cost per byte to
  each size's cheaper time, and a second cost per byte past PREFILL_ROWS (`LinkTimes`).
  A row's all_sum is also timed as a step meets it, in one graph between pieces of work,
  and the fixed cost is what that costs where it costs more than back to back.
- Crowded ranks (more than their one host's cores): no link probe (it would time the
  scheduler's turns); the loopback's figure instead, and the waits for the scheduler a
  hop and a MB of a collective costs them, timed between work they do at once, and a
  hop as a pipeline's stages meet it, working in turn.

One all_gather then gives every rank every rank's figures, so every rank plans from the
same numbers (PARALLELISM=auto, distributed/plan_speed.py).

    python -m distributed.step_probe MODEL_DIR   # this machine's rates as JSON (the plan)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from distributed.chips import Link, collective_hops, link_named
from distributed.crowded_probe import (
    hop_wait_ms,
    layer_products,
    ms_per_mb_beyond,
    pipeline_hop_ms,
)
from distributed.hosts import RankHost
from distributed.machine_probe import median_ms, probe_machine
from distributed.model_shape import ModelShape
from distributed.shared_cores import GroupTurns
from distributed.speed_records import all_records, crowding_of, machine_record, per_host
from distributed.step_model import PREFILL_ROWS, Speed
from distributed.step_work import PLAN_BUFFER_BYTES

log = logging.getLogger("ring.plan")
LINK_REPEATS = 12
# A prefill chunk's all_sum, timed apart: over the loopback here the line through the
# smaller sizes gave a 1,440-row all_sum of the default model 2.5 ms where it took 20-75
# (bench.collective_gap), and the tensor split's prefill read 7-23% fast.
BULK_ROWS = 1024
BULK_REPEATS = 4
# A row's all_sum amid a step's work: STEP_CHAIN of them in one graph, each after a row's
# product, less the same graph without them. Back to back (the sizes above) the ranks met
# each other at once; in a step each all_sum waits for the other rank's work and wakes the
# link. Here, through the bench's relay at 150 us one way: 0.42 ms back to back, 0.72-1.2
# in such a graph; the tensor split's decode steps measured 0.45-0.77 ms more a collective
# than the back-to-back figure predicted. Over the loopback the two agree (0.04-0.07 ms).
STEP_CHAIN = 32
STEP_CHAINS = 5
# Ranks outnumbering their host's cores wait for the scheduler at each hop of a collective
# and again for each MB it moves; the CPU's fitted figures (step_overhead.py, step_model.py)
# are the least they wait. A link adds to it: the ranks poll their sockets while they wait
# (MLX's ring), so a longer hop keeps a core polling. So the waits are timed at start as a
# step of ranks working at once meets them (`crowded_waits`), and a tensor or expert split
# pays the larger of each (a pipeline's hops: distributed/crowded_probe.py). Through the
# bench's relay at 150 us, 3 ranks of the tensor split on the Xeon's 2 cores timed
# 10.2-10.5 ms a hop and 19.8-22.8 a MB (fitted: 1.9 and 8.5), their steps -9% / -11% at 1
# client (-82% on the fitted figures). Over the loopback the chain reads 0.65-2.05 ms where
# the steps waited 1.9-2.9 (at start the ranks are alone on the cores; serving, the API
# process and its clients take turns too): the fitted figure stands there.
# docs/BENCHMARKS.md, "Crowded ranks time their waits at start".
CROWDED_PASSES = 3
MIN_MS_PER_BYTE = 5e-8  # a link faster than 20 GB/s is taken to be 20 GB/s


# ---- the link ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkTimes:
    """The median ms of all_sums of each size (bytes), one pass of the link's probe, of a
    prefill chunk's (`bulk`: bytes, ms) and of a row's amid a step's work (`in_step`:
    bytes, ms); none where not timed."""

    sizes: tuple[int, ...]
    times: tuple[float, ...]
    bulk: tuple[int, float] | None = None
    in_step: tuple[int, float] | None = None

    def fastest(self, other: LinkTimes) -> LinkTimes:
        """Size by size, the cheaper of two passes: noise only ever adds to a collective."""
        times = tuple(map(min, self.times, other.times))
        return LinkTimes(
            self.sizes,
            times,
            _cheaper(self.bulk, other.bulk),
            _cheaper(self.in_step, other.in_step),
        )

    def fit(self, backend: str, ranks: int) -> Link:
        """A fixed cost plus a cost per byte, fitted to the times, the fixed cost raised to
        what a step's all_sum costs where that is more; past the largest size, the bulk
        all_sum's own cost per byte where it costs more than the line."""
        link = self._line(backend, ranks)
        if self.in_step is not None:
            size, ms = self.in_step
            extra = ms - link.all_sum_ms(size, ranks)
            if extra > 0:
                hops = collective_hops(link.topology, ranks)
                link = replace(link, latency_us=link.latency_us + extra * 1e3 / hops)
        if self.bulk is None:
            return link
        size, ms = self.bulk
        edge = max(self.sizes)
        largest = link.traffic("all_sum", edge, ranks)[1]
        past = link.traffic("all_sum", size, ranks)[1] - largest
        extra = ms - link.all_sum_ms(edge, ranks)
        if past <= 0 or extra <= past / (link.gb_s * 1e6):
            return link  # the line holds
        return replace(link, bulk_bytes=largest, bulk_gb_s=past / extra / 1e6)

    def _line(self, backend: str, ranks: int) -> Link:
        """The fixed cost and the cost per byte through the sizes' times."""
        slope, intercept = np.polyfit(np.array(self.sizes, dtype=float), np.array(self.times), 1)
        topology = "mesh" if backend == "jaccl" else "ring"
        hops = collective_hops(topology, ranks)
        per_byte = max(float(slope), MIN_MS_PER_BYTE)  # noise can tilt the fit
        latency_ms = max(float(intercept), min(self.times) / 2)
        return Link(
            name=f"measured ({backend}, {ranks} ranks)",
            latency_us=latency_ms * 1e3 / hops,
            gb_s=2 * (ranks - 1) / ranks / per_byte / 1e6,
            topology=topology,
            source="all_sums timed at start (distributed/step_probe.py)",
        )


def _cheaper(
    mine: tuple[int, float] | None, theirs: tuple[int, float] | None
) -> tuple[int, float] | None:
    """Of one size's (bytes, ms) in two passes, the cheaper; none where either lacks it."""
    return mine if mine is None or theirs is None else (mine[0], min(mine[1], theirs[1]))


def _dtype(activation_bytes: int) -> mx.Dtype:
    return {4: mx.float32, 2: mx.bfloat16}.get(activation_bytes, mx.float32)


def probe_link(group: mx.distributed.Group, shape: ModelShape, activation_bytes: int) -> LinkTimes:
    """All_sums of a step's sizes (the step plan, the hidden state of 1 to PREFILL_ROWS
    rows), each timed LINK_REPEATS times, a prefill chunk's (BULK_ROWS) BULK_REPEATS
    times, and a row's amid a step's work (STEP_CHAIN)."""
    dtype = _dtype(activation_bytes)
    rows = [(count, LINK_REPEATS) for count in (1, 8, 16, PREFILL_ROWS)]
    arrays = [(mx.zeros((PLAN_BUFFER_BYTES,), dtype=mx.uint8), LINK_REPEATS)] + [
        (mx.zeros((count, shape.hidden_size), dtype=dtype), repeats)
        for count, repeats in rows + [(BULK_ROWS, BULK_REPEATS)]
    ]
    sizes, times = [], []
    for array, repeats in arrays:
        mx.eval(array)

        def run(array: mx.array = array) -> None:
            mx.eval(mx.distributed.all_sum(array, group=group))

        sizes.append(array.nbytes)
        times.append(median_ms(run, repeats))
    in_step = _in_step_ms(group, shape.hidden_size, dtype)
    return LinkTimes(tuple(sizes[:-1]), tuple(times[:-1]), (sizes[-1], times[-1]), in_step)


def _in_step_ms(group: mx.distributed.Group, hidden: int, dtype: mx.Dtype) -> tuple[int, float]:
    """A row's all_sum as a step meets it (STEP_CHAIN): its bytes and ms."""
    weight = mx.full((hidden, hidden), 1.0 / hidden, dtype=dtype)
    row = mx.full((1, hidden), 0.5, dtype=dtype)
    mx.eval(weight, row)

    def chain(synced: bool) -> None:
        y = row
        for _ in range(STEP_CHAIN):
            y = mx.tanh(y @ weight)
            y = mx.distributed.all_sum(y, group=group) if synced else y * 0.5
        mx.eval(y)

    synced = median_ms(lambda: chain(True), STEP_CHAINS)
    alone = median_ms(lambda: chain(False), STEP_CHAINS)
    return row.nbytes, max(0.0, synced - alone) / STEP_CHAIN


def crowded_waits(
    group: mx.distributed.Group, shape: ModelShape, dtype: mx.Dtype
) -> tuple[float, float, float]:
    """What ranks that outnumber their host's cores wait beyond the loopback's figure: a
    hop of a row's all_sum (CROWDED_PASSES), a MB of a prefill chunk's (BULK_ROWS), and a
    hop of a pipeline's step (distributed/crowded_probe.py)."""
    ranks, hidden = group.size(), shape.hidden_size
    layer = 4 * hidden * hidden + 3 * hidden * shape.intermediate_size
    share = layer_products(hidden, layer // ranks, dtype)
    row = mx.full((1, hidden), 0.5, dtype=dtype)
    chunk = mx.zeros((BULK_ROWS, hidden), dtype=dtype)
    mx.eval(row, chunk)

    def chain(synced: bool) -> None:
        y = row
        for _ in range(STEP_CHAIN):
            y = share(y)
            y = mx.distributed.all_sum(y, group=group) if synced else y * 0.5
        mx.eval(y)

    waits = sorted(
        (median_ms(lambda: chain(True), STEP_CHAINS) - median_ms(lambda: chain(False), STEP_CHAINS))
        / STEP_CHAIN
        for _ in range(CROWDED_PASSES)
    )
    hop = hop_wait_ms(waits[len(waits) // 2], row.nbytes, ranks)
    bulk = median_ms(lambda: mx.eval(mx.distributed.all_sum(chunk, group=group)), BULK_REPEATS)
    pipeline = pipeline_hop_ms(group, hidden, layer, shape.num_layers, dtype)
    return hop, ms_per_mb_beyond(bulk, chunk.nbytes, ranks, hop), pipeline


# ---- every rank's figures -----------------------------------------------------------------


def steadier(first: Link, second: Link) -> Link:
    """Of two measures of one link, the cheaper over a decode's and a prefill's all_sum (4
    KiB and 1 MiB): another process on the cores (at start, a launcher still busy) only
    ever slows a collective. Measured here over 58 starts: a 2-rank link read 63-1,418 us
    a collective, over 1 ms in 3 of them, which made PARALLELISM=auto take the slower
    split (docs/ARCHITECTURE.md, "What restart restarts")."""

    def cost(link: Link) -> float:
        return link.all_sum_ms(4096, 2) + link.all_sum_ms(2**20, 2)

    return first if cost(first) <= cost(second) else second


def measure_speed(
    group: mx.distributed.Group,
    shape: ModelShape,
    activation_bytes: int,
    hosts: list[RankHost],
    backend: str,
) -> Speed:
    """Every rank's machine and the link, measured now (a collective: all ranks call it)."""
    if group.size() > 1:  # start together: ranks sharing cores then measure what they share
        GroupTurns(group).together()
    ranks = group.size()
    # ranks sharing a host's cores: its decode rates probed at once and each alone
    turns = GroupTurns(group) if len({h.host for h in hosts}) < len(hosts) else None
    crowding = crowding_of(hosts)
    # Ranks outnumbering one host's cores would time the scheduler's turns, which the
    # model adds apart (crowded_link): no link probe there.
    crowded = max(crowding) > 1.0 and len({h.host for h in hosts}) == 1
    probed = ranks > 1 and not crowded
    first = probe_link(group, shape, activation_bytes) if probed else None
    crowd = crowding[group.rank()] > 1.0
    machine = probe_machine(shape, activation_bytes, crowded=crowd, turns=turns)
    link = None
    if first is not None:  # once more, a second later, and each size's cheaper time kept
        again = probe_link(group, shape, activation_bytes)
        if max(first.times[0], again.times[0]) > 2 * min(first.times[0], again.times[0]):
            log.info(
                "link measured twice: %.0f then %.0f us a step plan's all_sum; the cheaper kept",
                first.times[0] * 1e3,
                again.times[0] * 1e3,
            )
        link = first.fastest(again).fit(backend, ranks)
    mine: dict[str, Any] = {"machine": machine_record(machine)}
    if link is not None:
        mine["link"] = [link.latency_us, link.gb_s, link.bulk_bytes, link.bulk_gb_s]
    if crowded:
        mine["crowded"] = crowded_waits(group, shape, _dtype(activation_bytes))
    records = all_records(group, mine)
    machines = per_host(records, hosts)
    waits = (0.0, 0.0, 0.0)
    if crowded:
        link = crowded_link(ranks, hosts[0].cores)
        waits = tuple(sum(r["crowded"][i] for r in records) / len(records) for i in range(3))
        log.info(
            "crowded ranks, timed between work they do at once: %.1f ms a hop, %.1f a MB;"
            " in a pipeline's steps %.1f ms a hop",
            *waits,
        )
    elif link is None:
        link = Link("none (one rank)", 0.0, 1.0, "ring", "one rank: no collectives")
    else:  # every rank timed the same all_sums: their mean, the same on every rank
        latency = sum(r["link"][0] for r in records) / len(records)
        rate = sum(r["link"][1] for r in records) / len(records)
        bulks = [r["link"][3] for r in records]  # a bulk rate where every rank timed one
        bulk = sum(bulks) / len(bulks) if min(bulks) > 0 else 0.0
        past = records[0]["link"][2] if bulk else 0.0
        link = replace(link, latency_us=latency, gb_s=rate, bulk_bytes=past, bulk_gb_s=bulk)
    return Speed(machines, link, crowding, True, *waits)


def crowded_link(ranks: int, cores: int) -> Link:
    """The link of ranks that outnumber their one host's cores. Timed at start it gave the
    scheduler's turns (1.0-4.0 ms a hop over nine starts of 3 ranks on 2 cores, the steps'
    waits 3.0-3.8 ms a hop), not the loopback, so its table figure stands and the step-time
    model adds each hop's wait (distributed/step_overhead.py `CpuKinds`)."""
    local = link_named("ring-local")
    log.info(
        "link: %d ranks on %d cores of one host would time the scheduler's turns; the"
        " loopback's %.0f us + %.1f GB/s taken, and each hop's wait for the scheduler",
        ranks,
        cores,
        local.latency_us,
        local.gb_s,
    )
    return replace(local, name=f"ring-local ({ranks} ranks on {cores} cores)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="This machine's rates for a model, as JSON.")
    parser.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)
    from distributed.memory import activation_bytes

    config = json.loads((args.model_dir / "config.json").read_text())
    shape = ModelShape.from_config(config)
    machine = probe_machine(shape, activation_bytes(args.model_dir, config))
    json.dump(machine_record(machine), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
