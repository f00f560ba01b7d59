"""A step's overhead: the time no weight causes (building the step's graph, norms and
activations, sampling, the plan), per step, per layer and per row and layer, by the kind
of device, and on a CPU by the cores a rank has while it computes and whether its step is
compiled (distributed/step_model.py adds it to a step's compute and collectives; the
figures: docs/BENCHMARKS.md, "The step-time model in the product")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overhead:
    """Per-step time no weight causes: `step_ms` once, `layer_ms` per decoder layer a rank
    runs, `row_layer_ms` per row per layer (activations, norms, attention's dispatch), and
    `decode_row_layer_ms` more per row per layer of a decode step (not of a prefill)."""

    step_ms: float
    layer_ms: float
    row_layer_ms: float
    source: str
    decode_row_layer_ms: float = 0.0

    def ms(self, layers: int, rows: int, decode: bool = True) -> float:
        per_row = self.row_layer_ms + (self.decode_row_layer_ms if decode else 0.0)
        return self.step_ms + layers * (self.layer_ms + rows * per_row)


# MLX on a CPU (this project's Linux hosts), bench/step_overhead.py: the fixed part from
# the steps of tiny models whose weights cost nothing (0.465 ms a step, 0.454 ms a layer);
# a full-size layer's extra (the kernel's helper threads wake for each product between a
# layer's other work: 0.059 ms) and the cost a row and layer (attention, activations:
# 0.0554 ms) from the default model's steps on one rank, less the probe's weights. Fitted
# on the Xeon host (2026-11-29, three rounds and three one-rank runs) after SwiGLU's kernel;
# the AMD host's figures before it (0.475, 0.376, 0.0433) read two one-rank runs of the
# default model -8% / -21% at 1 / 8 clients, these +4% / -12% (docs/BENCHMARKS.md). A
# prefill row's is measured at start where the probe can (distributed/machine_probe.py
# `_row_work`, Speed.overhead); a decode row keeps this calibrated sum.
CPU_OVERHEAD = Overhead(0.465, 0.513, 0.0554, "measured: bench.step_overhead (docs/BENCHMARKS.md)")
# A rank with one core or less while it computes (a tensor or expert split's ranks sharing
# a host's cores, or a one-core host), bench/step_overhead.py --one-core: MLX's thread that
# builds and dispatches the step and the threads that run its kernels take turns on the
# core where they overlapped on two. Fitted on the Xeon host (2026-11-29) after SwiGLU's
# own kernel (engine/cpu_activation.py) made a decode row cheaper: the tiny models' steps
# under `taskset -c 0`, two rounds: 1.63 ms a step, 0.387 a layer; a full-size layer's
# extra (0.040 ms) and 0.0364 ms more a decode row and layer than the two-core kind's 0.0433
# from three one-rank runs of the default model on one core (0.0797 in all; 0.0243 more
# than that kind's refit 0.0554). The AMD host's figures before it (0.652 a layer, 0.0934 a row
# and layer) read those runs +11 to +14% / +12 to +24% at 1 / 8 clients, now -1 to +1% /
# -6 to +4%; the 2-rank tensor split's medians +20% / +43%, now +3% / +16%
# (docs/BENCHMARKS.md).
CPU_ONE_CORE_OVERHEAD = Overhead(
    1.629, 0.427, 0.0554, "measured: bench.step_overhead --one-core (docs/BENCHMARKS.md)", 0.0243
)
# The same two, measured alike with COMPILED_DECODE=off (`--eager`, 2026-11-27: the tiny
# models' steps through the origin, three rounds each, and three one-rank runs each), for
# the decode steps of plans that run uncompiled (a pipeline, an expert split:
# distributed/step_work.py `eager`), where every elementwise operation of a layer is a
# kernel launch of its own. The 2-rank pipeline's decode went from -7% / -7% at 1 / 8
# clients to +6% / +3% (the same three runs, docs/BENCHMARKS.md). Fitted again on the Xeon
# host (2026-11-29: 0.864 ms a step, 0.333 a layer, 0.139 a row and layer) they put 35 of
# the step-time table's 48 cells within 20% against 38 with these, so these stay.
CPU_EAGER_OVERHEAD = Overhead(
    0.0, 0.691, 0.0548, "measured: bench.step_overhead --eager (docs/BENCHMARKS.md)"
)
CPU_EAGER_ONE_CORE_OVERHEAD = Overhead(
    0.0, 0.718, 0.0548, "measured: bench.step_overhead --eager --one-core", 0.0172
)


# The AMD EPYC host (2 cores; MLX names it "AMD EPYC"), fitted alike on 2026-11-29 after
# SwiGLU's kernel (three rounds of the tiny models, three one-rank runs of the default model
# each): its layers cost 58% of the Xeon's (0.251 + 0.045 ms a layer), and with the Xeon's
# kinds one rank's decode read +27% / +23% at 1 / 8 clients, the pipelines' +20% to +46%.
# On one core a decode row and layer cost 0.034 ms in all (0.027 eager), less than its
# prefill row's 0.051 (0.044): the extra is negative.
EPYC_OVERHEAD = Overhead(0.099, 0.296, 0.0513, "measured: bench.step_overhead on an AMD EPYC")
EPYC_ONE_CORE_OVERHEAD = Overhead(
    0.0, 0.402, 0.0513, "measured: bench.step_overhead --one-core on an AMD EPYC", -0.0174
)
EPYC_EAGER_OVERHEAD = Overhead(
    0.32, 0.450, 0.0437, "measured: bench.step_overhead --eager on an AMD EPYC"
)
EPYC_EAGER_ONE_CORE_OVERHEAD = Overhead(
    0.14, 0.553, 0.0437, "measured: bench.step_overhead --eager --one-core on an AMD EPYC", -0.0169
)


@dataclass(frozen=True)
class CpuKinds:
    """One CPU's four overheads: with cores to spare or one core while a rank computes,
    its step compiled or eager; and where a host's ranks outnumber its cores, what each
    hop of a collective (a ring all_sum's ranks - 1, a hand-over's one) waits for the
    scheduler to run the rank it needs."""

    compiled: Overhead
    one_core: Overhead
    eager: Overhead
    eager_one_core: Overhead
    crowded_hop_ms: float

    def of(self, one_core: bool, eager: bool) -> Overhead:
        if one_core:
            return self.eager_one_core if eager else self.one_core
        return self.eager if eager else self.compiled


# A crowded hop's wait on the Xeon: 1.55-2.15 ms, 1.9 on average, over six runs of 3 ranks
# of a tensor split on 2 cores (126 hops a step, 2026-11-27; docs/BENCHMARKS.md).
XEON = CpuKinds(
    CPU_OVERHEAD, CPU_ONE_CORE_OVERHEAD, CPU_EAGER_OVERHEAD, CPU_EAGER_ONE_CORE_OVERHEAD, 1.9
)
# On the AMD EPYC, 2.8 fitted alike (two such runs, 2026-11-29: 1 / 8 clients -24% / -29%
# with 1.9, +5% / -5% with this; two more runs after the fit +7% / -5%, were -22% / -29%).
# bench/crowded_transfer.py's 3-rank all_sum of 0.02 MB (two hops) took 4.8-6.5 ms here,
# 5.1-6.4 on the Xeon: the scheduler's turn is alike, the Xeon's larger overheads took
# more of its steps' time.
EPYC = CpuKinds(
    EPYC_OVERHEAD, EPYC_ONE_CORE_OVERHEAD, EPYC_EAGER_OVERHEAD, EPYC_EAGER_ONE_CORE_OVERHEAD, 2.8
)
# By the name MLX gives the CPU (mx.device_info()'s device_name, recorded at start); a CPU
# not fitted takes the Xeon's kinds, the host most of the step-time table was measured on.
CPUS = {"AMD EPYC": EPYC}


def cpu_kinds(cpu: str = "") -> CpuKinds:
    """The figures fitted on this CPU (MLX's name for it), or the Xeon's."""
    return CPUS.get(cpu, XEON)


def cpu_overhead(one_core: bool, eager: bool, cpu: str = "") -> Overhead:
    """A CPU rank's overhead: on this CPU, with one core or less while it computes, and
    uncompiled."""
    return cpu_kinds(cpu).of(one_core, eager)


# ASSUMED for Apple GPUs: MLX dispatches a layer's 20-40 kernels at ~5 us each while the
# GPU runs the previous ones (async_eval), so graph building mostly overlaps.
GPU_OVERHEAD = Overhead(2.0, 0.15, 0.0, "assumed: ~30 kernels a layer at ~5 us each")
