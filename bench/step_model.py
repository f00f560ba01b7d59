"""A decode step-time model: the bytes on a step's critical path over the rate a rank reads
and multiplies them, plus the step's collectives times their measured cost, plus the
per-step overhead that no weight causes. Calibrated on one rank here, checked against
measured 2- and 3-rank steps, then applied to named Mac clusters.

    .venv/bin/python -m bench.step_model --overhead run/bench/steps-overhead.json \
        --collective-ms 2=0.044 3=4.5 --all-sums 61 \
        --steps run/bench/steps-1-t1.json run/bench/steps-1.json run/bench/steps-2.json ...

    step = (overhead + critical bytes / rate(T)) x oversubscription + collectives x cost

- overhead: bench.step_time of a model with the same layers and almost no weights
  (`--overhead`): graph building, plan, sampling, streaming;
- critical bytes: tensor parallel, the busiest rank's weight bytes (the ranks compute at
  once); a pipeline, every rank's (its stages run one after another); one rank, all;
- rate(T): the bytes a rank processes per ms with T OpenBLAS threads, calibrated on a
  1-rank run with T threads (its weight bytes over its step less the overhead). On a
  machine that decodes at its memory bandwidth (a Mac's GPU) this is that bandwidth; on
  this CPU it is bound by the kernels, and T matters: local ranks get cores / ranks each;
- oversubscription: ranks over cores when local ranks outnumber them. Ranks waiting in a
  collective poll: a 3-rank pipeline decoding one token kept both cores busy (57 + 75 +
  65% of a core), so the one stage that computes gets 2/3 of a core;
- collectives: tensor parallel makes `--all-sums` all_sums a step (RING_PROFILE_COLLECTIVES
  counts them), a pipeline of R stages hands the activations on R times; cost: one
  all_sum of a step's activations at that rank count (bench/collectives.py).

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
    weight_bytes: tuple[int, ...]  # each rank's
    step_ms: float
    threads: int  # OpenBLAS threads per rank
    cores: int  # of the machine every rank ran on

    @property
    def oversubscription(self) -> float:
        return max(1.0, self.ranks / self.cores)


def load_steps(path: Path, batch: int) -> Measured:
    report = json.loads(path.read_text())
    return Measured(
        ranks=report["ranks"],
        strategy=report.get("strategy", "single"),
        weight_bytes=tuple(report["weight_bytes"]),
        step_ms=report[f"batch_{batch}"]["step_ms"],
        threads=report["threads"],  # bench.step_time records both
        cores=report["cores"],
    )


def collectives(m: Measured, all_sums: int) -> int:
    if m.ranks == 1:
        return 0
    return m.ranks if m.strategy == "pipeline" else all_sums


def critical_bytes(m: Measured) -> int:
    if m.strategy.startswith("tensor"):
        return max(m.weight_bytes)
    return sum(m.weight_bytes)


def rate(one: Measured, overhead_ms: float) -> float:
    """Bytes per ms a rank processes with one's threads (one: a 1-rank run)."""
    return sum(one.weight_bytes) / (one.step_ms - overhead_ms)


def predict(
    m: Measured, overhead_ms: float, bytes_per_ms: float, all_sums: int, cost_ms: float
) -> float:
    compute = overhead_ms + critical_bytes(m) / bytes_per_ms
    return compute * m.oversubscription + collectives(m, all_sums) * cost_ms


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


def _costs(items: list[str]) -> dict[int, float]:
    """["2=0.044", "3=4.5"] -> {2: 0.044, 3: 4.5}"""
    return {int(ranks): float(ms) for ranks, ms in (item.split("=") for item in items)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--overhead", type=Path, required=True)
    parser.add_argument("--steps", type=Path, nargs="+", required=True)
    parser.add_argument("--collective-ms", nargs="+", required=True, help="RANKS=MS ...")
    parser.add_argument("--all-sums", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    costs = _costs(args.collective_ms)
    overhead = load_steps(args.overhead, args.batch).step_ms
    measured = sorted((load_steps(p, args.batch) for p in args.steps), key=lambda m: m.ranks)
    rates = {m.threads: rate(m, overhead) for m in measured if m.ranks == 1}
    print(f"batch {args.batch}: overhead {overhead:.1f} ms a step; rate per rank by OpenBLAS")
    print("threads: " + ", ".join(f"{t}: {r / 1e6:.2f} GB/s" for t, r in sorted(rates.items())))
    columns = "ranks | plan | threads | critical bytes | collectives | predicted ms | measured ms"
    print(f"| {columns} | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in measured:
        if m.threads not in rates:
            print(f"| {m.ranks} | {m.strategy} | {m.threads} | no 1-rank run with these threads |")
            continue
        cost = costs.get(m.ranks, 0.0)
        predicted = predict(m, overhead, rates[m.threads], args.all_sums, cost)
        error = "calibration" if m.ranks == 1 else f"{(predicted - m.step_ms) / m.step_ms:+.0%}"
        print(
            f"| {m.ranks} | {m.strategy} | {m.threads} | {critical_bytes(m) / 2**20:.0f} MiB | "
            f"{collectives(m, args.all_sums)} | {predicted:.1f} | {m.step_ms:.1f} | {error} |"
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
