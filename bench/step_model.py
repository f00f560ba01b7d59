"""A decode step-time model: the bytes a step reads over the memory bandwidth, plus its
collectives times their measured cost, plus a fixed part (graph building, plan, sampling)
calibrated once. Checked against measured steps here, then applied to named Mac clusters.

    .venv/bin/python -m bench.step_model --bandwidth run/bench/bandwidth.json \
        --collective-ms 0.12 --all-sums 62 \
        --steps run/bench/steps-after-1.json run/bench/steps-after-2.json ...

    step(R) = fixed + bytes(R) / bandwidth + collectives(R) x cost

- bytes(R): every weight byte of every rank (`weight_bytes` in bench.step_time's report):
  a batch-1 decode step reads all of them once, and local ranks share one memory bus;
- bandwidth: bench.bandwidth's `limit_gb_s` (the highest read rate measured here);
- collectives(R): tensor parallel makes `--all-sums` all_sums a step (counted with
  RING_PROFILE_COLLECTIVES: `forward_all_sums` of bench.step_time --profile-collectives);
  a pipeline of R stages hands the activations on R times (one hop each);
- cost: one all_sum of a step's activations (bench/collectives.py, 2 ranks);
- fixed: calibrated on the 1-rank step (measured minus bytes / bandwidth).

Mac clusters (`CLUSTERS`) are predictions from published specifications and the
assumptions written next to them, not measurements: no Mac runs here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Measured:
    ranks: int
    strategy: str
    weight_bytes: int
    step_ms: float


def load_steps(path: Path, batch: int) -> Measured:
    report = json.loads(path.read_text())
    return Measured(
        ranks=report["ranks"],
        strategy=report.get("strategy", "single"),
        weight_bytes=sum(report["weight_bytes"]),
        step_ms=report[f"batch_{batch}"]["step_ms"],
    )


def collectives(m: Measured, all_sums: int) -> int:
    if m.ranks == 1:
        return 0
    return m.ranks if m.strategy == "pipeline" else all_sums


def predict(m: Measured, fixed_ms: float, gb_s: float, all_sums: int, cost_ms: float) -> float:
    return fixed_ms + m.weight_bytes / gb_s / 1e6 + collectives(m, all_sums) * cost_ms


# ---- Mac clusters -----------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    name: str
    spec_gb_s: float  # each machine's memory bandwidth, Apple's specification
    all_sum_us: float  # ASSUMED cost of one small all_sum between the machines
    active_bytes: float  # bytes one token reads, whole model (active experts only)
    max_rank_share: float  # share of them the busiest machine reads
    all_sums: int  # per decode step
    published: str  # other systems' published figures, for scale


# Qwen3-235B-A22B (config.json: 94 layers, hidden 4096, 64 query / 4 KV heads of 128, 128
# experts of 1536 columns, top 8, vocabulary 151,936, untied head): 21.6 B parameters read
# per token (attention 71.3 M and 8 experts 151 M a layer, the head 622 M); affine 4-bit
# with group 64 stores 4.5 bits a parameter: 12.2 GB a token. Expert parallel over 2
# machines: each holds half the heads, experts and vocabulary; the busier machine computes
# on average 5.1 of the 8 routed experts (the expected max of a Binomial(8, 1/2) split),
# so it reads 59% of the token's bytes. All_sums: 2 a layer (attention, experts) + 1
# (vocabulary) = 189.
QWEN3_235B_4BIT = 21.6e9 * 4.5 / 8
PUBLISHED = (
    "other systems, two M3 Ultra (not M2): Qwen3-VL-235B-A22B with mlx-vlm's distributed "
    "inference 32 tok/s over Thunderbolt, 18 over Ethernet (github.com/Blaizzy/mlx-vlm/"
    "pull/730); Kimi K2 class MoE, MLX TP=2 over JACCL 20.1 tok/s (huggingface.co/"
    "moonshotai/Kimi-K2.7-Code/discussions/7)"
)
RING = Cluster(
    name="Qwen3-235B-A22B 4-bit, 2 x M2 Ultra 192 GB, ring over Thunderbolt",
    spec_gb_s=800,
    all_sum_us=60,
    active_bytes=QWEN3_235B_4BIT,
    max_rank_share=0.59,
    all_sums=189,
    published=PUBLISHED,
)
CLUSTERS = [
    RING,
    replace(
        RING,
        name="Qwen3-235B-A22B 4-bit, 2 x M2 Ultra 192 GB, jaccl (RDMA)",
        all_sum_us=15,
    ),
]
# ASSUMED: MLX's batch-1 decode reaches this fraction of the specified bandwidth on Apple
# GPUs, and graph building overlaps the GPU's work (async_eval), so it adds nothing.
MAC_BANDWIDTH_FRACTION = 0.7


def mac_step_ms(cluster: Cluster) -> tuple[float, float]:
    """(memory ms, collective ms) of one batch-1 decode step."""
    gb_s = cluster.spec_gb_s * MAC_BANDWIDTH_FRACTION
    memory = cluster.active_bytes * cluster.max_rank_share / gb_s / 1e6
    return memory, cluster.all_sums * cluster.all_sum_us / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", type=Path, required=True)
    parser.add_argument("--steps", type=Path, nargs="+", required=True)
    parser.add_argument("--collective-ms", type=float, required=True)
    parser.add_argument("--all-sums", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    gb_s = json.loads(args.bandwidth.read_text())["limit_gb_s"]
    measured = sorted((load_steps(p, args.batch) for p in args.steps), key=lambda m: m.ranks)
    one = measured[0]
    assert one.ranks == 1, "the first steps file must be the 1-rank run (the calibration)"
    fixed = one.step_ms - one.weight_bytes / gb_s / 1e6
    print(f"bandwidth {gb_s} GB/s; fixed part {fixed:.1f} ms (calibrated on 1 rank)")
    print("| ranks | plan | bytes read | collectives | predicted ms | measured ms | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in measured:
        predicted = predict(m, fixed, gb_s, args.all_sums, args.collective_ms)
        error = (predicted - m.step_ms) / m.step_ms
        print(
            f"| {m.ranks} | {m.strategy} | {m.weight_bytes / 2**20:.0f} MiB | "
            f"{collectives(m, args.all_sums)} | {predicted:.1f} | {m.step_ms:.1f} | "
            f"{error:+.0%} |"
        )
    print()
    print(f"Predictions (assumed {MAC_BANDWIDTH_FRACTION:.0%} of the specified bandwidth):")
    print("| cluster | memory ms | collectives ms | step ms | tok/s at batch 1 |")
    print("| --- | --- | --- | --- | --- |")
    for cluster in CLUSTERS:
        memory, talk = mac_step_ms(cluster)
        step = memory + talk
        print(f"| {cluster.name} | {memory:.1f} | {talk:.1f} | {step:.1f} | {1e3 / step:.0f} |")
    print(f"\nPublished, for scale: {CLUSTERS[0].published}")


if __name__ == "__main__":
    main()
