"""Where a tensor split's step goes beyond the step-time model: the model's forward timed in
a loop on every rank (no server around it), with its collectives and with
`mx.distributed.all_sum` replaced by the identity (wrong numbers, the same compute), beside
the model's prediction from the rates and link the ranks measure now.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.collective_gap \
        [--model DIR] [--ranks 2] [--parallelism tensor] [--prefill 512]

Starts the ranks itself (MLX_HOSTFILE on 127.0.0.1, one OpenBLAS thread each, as launch.sh
gives 2 ranks on 2 cores) rather than through mlx.launch, whose launcher busy-reads the
ranks' stdin and takes a core. Rank 0 prints a line for each of a decode step of 1 and of
8 rows and a prefill (`--prefill` tokens): its time with and without its collectives, and
the prediction's compute, link and overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

STEPS = 60
PREFILLS = 5


def rank_main(model_dir: Path, parallelism: str, prefill: int) -> None:
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

    def forward_ms(collectives: bool, rows: int, prefill: int) -> float:
        """The median ms of a decode step of `rows` rows (or a prefill of `prefill` tokens
        into a fresh cache), every rank starting each together."""
        if not collectives:
            mx.distributed.all_sum = lambda x, group=None, stream=None: x  # type: ignore[assignment]
        try:
            times: list[float] = []
            cache = make_prompt_cache(model)
            if not prefill:  # a context of 64 positions a row
                mx.eval(model(mx.array([list(range(1, 65))] * rows), cache=cache))
            prompt = [[(7 * i) % 1000 + 1 for i in range(prefill)]]
            for _ in range(PREFILLS if prefill else STEPS):
                if prefill:
                    cache = make_prompt_cache(model)
                tokens = mx.array(prompt if prefill else [[5 + row] for row in range(rows)])
                real(mx.array([1.0]), group=group).item()  # start each forward together
                started = time.perf_counter()
                mx.eval(model(tokens, cache=cache))
                times.append((time.perf_counter() - started) * 1e3)
            return statistics.median(times)
        finally:
            mx.distributed.all_sum = real

    act = activation_bytes(model_dir, config)
    work = plan_work(plan, act, [float(t) for t, _ in kv_bytes(plan, act)])
    cases = [("decode 1 row", 1, 0), ("decode 8 rows", 8, 0), (f"prefill {prefill}", 1, prefill)]
    for _, rows, tokens in cases:  # compile MLX's kernels, fill the caches
        forward_ms(True, rows, tokens), forward_ms(False, rows, tokens)
    timed = [(forward_ms(True, r, t), forward_ms(False, r, t)) for _, r, t in cases]
    speed = measure_speed(group, ModelShape.from_config(config), act, gather_hosts(group), "ring")
    if group.rank() == 0:
        print(f"{plan.strategy} over {group.size()} ranks, link {speed.link.latency_us:.0f} us:")
        for (what, rows, tokens), (with_, without) in zip(cases, timed, strict=True):
            p = predict(work, speed, rows, context=0 if tokens else 70, prefill=tokens)
            print(
                f"  {what}: {with_:.1f} ms, {without:.1f} without its collectives; predicted "
                f"{p.ms:.1f} = compute {p.compute_ms:.1f} + link {p.collective_ms:.1f} "
                f"({p.collectives} collectives) + overhead {p.overhead_ms:.1f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--parallelism", default="tensor")
    parser.add_argument("--prefill", type=int, default=512, help="a prefill's tokens")
    parser.add_argument("--rank-of", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        rank_main(args.rank_of, args.parallelism, args.prefill)
        return
    from bench.compiled_decode import DEFAULT_MODEL
    from bench.local_ranks import run_local_ranks

    model = Path(args.model) if args.model else DEFAULT_MODEL
    command = [sys.executable, "-m", "bench.collective_gap", "--rank-of", str(model)]
    run_local_ranks(
        args.ranks,
        command + ["--parallelism", args.parallelism, "--prefill", str(args.prefill)],
    )


if __name__ == "__main__":
    main()
