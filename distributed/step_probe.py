"""Measure at start what the step-time model needs of the machines and the link under the
ranks (distributed/step_model.py), in about a second (a few where a CPU's cache is large).

- The machine: every rank multiplies rows of activations against weights shaped like one
  decoder layer of the model (its attention and MLP projections, in the model's float type
  or quantization), repeated past the caches (to twice the largest): bytes a rank reads
  per ms at 1, 2, 4, 8 and 16 rows (decode, speculation) and at PREFILL_ROWS (a prefill's
  arithmetic). The ranks probe at once, so ranks sharing a host's cores measure the rate
  they will get together.
- The link: the ranks time all_sums of a step's sizes (the 4 KiB step plan, the hidden
  state of 1, 8, 16 and PREFILL_ROWS rows) before the machine's probe and again after it,
  and fit a fixed cost plus a cost per byte to each size's cheaper time (`LinkTimes`).

One all_gather then gives every rank every rank's figures, so every rank plans from the
same numbers (PARALLELISM=auto, distributed/plan_speed.py).

    python -m distributed.step_probe MODEL_DIR   # this machine's rates as JSON (the plan)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.switch_layers import SwitchGLU

from distributed.chips import Link, collective_hops, link_named, this_chip
from distributed.hosts import RankHost, largest_cache_bytes, local_memory_bytes, usable_cores
from distributed.model_shape import ModelShape
from distributed.speed_records import all_records, crowding_of, known_chip, machine_record, per_host
from distributed.step_model import Machine, Speed
from distributed.step_overhead import CPU_OVERHEAD, GPU_OVERHEAD
from distributed.step_work import bytes_per_param

log = logging.getLogger("ring.plan")
DECODE_ROWS = (1, 2, 4, 8, 16)
PREFILL_ROWS = 128
# Weights read per probe run: past a CPU's caches (twice its largest, at least this, at most
# 1 GiB); on a GPU enough to hide the dispatch. 96 MB alone fit the 260 MB last-level cache
# of a Xeon host here, whose probe then read 34 GB/s at 1 row (21 past its cache) and
# predicted the default model's one-rank steps (538 MB) 26% fast; the probe takes 3.4 s
# there against 1.0.
CPU_PROBE_BYTES = 96 * 2**20
GPU_PROBE_BYTES = 512 * 2**20
MIN_PROBE_BYTES = 2 * 2**20
REPEATS = 5
# A pass this long is timed three times, not REPEATS, and without the shorter pass that
# takes an evaluation's fixed cost off (0.2 ms here for a layer's seven products, small
# ones included: 1% of such a pass). Past a 260 MB cache the probe took 4.9 s with both
# (3.4 without), twice a start: a 2-rank start took 43 s against 30 with 96 MB (33 now).
LONG_PASS_MS = 20.0
ATTENTION_CHUNK = 128  # query rows of the prefill's attention probe
ATTENTION_CONTEXT = 512  # and its keys; a decode probe reads 4x as many per row
LINK_REPEATS = 12
MIN_MS_PER_BYTE = 5e-8  # a link faster than 20 GB/s is taken to be 20 GB/s


def _layer_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections (a routed expert's where the model has
    no dense MLP)."""
    hidden = shape.hidden_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.kv_rows
    columns = shape.intermediate_size or shape.expert_size or 4 * hidden
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)] + [
        (columns, hidden),
        (columns, hidden),
        (hidden, columns),
    ]


