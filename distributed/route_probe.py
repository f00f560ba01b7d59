"""What a decode step's routed expert reads cost on this machine (`Machine.route_rates`).

Under SORTED_ROUTES routes mlx-lm's SwitchGLU runs each route's expert for its row alone:
a row's routes go to different experts, and the rows of a step share some. Timed with the
model's own expert shape, routes drawn as a step draws them, through as many layers as the
probe's budget holds (past the host's caches), as bytes a ms counting every route. On the
AMD EPYC host, the bench MoE's experts (1.57 MB): a route to an expert of its own read 28
GB/s where the probe's one large matrix read 19 at a row, and 8 rows sharing 16 experts
took 0.65 of that time, a layer's experts sitting in the 32 MiB cache; the step-time model
charged the 8-client step's experts 21 ms where they cost about 9.5 (bench/route_reads.py,
docs/BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count as counting

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.switch_layers import SwitchGLU

from distributed.expert_load import SORTED_ROUTES
from distributed.model_shape import ModelShape

ROUTE_ROWS = (1, 8)  # a decode step's rows probed
DRAWS = 16  # route draws a row count's passes take in turn


def probe_routes(
    shape: ModelShape, dtype: mx.Dtype, budget: int, timer: Callable[[Callable[[], None]], float]
) -> tuple[tuple[int, float], ...]:
    """(rows, bytes a ms counting every route) at each of ROUTE_ROWS whose routes go
    unsorted; () without routed experts. `timer(run)`: ms a call of `run` takes. Where the
    budget holds fewer than all the experts, a draw keeps the routes to those it holds."""
    if not shape.num_experts or not shape.expert_size:
        return ()
    hidden, columns, total = shape.hidden_size, shape.expert_size, shape.num_experts
    picks = max(1, min(total, shape.experts_per_token))
    expert = 3 * hidden * columns * dtype.size
    held = int(max(1, min(total, budget // expert)))
    layers = [
        expert_layer(hidden, columns, held, dtype) for _ in range(max(1, budget // (held * expert)))
    ]
    rng = np.random.default_rng(0)
    rates = []
    for rows in ROUTE_ROWS:
        if rows * picks >= SORTED_ROUTES:
            break
        draws = []
        for _ in range(DRAWS):
            chosen = draw_routes(rng, rows, total, picks).reshape(-1)
            kept = chosen[chosen < held]
            if kept.size:
                draws.append((mx.full((kept.size, hidden), 0.5, dtype=dtype), mx.array(kept)))
        if not draws:
            continue
        mx.eval(draws)
        routed = sum(routes.size for _, routes in draws) / len(draws) * len(layers) * expert
        rates.append((rows, routed / timer(_passes(layers, draws))))
    return tuple(rates)


def expert_layer(hidden: int, columns: int, experts: int, dtype: mx.Dtype) -> SwitchGLU:
    """mlx-lm's SwitchGLU of `experts` experts, its weights filled and evaluated: what
    the probes time (the values do not change the time)."""
    layer = SwitchGLU(hidden, columns, experts)
    layer.update(tree_map(lambda w: mx.full(w.shape, 0.01, dtype=dtype), layer.parameters()))
    mx.eval(layer.parameters())
    return layer


def draw_routes(rng: np.random.Generator, rows: int, experts: int, picks: int) -> np.ndarray:
    """[rows, picks] expert indices (uint32), each row `picks` distinct experts at random,
    as a router picks them: the rows of a step share some."""
    return np.argsort(rng.random((rows, experts)), axis=1)[:, :picks].astype(np.uint32)


def _passes(layers: list[SwitchGLU], draws: list[tuple[mx.array, mx.array]]) -> Callable[[], None]:
    """A pass through every layer, each call the next draw's rows and routes."""
    turn = counting()

    def run() -> None:
        x, routes = draws[next(turn) % len(draws)]
        mx.eval([layer(x, routes[:, None]) for layer in layers])

    return run
