"""What a MoE decode step's routed expert reads cost, against what the step-time model
charges them (docs/BENCHMARKS.md, "The AMD EPYC host again"): under SORTED_ROUTES routes
mlx-lm's SwitchGLU gathers each route's expert for its row alone, and the model charges
every route a read of its expert at the machine's one-row rate.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    .venv/bin/python -m bench.route_reads [--layers 8] [--rows 8] [--experts 16]
        [--picks 4] [--hidden 512] [--columns 256] [--rounds 3]

`layers` SwitchGLU layers of `experts` experts (the bench MoE's shape by default: 1.57 MB
an expert, 25 MB a layer), float32, and as many with twice the experts. Each pass runs
`rows` rows through every layer: routed as a decode step routes them (each row its
`picks` experts at random, so rows share experts), or each route to an expert of its own
(the twice-as-many layers). Prints both passes' medians, the bytes each read a ms
counting every route, and the first over the second: 1.0 if every route reads its
expert, the touched experts over the routes if a repeated route costs nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.switch_layers import SwitchGLU

from distributed.route_probe import draw_routes


def _layers(count: int, experts: int, hidden: int, columns: int) -> list[SwitchGLU]:
    layers = [SwitchGLU(hidden, columns, experts) for _ in range(count)]
    for layer in layers:
        layer.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.02, layer.parameters()))
        mx.eval(layer.parameters())
    return layers


def _pass_ms(layers: list[SwitchGLU], x: mx.array, routes: mx.array) -> float:
    started = time.perf_counter()
    mx.eval([layer(x, routes) for layer in layers])
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--picks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--columns", type=int, default=256)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    rows, picks, experts = args.rows, args.picks, args.experts
    shared = _layers(args.layers, experts, args.hidden, args.columns)
    own = _layers(args.layers, rows * picks, args.hidden, args.columns)
    x = mx.random.normal((rows, args.hidden))
    distinct = mx.arange(rows * picks, dtype=mx.uint32).reshape(rows, picks)
    routes_bytes = args.layers * rows * picks * 3 * args.hidden * args.columns * 4
    touched = experts * (1 - (1 - picks / experts) ** rows)  # expected, of rows x picks
    for round_index in range(args.rounds + 1):  # the first round warms up
        times: list[list[float]] = [[], []]
        for _ in range(args.passes):
            routed = mx.array(draw_routes(rng, rows, experts, picks))
            mx.eval(routed)
            times[0].append(_pass_ms(shared, x, routed))
            times[1].append(_pass_ms(own, x, distinct))
        step, apart = (statistics.median(t) for t in times)
        if round_index:
            print(
                f"{rows} rows x {picks} of {experts} experts, {args.layers} layers: "
                f"routed {step:.2f} ms, each route its own expert {apart:.2f} ms "
                f"({routes_bytes / apart / 1e6:.1f} GB/s counting every route); routed "
                f"over own {step / apart:.2f} (1.00 if every route reads, "
                f"{touched / (rows * picks):.2f} if a repeated route costs nothing)",
                flush=True,
            )


if __name__ == "__main__":
    main()
