"""The step-time model against other systems' published figures on Macs: each row's model
described by its published config.json values (no weights are downloaded), its machines by
their chips (distributed/chips.py), its link by kind, and its split as that system ran it.

    .venv/bin/python -m bench.published   # docs/BENCHMARKS.md's table, as markdown

The split is the published system's, not ours: mlx-lm's shard() and exo's tensor parallel
split every head and every expert's columns evenly (the plan's `via_mlx_lm`), with two
all_sums a layer and the head whole on every rank; their pipelines hand the hidden state
from stage to stage. Bytes a parameter are the published quantization's (affine: bits plus
two 16-bit values a group; mxfp4: 4 bits plus an 8-bit scale per 32).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from distributed.chips import chip_named, link_named
from distributed.memory import element_bytes, kv_bytes
from distributed.model_shape import PlanError
from distributed.plan import Plan, make_plan
from distributed.plan_speed import DECODE_CONTEXT
from distributed.step_model import Machine, Speed, predict
from distributed.step_work import PlanWork, plan_work

# Published config.json values (the fields the planner reads), by model.
QWEN3_14B = {  # huggingface.co/Qwen/Qwen3-14B/blob/main/config.json
    "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}  # fmt: skip
QWEN3_235B = {  # huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
    "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960,
}  # fmt: skip
DEEPSEEK_V3 = {  # huggingface.co/deepseek-ai/DeepSeek-V3.1/blob/main/config.json
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rope_scaling": {"factor": 40, "type": "yarn"},
}  # fmt: skip
# Kimi K2.5's text model (huggingface.co/moonshotai/Kimi-K2.5, config.json text_config):
# DeepSeek V3's shape with 384 experts, 64 heads and one dense layer.
KIMI_K25 = DEEPSEEK_V3 | {
    "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_routed_experts": 384, "first_k_dense_replace": 1, "vocab_size": 163840,
    "max_position_embeddings": 262144,
}  # fmt: skip
GPT_OSS_120B = {  # huggingface.co/openai/gpt-oss-120b/blob/main/config.json
    "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
    "vocab_size": 201088, "sliding_window": 128, "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
}  # fmt: skip

SEEDS_001 = "the seeds' 001 (mlx_distributed_ring_inference_v2 README, 'Performance')"
SEEDS_003 = "the seeds' 003 (vllm-mlx distributed guide, 'Performance Expectations')"
GEERLING = "jeffgeerling.com/blog/2025/15-tb-vram-on-mac-studio-rdma-over-thunderbolt-5"
EXO_2070 = "github.com/exo-explore/exo/issues/2070"


def affine(bits: int, group: int = 64) -> float:
    return bits / 8 + 4 / group  # a 16-bit scale and bias per group


MXFP4 = 4 / 8 + 1 / 32


@dataclass(frozen=True)
class Row:
    name: str
    config: dict
    chip: str
    memory_gb: int
    ranks: int
    split: str  # "shard" (mlx-lm's / exo's tensor parallel), "pipeline", "single"
    link: str
    dense_bytes: float  # a dense parameter's bytes
    expert_bytes: float  # a routed expert parameter's
    clients: int
    published: float  # tok/s, all clients together
    source: str


ROWS = (
    Row("Qwen3-14B 4-bit, 2 x Mac mini M4 16 GB, TCP over Thunderbolt", QWEN3_14B, "M4",
        16, 2, "shard", "ring-thunderbolt", affine(4), affine(4), 1, 12.0, SEEDS_001),
    Row("Kimi K2.5 4-bit, 2 x Mac Studio 512 GB, RDMA", KIMI_K25, "M3 Ultra", 512, 2,
        "shard", "jaccl", affine(4), affine(4), 1, 20.9, SEEDS_003),
    Row("Kimi K2.5 4-bit, same, 4 clients", KIMI_K25, "M3 Ultra", 512, 2, "shard", "jaccl",
        affine(4), affine(4), 4, 27.0, SEEDS_003),
    *(
        Row(f"Qwen3-235B-A22B 8-bit, {n} x Mac Studio M3 Ultra, exo RDMA", QWEN3_235B,
            "M3 Ultra", 512, n, "shard" if n > 1 else "single", "jaccl", affine(8),
            affine(8), 1, tok, GEERLING)
        for n, tok in ((1, 19.5), (2, 26.2), (4, 31.9))
    ),
    *(
        Row(f"DeepSeek V3.1 8-bit, {n} x Mac Studio M3 Ultra, exo RDMA", DEEPSEEK_V3,
            "M3 Ultra", 512 if n < 4 else 256, n, "shard" if n > 1 else "single", "jaccl",
            affine(8), affine(8), 1, tok, GEERLING)
        for n, tok in ((1, 21.1), (2, 27.8), (4, 32.5))
    ),
    Row("gpt-oss-120b (MXFP4 experts, 8-bit rest), 1 x MacBook Pro M5 Max", GPT_OSS_120B,
        "M5 Max", 128, 1, "single", "jaccl", affine(8), MXFP4, 1, 89.0, EXO_2070),
    Row("gpt-oss-120b, 2 x M5 Max, pipeline over TCP (exo)", GPT_OSS_120B, "M5 Max", 128, 2,
        "pipeline", "ring-thunderbolt", affine(8), MXFP4, 1, 68.0, EXO_2070),
    Row("gpt-oss-120b, 2 x M5 Max, MLX tensor parallel over RDMA", GPT_OSS_120B, "M5 Max",
        128, 2, "shard", "jaccl", affine(8), MXFP4, 1, 98.0, EXO_2070),
)  # fmt: skip


def plan_for(row: Row) -> Plan:
    kind = {"shard": "tensor", "pipeline": "pipeline", "single": "auto"}[row.split]
    plan = make_plan(row.config, row.ranks, None, kind)
    if row.split == "shard":  # their even split of every head and expert's columns
        plan = plan.model_copy(update={"via_mlx_lm": True, "strategy": "tensor-even"})
    return plan


def work_for(row: Row, plan: Plan) -> PlanWork:
    """The plan's work with the row's bytes a parameter (and each rank's weights in them)."""
    activation = 2  # bfloat16 activations and KV
    per_token = [float(t) for t, _ in kv_bytes(plan, element_bytes(activation, None))]
    work = plan_work(plan, activation, per_token)
    ranks = []
    for r in work.ranks:
        params = r.weight_bytes / r.param_bytes
        experts = r.experts_held * r.moe_layers * r.expert_params
        held = (params - experts) * row.dense_bytes + experts * row.expert_bytes
        ranks.append(
            replace(
                r,
                param_bytes=row.dense_bytes,
                expert_param_bytes=row.expert_bytes,
                weight_bytes=held,
            )
        )
    return replace(work, ranks=tuple(ranks))


def predict_row(row: Row) -> tuple[float, str]:
    """(predicted tok/s, what the row says beside it)."""
    try:
        plan = plan_for(row)
    except PlanError as exc:
        return 0.0, f"refused: {exc}"
    work = work_for(row, plan)
    usable = row.memory_gb * 0.75
    heaviest = max(r.weight_bytes for r in work.ranks) / 1e9
    chip = chip_named(row.chip)
    machines = tuple(Machine.of_chip(chip, int(usable * 2**30)) for _ in range(row.ranks))
    step = predict(work, Speed(machines, link_named(row.link)), row.clients, context=DECODE_CONTEXT)
    note = (
        f"{heaviest:.0f} GB of weights on the busiest Mac; step {step.ms:.1f} ms = "
        f"{step.compute_ms:.1f} weights + {step.collective_ms:.1f} links + "
        f"{step.overhead_ms:.1f} overhead"
    )
    if heaviest > usable:
        note = f"does not fit: {heaviest:.0f} GB of weights a Mac, {usable:.0f} GB usable; " + note
    return 1000.0 * row.clients / step.ms, note


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    header = ["published setup", "clients", "published tok/s", "predicted tok/s", "error"]
    print("| " + " | ".join([*header, "the model's terms", "source"]) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in ROWS:
        tokens, note = predict_row(row)
        error = f"{(tokens - row.published) / row.published:+.0%}" if tokens else "-"
        cells = [row.name, str(row.clients), f"{row.published:g}", f"{tokens:.1f}", error]
        print("| " + " | ".join([*cells, note, row.source]) + " |")


if __name__ == "__main__":
    main()
