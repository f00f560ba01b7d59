"""SwiGLU for MLX's CPU backend: silu(gate) * x, the MLP activation of most mlx-lm families,
with the sigmoid's exponential from engine/cpu_attention.py's `exp2`.

mlx-lm's `swiglu` compiles to one loop, but MLX's CPU backend runs its sigmoid as a scalar
exp and a call to the C library's fmaf per element: 19-21 ms a layer alone over a
512-token prefill chunk of the default model (512 x 1,536; 9% of a prefill's samples in
perf), and 11.0 ms over the 30 layers of a compiled 9-position decode step. Here 2.0-2.2 ms
and 2.0 ms (a few compiled loops of arithmetic), within 3.5e-7 of it, relative
(docs/BENCHMARKS.md, "Figures behind the code").

`exp2` builds 2^i from the float's bits (mx.view), which a shapeless compile cannot trace,
so `swiglu` compiles per shape; to bound those traces, the rows go in blocks of BLOCK (one
trace per block count) and a remainder under BLOCK rows (one per remainder): about
rows / BLOCK + BLOCK traces of a few tens of KB for each width, where a trace per row count
grew 83 MB over 2,000 row counts. Other dtypes keep mlx-lm's own.

`install()` puts it in place of mlx_lm.models.activations.swiglu, and in the family modules
already imported (each binds the name at its import), when the ranks compute on the CPU.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import activations

from engine.cpu_attention import LOG2E, exp2, on_cpu_backend

BLOCK = 64  # rows a compiled block holds
ORIGINAL = activations.swiglu


@mx.compile
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    decay = exp2(-mx.abs(gate) * LOG2E)  # e^-|gate|, in (0, 1]: exp2 takes x <= 0
    sigmoid = mx.where(gate >= 0, 1.0, decay) / (1.0 + decay)
    return gate * sigmoid * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x for float32 arrays of one shape, in blocks of BLOCK rows and a
    remainder; anything else (other dtypes, broadcasting, empty) through mlx-lm's own."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32 or gate.shape != x.shape or not gate.size:
        return ORIGINAL(gate, x)
    width = gate.shape[-1]
    rows = gate.size // width
    gates, xs = gate.reshape(rows, width), x.reshape(rows, width)
    whole = rows - rows % BLOCK
    parts = []
    if whole:
        blocks = (whole // BLOCK, BLOCK, width)
        product = _swiglu(gates[:whole].reshape(blocks), xs[:whole].reshape(blocks))
        parts.append(product.reshape(whole, width))
    if rows > whole:
        parts.append(_swiglu(gates[whole:], xs[whole:]))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return out.reshape(gate.shape)


def install() -> bool:
    """Use `swiglu` on the CPU backend; True when installed."""
    if not on_cpu_backend():
        return False
    activations.swiglu = swiglu
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "swiglu", None) is ORIGINAL:
            module.swiglu = swiglu  # type: ignore[attr-defined]
    return True
