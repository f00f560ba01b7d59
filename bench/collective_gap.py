"""Where a tensor split's step goes beyond the step-time model: the model's forward timed in
a loop on every rank (no server around it), with its collectives and with
`mx.distributed.all_sum` replaced by the identity (wrong numbers, the same compute), beside
the model's prediction from the rates and link the ranks measure now.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.collective_gap \
        [--model DIR] [--ranks 2] [--parallelism tensor]

Starts the ranks itself (MLX_HOSTFILE on 127.0.0.1, one OpenBLAS thread each, as launch.sh
gives 2 ranks on 2 cores) rather than through mlx.launch, whose launcher busy-reads the
ranks' stdin and takes a core. Rank 0 prints one line: the step with and without its
collectives, and the prediction's compute, link and overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

STEPS = 60


def rank_main(model_dir: Path, parallelism: str) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from distributed.hosts import gather_hosts
    from distributed.loader import load_rank_model
    from distributed.memory import activation_bytes, kv_bytes
    from distributed.model_shape import ModelShape
    from distributed.plan import make_plan
    from distributed.step_model import predict
    from distributed.step_probe import measure_speed
    from distributed.step_work import plan_work

    group = mx.distributed.init(strict=True, backend="ring")
    config = json.loads((model_dir / "config.json").read_text())
    plan = make_plan(config, group.size(), None, parallelism)
    model = load_rank_model(model_dir, group, plan)
    real = mx.distributed.all_sum

    def step_ms(collectives: bool) -> float:
        if not collectives:
            mx.distributed.all_sum = lambda x, group=None, stream=None: x  # type: ignore[assignment]
        try:
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([list(range(1, 65))]), cache=cache))
            token, times = mx.array([[5]]), []
            for _ in range(STEPS):
                real(mx.array([1.0]), group=group).item()  # start each step together
                started = time.perf_counter()
                mx.eval(model(token, cache=cache))
                times.append((time.perf_counter() - started) * 1e3)
            return statistics.median(times)
        finally:
            mx.distributed.all_sum = real

    step_ms(True), step_ms(False)  # compile MLX's kernels, fill the caches
    with_, without = step_ms(True), step_ms(False)
    act = activation_bytes(model_dir, config)
    speed = measure_speed(group, ModelShape.from_config(config), act, gather_hosts(group), "ring")
    work = plan_work(plan, act, [float(t) for t, _ in kv_bytes(plan, act)])
    p = predict(work, speed, 1, context=70)
    if group.rank() == 0:
        print(
            f"{plan.strategy} over {group.size()} ranks: a step {with_:.1f} ms, "
            f"{without:.1f} without its collectives; predicted {p.ms:.1f} = compute "
            f"{p.compute_ms:.1f} + link {p.collective_ms:.1f} ({p.collectives} collectives at "
            f"{speed.link.latency_us:.0f} us) + overhead {p.overhead_ms:.1f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--parallelism", default="tensor")
    parser.add_argument("--rank-of", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        rank_main(args.rank_of, args.parallelism)
        return
    from bench.compiled_decode import DEFAULT_MODEL
    from bench.local_ranks import run_local_ranks

    model = Path(args.model) if args.model else DEFAULT_MODEL
    command = [sys.executable, "-m", "bench.collective_gap", "--rank-of", str(model)]
    run_local_ranks(args.ranks, command + ["--parallelism", args.parallelism])


if __name__ == "__main__":
    main()
