"""What expert parallelism saves one rank: the compute of rank 0 of N, in one process.

    .venv/bin/python -m bench.expert_time [--ranks 2 4] [--repeats 3]

Builds the random qwen3_moe of bench/moe_model.py (vocabulary 2048: no tokenizer needed)
and times, in this process's CPU milliseconds (less sensitive to a busy machine than wall
time), a decode step at batch 1 and 8 and a 256-token prefill for:

- whole: the unsplit model;
- local N: rank 0's experts of N, computing only the (token, expert) pairs routed to them
  (distributed/expert_parallel.py, what the ranks run);
- static N: rank 0's experts of N plus an all-zero dummy expert that every other pair is
  sent to, with no sync on the routing (the alternative docs/ARCHITECTURE.md weighs).

Attention, router and head stay whole in every variant, as does the communication: a
group of one makes the all_sum a no-op, so only the local compute is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_moe
from mlx_lm.models.cache import make_prompt_cache

from bench.moe_model import SHAPE
from distributed.expert_parallel import ExpertParallelBlock, LocalExperts
from distributed.families.spec import ExpertParts
from distributed.slicing import keep_rows

PARTS = ExpertParts(block="mlp", experts="switch_mlp", router="gate")


class DummyExperts(nn.Module):
    """Experts [0, count) plus an all-zero expert `count` for every other pair (no sync)."""

    def __init__(self, experts: nn.Module, count: int) -> None:
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(experts, name)
            keep_rows(layer, 0, count)
            zero = mx.zeros((1, *layer.weight.shape[1:]), layer.weight.dtype)
            layer.weight = mx.concatenate([layer.weight, zero])
        self.experts = experts
        self.count = count

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        local = mx.where(indices < self.count, indices, self.count).astype(indices.dtype)
        return self.experts(x, local)


def build(variant: str, ranks: int, group: mx.distributed.Group) -> nn.Module:
    config = dict(SHAPE, vocab_size=2048)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    count = config["num_experts"] // ranks
    for layer in model.model.layers:
        block = layer.mlp
        if variant == "local":
            block.switch_mlp = LocalExperts(block.switch_mlp, 0, count)
            layer.mlp = ExpertParallelBlock(block, group)
        elif variant == "static":
            block.switch_mlp = DummyExperts(block.switch_mlp, count)
            layer.mlp = ExpertParallelBlock(block, group)
    mx.eval(model.parameters())
    return model


def cpu_ms(work: Callable[[], None]) -> float:
    started = time.process_time()
    work()
    return 1000 * (time.process_time() - started)


def measure(model: nn.Module, repeats: int) -> dict[str, float]:
    out = {}
    for batch in (1, 8):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, 2048, (batch, 16)), cache=cache))
        tokens = mx.zeros((batch, 1), dtype=mx.int32) + 3

        def step(cache=cache, tokens=tokens) -> None:
            mx.eval(model(tokens, cache=cache))

        step()
        out[f"decode_b{batch}_ms"] = statistics.median(cpu_ms(step) for _ in range(12))
    prompt = mx.random.randint(0, 2048, (1, 256))
    mx.eval(model(prompt[:, :32]))
    out["prefill_256_ms"] = min(
        cpu_ms(lambda: mx.eval(model(prompt, cache=make_prompt_cache(model))))
        for _ in range(repeats)
    )
    return {key: round(value, 1) for key, value in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    group = mx.distributed.init(strict=False)
    mx.random.seed(0)
    report = {"whole": measure(build("whole", 1, group), args.repeats)}
    for ranks in args.ranks:
        for variant in ("local", "static"):
            report[f"{variant} {ranks}"] = measure(build(variant, ranks, group), args.repeats)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
