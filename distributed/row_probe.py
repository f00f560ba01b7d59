"""A row's work in a layer beside its products and attention, timed at start on a CPU
(distributed/machine_probe.py; the step-time model's `Machine.row_layer_ms` and
`decode_row_layer_ms`): a prefill row's, on a prompt chunk's rows, and a compiled decode
row's, where MLX's kernels a layer cost more with each row than their elements do."""

from __future__ import annotations

import mlx.core as mx

from distributed.model_shape import ModelShape
from distributed.probe_timing import LONG_PASS_MS, REPEATS, median_ms

ROW_ELEMENTS = 2**20  # the row work's probe: rows of its widest vector, up to this many
DECODE_PROBE_ROWS = (1, 8)  # the decode row's probe: one client's step and a batch's
DECODE_PROBE_LAYERS = 4  # stand-in layers it chains in one compiled step
DECODE_PROBE_CONTEXT = 64  # its buffers' positions (a compiled step's least)
# each of its samples repeats the step this long (a step of 4 layers takes 1-2 ms here: one
# at a time, the slope read 0.065-0.091 ms over three probes)
DECODE_PROBE_SAMPLE_MS = 20.0


def mlp_columns(shape: ModelShape) -> int:
    """A layer's dense MLP columns on average (a MoE layer's shared experts')."""
    dense = shape.dense_layer_count * shape.intermediate_size
    return (dense + shape.moe_layers * shape.shared_size) // max(1, shape.num_layers)


def prefill_row_work(shape: ModelShape, dtype: mx.Dtype, floor_ms: float, max_rows: int) -> float:
    """Ms a row and layer of a prefill's work beside its products and attention: the two
    norms and residual sums over the hidden size, the queries, keys and values into heads
    with their rotation, and the dense MLP's activation over its columns (a MoE layer's
    routed experts' is in their probe; its shared experts' is counted), on ROW_ELEMENTS'
    worth of rows (at most `max_rows`, a prompt chunk's). The default model's layer on 128 to 1,440
    rows, less its products at the probe's rate and its attention timed alone, left
    0.037-0.041 ms a row on the Xeon host; this work takes 0.037-0.040 there (the
    activation 0.030 of it); the bench's MoE model's 0.0065-0.0074, where its prefill
    left 0.004-0.014."""
    hidden, heads, kv_heads, dim = (
        shape.hidden_size, shape.num_heads, max(1, shape.num_kv_heads), shape.head_dim
    )  # fmt: skip
    mlp = mlp_columns(shape)
    widest = max(hidden, heads * dim, mlp)
    rows = max(1, min(max_rows, ROW_ELEMENTS // widest))
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
        if mlp:
            out.append(gate * mx.sigmoid(gate) * up)
        mx.eval(out)

    return median_ms(run, REPEATS, 3 * LONG_PASS_MS, floor_ms) / rows


def decode_row_work(shape: ModelShape, dtype: mx.Dtype, floor_ms: float) -> float:
    """Ms a row adds to a layer of a compiled decode step beside its products and KV reads:
    DECODE_PROBE_LAYERS stand-in layers in one mx.compile, as engine/compiled_decode.py
    runs a step (two norms, the queries and keys rotated at each row's offset, the step's
    keys and values written into buffers of DECODE_PROBE_CONTEXT positions, attention with
    its mask, the MLP's activation, the residual sums), each product a copy of the right
    width in its place (one kernel, as the product is), timed at DECODE_PROBE_ROWS rows:
    the slope a row and layer. On MLX's CPU backend each of a layer's few dozen kernels
    costs tens of microseconds, more with more rows: the default model's compiled steps
    with its products made copies took 19 ms at 1 row and 43 at 8 on the Xeon host (0.11
    ms a row and layer), where the calibrated 0.043 predicted its 8-client steps 24%
    fast; this probe reads 0.045-0.069 in a start there (0.065-0.091 alone), and those
    steps -9% (the same day's runs: -14% calibrated)."""
    hidden, heads, kv_heads, dim = (
        shape.hidden_size, shape.num_heads, max(1, shape.num_kv_heads), shape.head_dim
    )  # fmt: skip
    mlp, context, layers = mlp_columns(shape), DECODE_PROBE_CONTEXT, DECODE_PROBE_LAYERS
    norm = mx.ones((hidden,), dtype=dtype)
    widths = {"q": heads * dim, "k": kv_heads * dim, "v": kv_heads * dim, "o": hidden}
    widths.update({"gate": max(1, mlp), "up": max(1, mlp), "down": hidden})
    # each product's own (equal ones would be computed once: mx.compile merges them)
    outs = {
        name: mx.full((width,), 0.01 + i / 1000, dtype=dtype)
        for i, (name, width) in enumerate(widths.items())
    }
    mx.eval(norm, outs)

    def product(x: mx.array, name: str) -> mx.array:
        return mx.contiguous(x[..., :1] * outs[name])

    def into_heads(x: mx.array, count: int) -> mx.array:
        return x.reshape(x.shape[0], 1, count, dim).transpose(0, 2, 1, 3)

    def rotated(x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(x, dim, traditional=False, base=10000.0, scale=1.0, offset=offset)

    def step(
        h: mx.array, position: mx.array, offset: mx.array, *buffers: mx.array
    ) -> list[mx.array]:
        rows = h.shape[0]
        visible = mx.arange(context) <= position  # the mask, made once a step
        mask = mx.broadcast_to(visible, (rows, 1, 1, context))
        written = []
        for layer in range(layers):
            x = mx.fast.rms_norm(h, norm, 1e-5)
            q = rotated(into_heads(product(x, "q"), heads), offset)
            k = rotated(into_heads(product(x, "k"), kv_heads), offset)
            v = into_heads(product(x, "v"), kv_heads)
            keys = mx.slice_update(buffers[2 * layer], k, position, axes=(2,))
            values = mx.slice_update(buffers[2 * layer + 1], v, position, axes=(2,))
            written += [keys, values]
            attended = mx.fast.scaled_dot_product_attention(
                q, keys, values, scale=dim**-0.5, mask=mask
            )
            h = h + product(attended.transpose(0, 2, 1, 3).reshape(rows, 1, -1), "o")
            x = mx.fast.rms_norm(h, norm, 1e-5)
            if mlp:
                gate, up = product(x, "gate"), product(x, "up")
                h = h + product(gate * mx.sigmoid(gate) * up, "down")
        return [h, *written]

    def timed(rows: int) -> float:
        h = mx.full((rows, 1, hidden), 0.5, dtype=dtype)
        buffers = [mx.zeros((rows, kv_heads, context, dim), dtype=dtype) for _ in range(2 * layers)]
        position, offset = mx.array([context // 2]), mx.full((rows,), context // 2, dtype=mx.int32)
        mx.eval(h, buffers, position, offset)
        compiled = mx.compile(step)

        def run() -> None:
            mx.eval(compiled(h, position, offset, *buffers))

        return median_ms(run, REPEATS, 0.0, max(floor_ms, DECODE_PROBE_SAMPLE_MS))

    few, many = DECODE_PROBE_ROWS
    return max(0.0, (timed(many) - timed(few)) / ((many - few) * layers))