class _Weights:
    """Weights of given (out, in) shapes up to a byte budget, in the model's format, and
    the product a layer computes with them. `head`: stored [in, out] as MLX's CPU layer
    keeps an output head (engine/cpu_linear.py); elsewhere [out, in] like every layer."""

    def __init__(
        self, shapes: list[tuple[int, int]], shape: ModelShape, dtype: mx.Dtype, budget: int,
        head: bool = False,
    ) -> None:  # fmt: skip
        self.shape, self.dtype = shape, dtype
        self.items: list[tuple[Any, int]] = []  # (weight, its input width)
        self.nbytes = self.params = 0
        quantize = bool(shape.quantized and shape.bits and shape.group_size)
        self.transposed = head and not quantize and mx.default_device() == mx.cpu
        while self.nbytes < budget:
            for rows, columns in shapes:
                w: Any = mx.full((rows, columns), 0.01, dtype=dtype)
                if quantize:
                    w = mx.quantize(w, shape.group_size, shape.bits, mode=shape.quant_mode)
                elif self.transposed:
                    w = mx.contiguous(w.T)
                mx.eval(w)
                self.items.append((w, columns))
                self.nbytes += sum(p.nbytes for p in w if p is not None) if quantize else w.nbytes
                self.params += rows * columns

    def _product(self, x: mx.array, w: Any) -> mx.array:
        if isinstance(w, mx.array):
            return x @ w if self.transposed else x @ w.T
        weight, scales, *rest = w
        s = self.shape
        return mx.quantized_matmul(
            x, weight, scales, rest[0] if rest else None, True, s.group_size, s.bits,
            mode=s.quant_mode,
        )  # fmt: skip

    def ms(self, rows: int, repeats: int, items: int | None = None) -> float:
        """Median ms of one pass of `rows` rows through the first `items` weights."""
        chosen = self.items[:items] if items else self.items
        inputs = {w_in: mx.full((rows, w_in), 0.5, dtype=self.dtype) for _, w_in in chosen}
        mx.eval(list(inputs.values()))

        def run() -> None:
            mx.eval([self._product(inputs[w_in], w) for w, w_in in chosen])

        return _median_ms(run, repeats, enough_ms=3 * LONG_PASS_MS)


def _median_ms(run: Any, repeats: int, enough_ms: float = 0.0) -> float:
    """The median of `repeats` timed runs after one untimed; three do where they took
    `enough_ms` together (never for a collective: every rank must run it alike)."""
    run()
    times: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
        if enough_ms and len(times) >= 3 and sum(times) >= enough_ms:
            break
    return statistics.median(times)


def _slope(full: _Weights, rows: int, part: int) -> float:
    """Bytes a ms: the difference of a pass through every weight and one through the
    first `part` (what each evaluation costs whatever its weights, the overhead's, drops
    out); a pass of LONG_PASS_MS or more alone (that cost is then 1% of it or less)."""
    whole = full.ms(rows, REPEATS)
    if whole >= LONG_PASS_MS:
        return full.nbytes / whole
    some = full.ms(rows, REPEATS, part)
    partial = sum(_nbytes(w) for w, _ in full.items[:part])
    share = (full.nbytes - partial) / full.nbytes
    if whole - some < share * whole / 2:  # ranks taking turns on cores upset one pass
        return full.nbytes / whole
    return (full.nbytes - partial) / (whole - some)


def _nbytes(w: Any) -> int:
    return w.nbytes if isinstance(w, mx.array) else sum(p.nbytes for p in w if p is not None)


def _attention(shape: ModelShape, dtype: mx.Dtype) -> tuple[float, float]:
    """(attention's arithmetic a ms over a prefill chunk, KV bytes a decode step reads a
    ms), through mx.fast.scaled_dot_product_attention as the ranks run it (the CPU
    backend's grouped kernel where server.py installed it)."""
    heads, kv_heads, dim = shape.num_heads, max(1, shape.num_kv_heads), shape.head_dim
    scale = dim**-0.5

    def run(q: mx.array, k: mx.array) -> Any:
        return lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=scale))

    q = mx.full((1, heads, ATTENTION_CHUNK, dim), 0.1, dtype=dtype)
    k = mx.full((1, kv_heads, ATTENTION_CONTEXT, dim), 0.1, dtype=dtype)
    mx.eval(q, k)
    flops = 4 * heads * dim * ATTENTION_CHUNK * ATTENTION_CONTEXT
    prefill = flops / _median_ms(run(q, k), REPEATS)
    q = mx.full((8, heads, 1, dim), 0.1, dtype=dtype)
    k = mx.full((8, kv_heads, 4 * ATTENTION_CONTEXT, dim), 0.1, dtype=dtype)
    mx.eval(q, k)
    decode = 2 * k.nbytes / _median_ms(run(q, k), REPEATS)
    return prefill, decode


