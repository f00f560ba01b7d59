"""Measure at start what one rank's machine does with the model's weights (the step-time
model's `Machine`, distributed/step_model.py): every rank multiplies rows of activations
against weights shaped like one decoder layer of the model (its attention and MLP
projections, in the model's float type or quantization), repeated past the caches (to
twice the largest): bytes a rank reads per ms at 1, 2, 4, 8 and 16 rows (decode,
speculation) and at PREFILL_ROWS (a prefill's arithmetic); the output head as the rank
runs it; attention's arithmetic and KV reads; routed experts as the families run them; on
a CPU, a prefill row's work in a layer beside those (norms, heads, the MLP's activation).
The ranks probe at once (distributed/step_probe.py), so ranks sharing a host's cores
measure the rate they will get together.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models import activations

from distributed.chips import this_chip
from distributed.hosts import largest_cache_bytes, local_memory_bytes, usable_cores
from distributed.model_shape import ModelShape
from distributed.route_probe import expert_layer, probe_routes
from distributed.shared_cores import Turns, at_once_ms
from distributed.speed_records import known_chip
from distributed.step_model import PREFILL_ROWS, Machine
from distributed.step_overhead import CPU_OVERHEAD, GPU_OVERHEAD
from distributed.step_work import bytes_per_param

DECODE_ROWS = (1, 2, 4, 8, 16)
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
# The prefill's attention probe: a causal chunk of this many rows against itself, as a
# prompt's first chunk runs (the CPU kernel takes it in blocks of rows, each against the
# keys up to its last row, and masks the rest). Counted as the step-time model counts it,
# half the square. On the Xeon host, 9 / 3 heads of 64: 512 rows read 19-21 GFLOP/s so
# counted, 1,024 / 1,440 / 2,048 rows 20 / 18-19 / 20, 256 rows after 2,048 cached 18;
# the 128 rows against 512 unmasked keys probed before read 33, which made a 1,440-token
# prefill's attention 71 ms a layer where it took 125 (the dense prefills' +6% to +32%).
ATTENTION_CHUNK = 512
DECODE_CONTEXT = 2048  # keys a decode probe's rows read
ROW_ELEMENTS = 2**20  # the row work's probe: rows of its widest vector, up to this many
# Where a host's ranks outnumber its cores, each sample of a probe runs its pass again
# until this long has passed: a pass of a few ms either ran whole or waited out another
# rank's turn of the scheduler, so their median read either (3 ranks on the Xeon host's 2
# cores, nine starts: attention 8.4-17.9 GFLOP/s, the products at a prefill's rows 53-118,
# one row 5.7-11.7 GB/s), and the 3-rank pipeline's prefill was predicted -6% to -35%;
# with these samples, six starts: attention 8.8-13.0, the pipeline's prefill -1% to -17%
CROWDED_SAMPLE_MS = 60.0


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
        head: bool = False, floor_ms: float = 0.0,
    ) -> None:  # fmt: skip
        self.shape, self.dtype, self.floor_ms = shape, dtype, floor_ms
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
        return median_ms(self.pass_of(rows, items), repeats, 3 * LONG_PASS_MS, self.floor_ms)

    def pass_of(self, rows: int, items: int | None = None) -> Callable[[], None]:
        """One pass of `rows` rows through the first `items` weights, to run."""
        chosen = self.items[:items] if items else self.items
        inputs = {w_in: mx.full((rows, w_in), 0.5, dtype=self.dtype) for _, w_in in chosen}
        mx.eval(list(inputs.values()))
        return lambda: mx.eval([self._product(inputs[w_in], w) for w, w_in in chosen])


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


def _attention(
    shape: ModelShape, dtype: mx.Dtype, floor_ms: float, prefill_ms: Callable[[Any], float]
) -> tuple[float, float]:
    """(attention's arithmetic a ms over a causal prefill chunk, timed by `prefill_ms`, KV
    bytes a decode step reads a ms), through mx.fast.scaled_dot_product_attention as the
    ranks run it (the CPU backend's grouped kernel where server.py installed it)."""
    heads, kv_heads, dim = shape.num_heads, max(1, shape.num_kv_heads), shape.head_dim
    scale = dim**-0.5

    def run(q: mx.array, k: mx.array, mask: str | None = None) -> Any:
        attend = mx.fast.scaled_dot_product_attention
        return lambda: mx.eval(attend(q, k, k, scale=scale, mask=mask))

    q = mx.full((1, heads, ATTENTION_CHUNK, dim), 0.1, dtype=dtype)
    k = mx.full((1, kv_heads, ATTENTION_CHUNK, dim), 0.1, dtype=dtype)
    mx.eval(q, k)
    flops = 4 * heads * dim * ATTENTION_CHUNK * ATTENTION_CHUNK / 2
    prefill = flops / prefill_ms(run(q, k, "causal"))
    q = mx.full((8, heads, 1, dim), 0.1, dtype=dtype)
    k = mx.full((8, kv_heads, DECODE_CONTEXT, dim), 0.1, dtype=dtype)
    mx.eval(q, k)
    decode = 2 * k.nbytes / median_ms(run(q, k), REPEATS, floor_ms=floor_ms)
    return prefill, decode


def _experts(
    shape: ModelShape, dtype: mx.Dtype, budget: int, timed: Callable[[Any], float]
) -> float:
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
    experts = expert_layer(hidden, columns, count, dtype)
    x = mx.full((tokens, hidden), 0.5, dtype=dtype)
    index = (mx.arange(tokens * picks, dtype=mx.uint32) % count).reshape(tokens, picks)
    mx.eval(x, index)

    def run() -> None:
        mx.eval(experts(x, index))

    return 2 * 3 * tokens * picks * hidden * columns / timed(run)


def this_cpu() -> str:
    """This machine's CPU as MLX names it ("AMD EPYC"): its overheads' kinds."""
    return str(mx.device_info().get("device_name", ""))


def _row_work(shape: ModelShape, dtype: mx.Dtype, floor_ms: float) -> float:
    """Ms a row and layer of a prefill's work beside its products and attention: the two
    norms and residual sums over the hidden size, the queries, keys and values into heads
    with their rotation, and the dense MLP's activation over its columns (a MoE layer's
    routed experts' is in their probe; its shared experts' is counted), on ROW_ELEMENTS'
    worth of rows (at most ATTENTION_CHUNK). The activation is the one the families call
    (engine/cpu_activation.py's kernel where it is installed): the default model's layer
    on 128 to 1,440 rows, less its products at the probe's rate and its attention timed
    alone, left 0.037-0.041 ms a row on the Xeon host before that kernel, when this work
    took 0.037-0.040 (the activation 0.030 of it); with it, 0.0095-0.0128 (two probes), and
    timing mlx's own activation here had kept 0.0374 and one rank's prefill predicted 18-30%
    slow. The bench's MoE model's 0.0065-0.0074, where its prefill left 0.004-0.014."""
    hidden, heads, kv_heads, dim = (
        shape.hidden_size, shape.num_heads, max(1, shape.num_kv_heads), shape.head_dim
    )  # fmt: skip
    dense, shared = shape.dense_layer_count, shape.moe_layers
    mlp = (dense * shape.intermediate_size + shared * shape.shared_size) // max(1, shape.num_layers)
    widest = max(hidden, heads * dim, mlp)
    rows = max(1, min(ATTENTION_CHUNK, ROW_ELEMENTS // widest))
    x = mx.full((1, rows, hidden), 0.5, dtype=dtype)
    norm = mx.ones((hidden,), dtype=dtype)
    q = mx.full((1, rows, heads * dim), 0.1, dtype=dtype)
    kv = mx.full((1, rows, kv_heads * dim), 0.1, dtype=dtype)
    gate, up = (mx.full((1, rows, max(1, mlp)), 0.1, dtype=dtype) for _ in range(2))
    mx.eval(x, norm, q, kv, gate, up)

    def into_heads(a: mx.array, count: int, rotate: bool) -> mx.array:
        a = a.reshape(1, rows, count, dim).transpose(0, 2, 1, 3)
        if not rotate:
            return a
        return mx.fast.rope(a, dim, traditional=False, base=10000.0, scale=1.0, offset=0)

    def run() -> None:
        h = mx.fast.rms_norm(x, norm, 1e-5) + x
        out = [h, mx.fast.rms_norm(h, norm, 1e-5) + h]
        queries = into_heads(q, heads, True)
        out += [queries.transpose(0, 2, 1, 3).reshape(1, rows, -1)]
        out += [into_heads(kv, kv_heads, True), into_heads(kv, kv_heads, False)]
        if mlp:  # as the families call it: the CPU backend's kernel where it is installed
            out.append(activations.swiglu(gate, up))
        mx.eval(out)

    return median_ms(run, REPEATS, 3 * LONG_PASS_MS, floor_ms) / rows


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


def probe_machine(
    shape: ModelShape,
    activation_bytes: int,
    name: str = "",
    crowded: bool = False,
    turns: Turns | None = None,
) -> Machine:
    """This machine's rates for `shape`'s layers, head and attention, as one rank of it
    sees them now (`crowded`: beside more ranks than the host has cores). With `turns`,
    the ranks sharing the host probe each decode row count at once, and then each alone
    while the others wait (`Machine.alone_rates`): at one row the two read 13-16 and 20-22
    GB/s on the AMD EPYC host, and unsynchronized either came out by chance; a tensor
    split's steps went by the first, a pipeline's by the second (docs/BENCHMARKS.md). A
    prefill's figures they time at once, every rank alike (shared_cores.at_once_ms)."""
    floor = CROWDED_SAMPLE_MS if crowded else 0.0

    def prefill_ms(run: Callable[[], None]) -> float:
        """A prefill's work timed: at once where ranks share the host's cores."""
        if turns is None:
            return median_ms(run, REPEATS, floor_ms=floor)
        return at_once_ms(turns, run)

    dtype = {4: mx.float32, 2: mx.bfloat16}.get(activation_bytes, mx.float32)
    gpu = mx.default_device() == mx.gpu
    budget = probe_budget(shape, activation_bytes)
    layers = _Weights(_layer_shapes(shape), shape, dtype, budget, floor_ms=floor)
    layers.ms(1, 1)  # the first pass after the allocation pays the kernel's page work
    quarter = max(1, len(layers.items) // 4)
    rates = []
    for rows in DECODE_ROWS:
        if turns is not None:
            turns.together()
        rates.append((rows, _slope(layers, rows, quarter)))
    alone: list[tuple[int, float]] = []
    if turns is not None:
        alone = turns.each_alone(lambda: [(n, _slope(layers, n, quarter)) for n in DECODE_ROWS])
    # a prefill's many rows: two layers' weights against one are enough arithmetic to time
    one = len(_layer_shapes(shape))
    two = sum(rows * columns for rows, columns in _layer_shapes(shape)) * 4 + 1
    prefill = _Weights(_layer_shapes(shape), shape, dtype, two, floor_ms=floor)  # two layers
    if turns is None:
        rate = _slope(prefill, PREFILL_ROWS, one)
    else:
        rate = prefill.nbytes / prefill_ms(prefill.pass_of(PREFILL_ROWS))
    rates.append((PREFILL_ROWS, rate))
    if alone:  # a pipeline's streamed prefill runs its stages at once
        alone.append((PREFILL_ROWS, rate))
    params_per_byte = layers.params / layers.nbytes
    # the head as the rank runs it, one matrix the vocabulary's width (as far as the budget
    # goes; four quarters read 25-43% slower at 8 rows than the whole: 8.8 against 7.0 ms,
    # 512 x 49152; 14.0 against 9.8, 576 x 49152), in copies up to the budget (two at
    # least; a short pass timed past the first, as `_slope` does): one copy alone (113 MB)
    # sat in the Xeon host's 260 MB cache and read 39-42 GB/s at 1 row
    head_rows = max(4, min(shape.vocab_size, budget // (shape.hidden_size * 4)))
    one_head = head_rows * shape.hidden_size * dtype.size
    head = _Weights(
        [(head_rows, shape.hidden_size)], shape, dtype, max(budget, 2 * one_head), True, floor
    )
    head_rates = [(rows, _slope(head, rows, 1)) for rows in DECODE_ROWS]
    # freed buffers of other sizes held in MLX's cache slowed the probes after the
    # products (the Xeon host): attention 12.5-13 GFLOP/s, 19-21 with the cache emptied
    # first; the bench's MoE experts 19-21 against 25-26 (28-29 probed alone); a prefill's
    # layers reuse their own sizes
    mx.clear_cache()
    attention_flops, kv_rate = _attention(shape, dtype, floor, prefill_ms)
    mx.clear_cache()
    experts = _experts(shape, dtype, budget, prefill_ms)
    mx.clear_cache()
    routes = probe_routes(shape, dtype, budget, lambda run: median_ms(run, REPEATS, floor_ms=floor))
    mx.clear_cache()
    row_work = 0.0 if gpu else _row_work(shape, dtype, floor)
    mx.clear_cache()
    chip = this_chip()
    return Machine(
        name=name or (f"{chip} (measured)" if chip else "this machine (measured)"),
        memory_bytes=local_memory_bytes(),
        cores=usable_cores(),
        rates=tuple(rates),
        alone_rates=tuple(alone),
        head_rates=tuple(head_rates),
        flops_per_ms=2 * PREFILL_ROWS * rate * params_per_byte,
        attention_flops_per_ms=attention_flops,
        kv_bytes_per_ms=kv_rate,
        expert_flops_per_ms=experts,
        route_rates=routes,
        row_layer_ms=row_work,
        chip=known_chip(chip),
        overhead=GPU_OVERHEAD if gpu else CPU_OVERHEAD,
        cpu="" if gpu else this_cpu(),
    )
