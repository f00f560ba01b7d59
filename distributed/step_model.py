"""The step-time model: how long one step of a plan takes on given machines and a link.

    step = compute + collectives + overhead

- compute: each rank's weights read (dense parts every step, routed experts where the
  step's tokens go, the KV of the context) at its machine's rate for that many rows, plus
  attention's arithmetic over the context. Tensor and expert plans compute at once and
  sync after attention and after the MLP, so each part's busiest rank counts; a
  pipeline's stages run one after another, so every rank counts, except in a long
  prefill, which streams through them in pieces (distributed/prefill_pieces.py).
- collectives: the plan's (distributed/step_work.py: count and bytes) at the link's cost,
  measured at start (distributed/step_probe.py) or from the link's table
  (distributed/chips.py). Where ranks outnumber their host's cores, each hop of a
  collective also waits for the scheduler to run the rank it needs (by the CPU, or more
  where timed at start in the split's own pattern: between work the ranks do at once, or
  a pipeline's stages in turn), and a large one again as its bytes pass
  (CROWDED_MS_PER_MB).
- overhead: what no weight causes (distributed/step_overhead.py), by the kind of device,
  and on a CPU by the CPU, the cores a rank has while it computes and whether its step is
  compiled.

A machine's rate is measured where the ranks run (bytes a rank multiplies per ms at 1, 2,
4, 8 and 16 rows and at a prefill's many), or, for an Apple chip described by hand, its
memory bandwidth and GPU arithmetic from distributed/chips.py at the shares below. Decode
at B clients is B tokens a step; with W positions a row (speculation) B x W rows go
through the products and the head, with the same collectives. The figures it was checked
against, and the commands: docs/BENCHMARKS.md, "The step-time model in the product".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from distributed.chips import Chip, Link
from distributed.expert_load import SORTED_ROUTES, routed_reads
from distributed.prefill_pieces import prefill_pieces, streamed_ms
from distributed.shares import split
from distributed.step_overhead import CPU_OVERHEAD, GPU_OVERHEAD, Overhead, cpu_kinds, cpu_overhead
from distributed.step_work import PlanWork, RankWork

# ASSUMED for Apple GPUs (no Mac runs here): MLX's decode reads weights at this share of the
# chip's specified bandwidth, and a prefill multiplies at this share of its arithmetic.
BANDWIDTH_SHARE = 0.8
FLOPS_SHARE = 0.5
# And a large transfer between such ranks waits a turn again for about every 0.4 MB moved
# (bench/crowded_transfer.py, 3 ranks on 2 cores: 0.02 / 0.29 / 1.18 / 3.32 MB took 5.1-6.4
# / 8.8-10.8 / 15.4-17.8 / 50-53 ms, 8.5 ms a MB beyond the hops' turns and the loopback).
CROWDED_MS_PER_MB = 8.5
# the rows at which a machine's rates give a prefill's arithmetic (distributed/machine_probe.py)
PREFILL_ROWS = 128


@dataclass(frozen=True)
class Machine:
    """What one rank's machine does with weights: measured rates (`rates`: (rows, bytes
    per ms) pairs, `flops_per_ms` at a prefill's rows), or an Apple chip's figures."""

    name: str
    memory_bytes: int = 0
    cores: int = 1
    rates: tuple[tuple[int, float], ...] = ()
    alone_rates: tuple[tuple[int, float], ...] = ()  # the others waiting: a pipeline stage's
    head_rates: tuple[tuple[int, float], ...] = ()  # the output head's (its own layout)
    route_rates: tuple[tuple[int, float], ...] = ()  # a decode step's unsorted routes'
    flops_per_ms: float = 0.0  # the products' arithmetic at a prefill's rows
    attention_flops_per_ms: float = 0.0  # attention's arithmetic over a prefill chunk
    kv_bytes_per_ms: float = 0.0  # KV a decode step's attention reads
    expert_flops_per_ms: float = 0.0  # routed experts' products over a prefill's tokens
    row_layer_ms: float = 0.0  # a prefill row's work in a layer beside those (0: the table's)
    chip: Chip | None = None
    overhead: Overhead = CPU_OVERHEAD
    cpu: str = ""  # a CPU's name as MLX gives it ("AMD EPYC"): its overheads' kinds

    @classmethod
    def of_chip(cls, chip: Chip, memory_bytes: int, cores: int = 8) -> Machine:
        return cls(f"{chip.name}", memory_bytes, cores, chip=chip, overhead=GPU_OVERHEAD)

    @property
    def measured(self) -> bool:
        return bool(self.rates)

    def weights_ms(self, nbytes: float, params: float, rows: int, head: bool = False) -> float:
        """Milliseconds to multiply `rows` rows against `params` weights of `nbytes` (the
        output head's, `head`, where it was measured apart)."""
        if nbytes <= 0:
            return 0.0
        if self.chip is not None and not self.rates:
            memory = nbytes / (self.chip.bandwidth_gb_s * BANDWIDTH_SHARE * 1e6)
            arithmetic = 2 * params * rows / (self.chip.gpu_tflops * FLOPS_SHARE * 1e9)
            return max(memory, arithmetic)
        table = self.head_rates if head and self.head_rates else self.rates
        return nbytes * self.ms_per_byte(rows, table)

    def ms_per_byte(self, rows: int, table: tuple[tuple[int, float], ...] = ()) -> float:
        """Measured: linear between the probed row counts; beyond the last, time grows with
        the rows (the products are bound by arithmetic there)."""
        points = sorted(table or self.rates)
        if not points:
            raise ValueError(f"machine {self.name} has neither measured rates nor a chip")
        xs = [r for r, _ in points]
        ys = [1.0 / rate for _, rate in points]
        if rows >= xs[-1]:
            return ys[-1] * rows / xs[-1]
        return float(np.interp(rows, xs, ys))

    def attention_ms(self, flops: float, kv_bytes: float) -> float:
        """Milliseconds of attention: its arithmetic (scores and weighted values) or the
        KV it reads, whichever takes longer."""
        if self.chip is not None and not self.rates:
            arithmetic = flops / (self.chip.gpu_tflops * FLOPS_SHARE * 1e9)
            return max(arithmetic, kv_bytes / (self.chip.bandwidth_gb_s * BANDWIDTH_SHARE * 1e6))
        arithmetic = flops / self.attention_flops_per_ms if self.attention_flops_per_ms else 0.0
        reads = kv_bytes / self.kv_bytes_per_ms if self.kv_bytes_per_ms else 0.0
        return max(arithmetic, reads)


@dataclass(frozen=True)
class Speed:
    """The machines under the ranks (one per rank), the link between them, and how crowded
    each rank's host is (its ranks over its cores: 0.25 for 2 ranks on 8 cores; records
    before 2026-11-27 kept at least 1)."""

    machines: tuple[Machine, ...]
    link: Link
    crowding: tuple[float, ...] = ()
    rates_shared: bool = False  # measured at start: the rates include the cores' sharing
    # a crowded host's waits timed at start (distributed/step_probe.py); 0: not timed
    crowded_hop_ms: float = 0.0
    crowded_ms_per_mb: float = 0.0
    pipeline_hop_ms: float = 0.0  # a hop's wait as a pipeline's steps meet it

    def crowd(self, rank: int) -> float:
        """How many times over the rank's host's cores are taken (at least 1)."""
        return max(1.0, self.crowding[rank]) if self.crowding else 1.0

    def overhead(self, rank: int, at_once: bool, eager: bool = False) -> Overhead:
        """The rank's machine's overhead; on a CPU, by whether the rank has one core or
        less while it computes (ranks that compute `at_once`, a tensor or expert split,
        share their host's cores; a pipeline's stages compute in turn) and whether its
        step is `eager`."""
        machine = self.machines[rank]
        if machine.overhead is not CPU_OVERHEAD:
            return machine.overhead
        shared = self.crowding[rank] if self.crowding and at_once else 1.0 / machine.cores
        kind = cpu_overhead(shared >= 1.0, eager, machine.cpu)
        if not machine.row_layer_ms:
            return kind
        # a prefill row's cost as measured, and a decode row's as calibrated (the same
        # sum); measured while the host's ranks probed at once, as the rates were, where
        # predict multiplies every overhead by the crowding: 3 ranks on the 2 cores here
        # read 0.065-0.077 ms against one rank's 0.037-0.040 (timing mlx's own activation)
        row = machine.row_layer_ms / (self.crowd(rank) if self.rates_shared else 1.0)
        extra = kind.decode_row_layer_ms + kind.row_layer_ms - row
        return replace(kind, row_layer_ms=row, decode_row_layer_ms=extra)


@dataclass(frozen=True)
class StepTime:
    """One step's predicted milliseconds and their parts."""

    ms: float
    compute_ms: float
    collective_ms: float
    overhead_ms: float
    collectives: int
    parts: dict[str, float] = field(default_factory=dict)


def _rank_segments(
    work: PlanWork, rank: RankWork, machine: Machine, rows: int, head_rows: int,
    routed: tuple[float, float], context: int, batch: int,
) -> tuple[float, float, float]:  # fmt: skip
    """One rank's compute ms for a forward of `rows` token rows over `context` positions,
    in the parts a tensor plan syncs after: (attention, the rest of the layers, the head);
    `routed`: (experts it computes in a MoE layer, its share of the layer's routes)."""
    attention_bytes = rank.attention_params * rank.param_bytes
    attention_weights = machine.weights_ms(attention_bytes, rank.attention_params, rows)
    rest = rank.dense_params - rank.attention_params
    dense = machine.weights_ms(rest * rank.param_bytes, rest, rows)
    head = machine.weights_ms(
        rank.head_params * rank.param_bytes, rank.head_params, head_rows, head=True
    )
    experts, share = routed
    routed_ms = 0.0
    if rank.moe_layers and experts:
        tokens_each = max(1, math.ceil(rows * work.experts_per_token * share / experts))
        nbytes = rank.expert_params * rank.expert_param_bytes
        if machine.route_rates and rows * work.experts_per_token < SORTED_ROUTES:
            probed = min(rows, max(n for n, _ in machine.route_rates))  # each route its read
            one = nbytes * machine.ms_per_byte(probed, machine.route_rates)
        else:
            one = machine.weights_ms(nbytes, rank.expert_params, tokens_each)
        if machine.expert_flops_per_ms and machine.rates:  # a prefill: gather_mm's arithmetic
            one = max(one, 2 * rank.expert_params * tokens_each / machine.expert_flops_per_ms)
        routed_ms = rank.moe_layers * experts * one
    span = rows / batch  # positions a row computes this forward
    attention = 4 * rank.layers * rank.heads * rank.head_dim * rows * (context + span / 2)
    kv = batch * (context + span) * rank.kv_bytes_per_token
    return attention_weights + machine.attention_ms(attention, kv), dense + routed_ms, head


def _synced_compute(work: PlanWork, segments: list[tuple[float, float, float]]) -> float:
    """A tensor plan's compute: at each all_sum every rank waits for the slowest, so each
    part between two syncs costs its busiest rank's time. Where the heads split unevenly,
    one rank is busiest in attention and another in the MLP and the head: the default
    model's 6/3 heads at 2 ranks read -24% / -33% at 1 / 8 clients by the busiest rank's
    whole step, -18% / -28% by its parts (the same three runs, docs/BENCHMARKS.md)."""
    attention, rest, head = zip(*segments, strict=True)
    if work.attention_synced:
        return max(attention) + max(rest) + max(head)
    return max(a + r for a, r in zip(attention, rest, strict=True)) + max(head)


def _piece_segments(
    work: PlanWork, speed: Speed, rows: int, head_rows: int, context: int, seqs: int
) -> list[tuple[float, float, float]]:
    """Each rank's (attention, the rest of the layers, the head) ms for a forward of `rows`
    token rows after `context` cached positions, its host's crowding counted."""
    routed = routed_reads(work, rows)
    segments: list[tuple[float, float, float]] = []
    for r, machine in zip(work.ranks, speed.machines, strict=True):
        if work.strategy == "pipeline" and machine.alone_rates:
            machine = replace(machine, rates=machine.alone_rates)
        crowd = 1.0 if speed.rates_shared else speed.crowd(r.rank)
        attention, rest, head = _rank_segments(
            work, r, machine, rows, head_rows, routed[r.rank], context, seqs
        )
        segments.append((attention * crowd, rest * crowd, head * crowd))
    return segments


def predict(
    work: PlanWork, speed: Speed, batch: int, width: int = 1, context: int = 0, prefill: int = 0
) -> StepTime:
    """One forward's time: a decode step of `batch` rows of `width` positions over
    `context` cached positions, or (`prefill` > 0) a prefill chunk of that many tokens."""
    rows = prefill if prefill else batch * width
    head_rows = 1 if prefill else batch * width
    seqs = 1 if prefill else batch
    if len(speed.machines) != work.world:
        raise ValueError(f"{len(speed.machines)} machines for a plan of {work.world} ranks")
    pipeline = work.strategy == "pipeline"
    # a long prefill streams through a pipeline's stages in pieces, each piece a forward
    # over the cache the pieces before it filled
    pieces = prefill_pieces(prefill, work.world) if pipeline else 1
    spans = split(rows, [1.0] * pieces)
    by_piece = [
        _piece_segments(work, speed, end - start, head_rows, context + start, seqs)
        for start, end in spans
    ]
    for segments in by_piece[:-1]:  # the head takes the last piece's last position only
        segments[:] = [(attention, rest, 0.0) for attention, rest, _ in segments]
    computes = [[sum(by_piece[k][r]) for k in range(pieces)] for r in range(work.world)]
    at_once = not pipeline and work.world > 1
    # a prefill's forward is never compiled, on any plan: its rows were predicted within a
    # few percent by the compiled decode's terms, so only a decode step tells eager apart
    eager = work.eager and not prefill
    kinds = [speed.overhead(r.rank, at_once, eager) for r in work.ranks]
    if pipeline:  # one plan, one sampler: the step's fixed cost once, on rank 0
        stages = [
            [
                ms + (o.ms(r.layers, end - start, not prefill) - o.step_ms) * speed.crowd(r.rank)
                for ms, (start, end) in zip(piece_ms, spans, strict=True)
            ]
            for piece_ms, r, o in zip(computes, work.ranks, kinds, strict=True)
        ]
        stages[0][0] += kinds[0].step_ms * speed.crowd(0)
        compute = streamed_ms(computes)
        overhead = streamed_ms(stages) - compute
    else:
        overheads = [
            o.ms(r.layers, rows, decode=not prefill) * speed.crowd(r.rank)
            for r, o in zip(work.ranks, kinds, strict=True)
        ]
        overhead = max(overheads)
        if work.strategy == "tensor":
            compute = _synced_compute(work, by_piece[0])
        else:
            compute = max(c[0] for c in computes)
    talk, count = 0.0, 0
    crowded = max(speed.crowding or (1.0,)) > 1.0
    fitted = cpu_kinds(speed.machines[0].cpu).crowded_hop_ms  # the least (step_probe.py)
    hop_ms = max(fitted, speed.crowded_hop_ms if at_once else speed.pipeline_hop_ms)
    per_mb = max(CROWDED_MS_PER_MB, speed.crowded_ms_per_mb) if at_once else CROWDED_MS_PER_MB
    for c in work.collectives:
        nbytes = c.nbytes(head_rows if c.what == "the head's logits" else rows)
        each = speed.link.ms(c.kind, nbytes, work.world)
        if crowded:
            hops, moved = speed.link.traffic(c.kind, nbytes, work.world)
            each += hop_ms * hops + per_mb * moved / 1e6
        talk += c.count * each
        count += c.count
    return StepTime(
        ms=compute + talk + overhead,
        compute_ms=compute,
        collective_ms=talk,
        overhead_ms=overhead,
        collectives=count,
        parts={f"rank {i}": sum(ms) for i, ms in enumerate(computes)},
    )


@dataclass(frozen=True)
class ClusterModel:
    """The running cluster's plan work on its measured speed: what rank 0's rules ask
    (leader/spec_rule.py, leader/prefill_budget.py) and what status reports. A step's time
    is linear in its context, so each (rows, width) is predicted twice and then
    interpolated (a step's prediction costs microseconds)."""

    work: PlanWork
    speed: Speed
    _cache: dict[tuple[int, int, int], tuple[float, float]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def routed_as(self, shares: tuple[tuple[float, ...], ...]) -> ClusterModel:
        """The same cluster with its MoE layers' routes as counted (distributed/
        expert_load.py)."""
        return ClusterModel(replace(self.work, expert_shares=shares), self.speed)

    def _line(self, batch: int, width: int, prefill: int) -> tuple[float, float]:
        key = (batch, width, prefill)
        if key not in self._cache:
            near = predict(self.work, self.speed, batch, width, 0, prefill).ms
            far = predict(self.work, self.speed, batch, width, FAR, prefill).ms
            self._cache[key] = (near, (far - near) / FAR)
        return self._cache[key]

    def decode_ms(self, batch: int, width: int = 1, context: float = 0.0) -> float:
        """A decode step of `batch` rows of `width` positions, `context` cached a row."""
        near, slope = self._line(batch, width, 0)
        return near + slope * context

    def prefill_ms(self, tokens: int, context: float = 0.0) -> float:
        """A prefill forward of `tokens` tokens after `context` cached positions."""
        near, slope = self._line(1, 1, tokens)
        return near + slope * context

    def prefill_coefficients(self, chunk: int = 256) -> tuple[float, float, float, float]:
        """(ms a forward, per cached position, per token, per token x cached position) of
        f + g L + a c + b c (L + c / 2), the prefill budget's form, solved from four
        predictions; none negative."""
        t10, tc0 = self.prefill_ms(1), self.prefill_ms(chunk)
        t1l, tcl = self.prefill_ms(1, FAR), self.prefill_ms(chunk, FAR)
        b = max(0.0, ((tcl - tc0) - (t1l - t10)) / (FAR * (chunk - 1)))
        g = max(0.0, (t1l - t10) / FAR - b)
        a = max(0.0, (tc0 - t10 - b * (chunk * chunk - 1) / 2) / (chunk - 1))
        f = max(0.0, t10 - a - b / 2)
        return f, g, a, b


FAR = 8192  # the context of the second prediction of a line