def _experts(shape: ModelShape, dtype: mx.Dtype, budget: int) -> float:
    """Arithmetic a ms of routed experts over a prefill's tokens, as the families run them:
    mlx-lm's SwitchGLU (the tokens gathered and sorted by expert, three gather_mm, the
    activation, the order restored), each expert given its share of PREFILL_ROWS tokens'
    routes; 0 without experts. The three products alone read 27-29 GFLOP/s here, one core
    or two, where the whole path ran at 18 on one core (a rank of the 2-rank expert split)
    and 25-27 on two: with the products alone the split's prefill read +28% to +42%."""
    if not shape.num_experts or not shape.expert_size:
        return 0.0
    hidden, columns = shape.hidden_size, shape.expert_size
    count = int(max(1, min(shape.num_experts, budget // (3 * 4 * hidden * columns))))
    routed = max(1, shape.experts_per_token)
    picks = min(count, routed)
    # each expert's rows: its share of PREFILL_ROWS tokens' routes
    tokens = max(1, PREFILL_ROWS * routed * count // (shape.num_experts * picks))
    experts = SwitchGLU(hidden, columns, count)
    experts.update(tree_map(lambda w: mx.full(w.shape, 0.01, dtype=dtype), experts.parameters()))
    x = mx.full((tokens, hidden), 0.5, dtype=dtype)
    index = (mx.arange(tokens * picks, dtype=mx.uint32) % count).reshape(tokens, picks)
    mx.eval(experts.parameters(), x, index)

    def run() -> None:
        mx.eval(experts(x, index))

    return 2 * 3 * tokens * picks * hidden * columns / _median_ms(run, REPEATS)


def probe_budget(shape: ModelShape, activation_bytes: int) -> int:
    """Bytes a probe pass reads: the device's budget, or less for a model smaller than it
    (whose steps never read more: the tests' tiny models probe in milliseconds)."""
    budget = GPU_PROBE_BYTES
    if mx.default_device() != mx.gpu:
        budget = min(max(CPU_PROBE_BYTES, 2 * largest_cache_bytes()), 2**30)
    per_param = bytes_per_param(shape, activation_bytes)
    layer = sum(rows * columns for rows, columns in _layer_shapes(shape))
    model = (layer * shape.num_layers + shape.vocab_size * shape.hidden_size) * per_param
    return int(max(MIN_PROBE_BYTES, min(budget, model)))


def probe_machine(shape: ModelShape, activation_bytes: int, name: str = "") -> Machine:
    """This machine's rates for `shape`'s layers, head and attention, as one rank of it
    sees them now."""
    dtype = {4: mx.float32, 2: mx.bfloat16}.get(activation_bytes, mx.float32)
    gpu = mx.default_device() == mx.gpu
    budget = probe_budget(shape, activation_bytes)
    layers = _Weights(_layer_shapes(shape), shape, dtype, budget)
    layers.ms(1, 1)  # the first pass after the allocation pays the kernel's page work
    quarter = max(1, len(layers.items) // 4)
    rates = [(rows, _slope(layers, rows, quarter)) for rows in DECODE_ROWS]
    # a prefill's many rows: two layers' weights against one are enough arithmetic to time
    one = len(_layer_shapes(shape))
    two = sum(rows * columns for rows, columns in _layer_shapes(shape)) * 4 + 1
    prefill = _Weights(_layer_shapes(shape), shape, dtype, two)  # two layers' weights
    rate = _slope(prefill, PREFILL_ROWS, one)
    rates.append((PREFILL_ROWS, rate))
    params_per_byte = layers.params / layers.nbytes
    # the head as the rank runs it, one matrix the vocabulary's width (as far as the budget
    # goes; four quarters read 25-43% slower at 8 rows than the whole: 8.8 against 7.0 ms,
    # 512 x 49152; 14.0 against 9.8, 576 x 49152), in copies up to the budget (two at
    # least) timed past the first: one copy alone (113 MB) sat in the Xeon host's 260 MB
    # cache and read 39-42 GB/s at 1 row
    head_rows = max(4, min(shape.vocab_size, budget // (shape.hidden_size * 4)))
    one_head = head_rows * shape.hidden_size * dtype.size
    head = _Weights(
        [(head_rows, shape.hidden_size)], shape, dtype, max(budget, 2 * one_head), head=True
    )
    head_rates = [(rows, _slope(head, rows, 1)) for rows in DECODE_ROWS]
    attention_flops, kv_rate = _attention(shape, dtype)
    experts = _experts(shape, dtype, budget)
    mx.clear_cache()
    chip = this_chip()
    return Machine(
        name=name or (f"{chip} (measured)" if chip else "this machine (measured)"),
        memory_bytes=local_memory_bytes(),
        cores=usable_cores(),
        rates=tuple(rates),
        head_rates=tuple(head_rates),
        flops_per_ms=2 * PREFILL_ROWS * rate * params_per_byte,
        attention_flops_per_ms=attention_flops,
        kv_bytes_per_ms=kv_rate,
        expert_flops_per_ms=experts,
        chip=known_chip(chip),
        overhead=GPU_OVERHEAD if gpu else CPU_OVERHEAD,
    )


# ---- the link ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkTimes:
    """The median ms of all_sums of each size (bytes), one pass of the link's probe."""

    sizes: tuple[int, ...]
    times: tuple[float, ...]

    def fastest(self, other: LinkTimes) -> LinkTimes:
        """Size by size, the cheaper of two passes: noise only ever adds to a collective."""
        return LinkTimes(self.sizes, tuple(map(min, self.times, other.times)))

    def fit(self, backend: str, ranks: int) -> Link:
        """A fixed cost plus a cost per byte, fitted to the times."""
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


def probe_link(group: mx.distributed.Group, shape: ModelShape, activation_bytes: int) -> LinkTimes:
    """All_sums of a step's sizes (the step plan, the hidden state of 1 to PREFILL_ROWS
    rows), each timed LINK_REPEATS times."""
    dtype = {4: mx.float32, 2: mx.bfloat16}.get(activation_bytes, mx.float32)
    arrays = [mx.zeros((4096,), dtype=mx.uint8)] + [
        mx.zeros((rows, shape.hidden_size), dtype=dtype) for rows in (1, 8, 16, PREFILL_ROWS)
    ]
    sizes, times = [], []
    for array in arrays:
        mx.eval(array)

        def run(array: mx.array = array) -> None:
            mx.eval(mx.distributed.all_sum(array, group=group))

        sizes.append(array.nbytes)
        times.append(_median_ms(run, LINK_REPEATS))
    return LinkTimes(tuple(sizes), tuple(times))


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
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))
    ranks = group.size()
    first = probe_link(group, shape, activation_bytes) if ranks > 1 else None
    machine = probe_machine(shape, activation_bytes)
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
        mine["link"] = [link.latency_us, link.gb_s]
    records = all_records(group, mine)
    machines = per_host(records, hosts)
    crowding = crowding_of(hosts)
    if link is None:
        link = Link("none (one rank)", 0.0, 1.0, "ring", "one rank: no collectives")
    elif max(crowding) > 1.0 and len({h.host for h in hosts}) == 1:
        link = crowded_link(link, ranks, hosts[0].cores)
    else:  # every rank timed the same all_sums: their mean, the same on every rank
        latency = sum(r["link"][0] for r in records) / len(records)
        rate = sum(r["link"][1] for r in records) / len(records)
        link = Link(link.name, latency, rate, link.topology, link.source)
    return Speed(machines, link, crowding, rates_shared=True)


def crowded_link(measured: Link, ranks: int, cores: int) -> Link:
    """The link of ranks that outnumber their one host's cores: their all_sums timed the
    scheduler's turns (1.0-4.0 ms a hop over nine starts of 3 ranks on 2 cores, the
    steps' waits 3.0-3.8 ms a hop), not the loopback, so its table figure stands and the
    step-time model adds each hop's wait (CROWDED_HOP_MS)."""
    local = link_named("ring-local")
    log.info(
        "link: %d ranks on %d cores of one host timed %.0f us a hop, the scheduler's turns;"
        " the loopback's %.0f us + %.1f GB/s taken, and each hop's wait for the scheduler",
        ranks,
        cores,
        measured.latency_us,
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
