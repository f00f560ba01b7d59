"""The family registry and what the planner makes of MoE and MLA models (no ranks started):
real configs' shapes, expert and head splits, refusals, KV and weight memory predictions,
and docs/MODELS.md generated from the registry."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config.settings import Settings
from distributed.families import FAMILIES, model_types, registered
from distributed.families.table import BEGIN, DOC, END, table
from distributed.hosts import RankHost
from distributed.memory import DoesNotFit, check_fit, kv_bytes
from distributed.model_shape import PlanError
from distributed.plan import make_plan
from distributed.plan_text import describe
from launcher.plan_check import check
from tests.support.family_configs import MLX_LM_CONFIGS
from tests.support.tiny_families import mlx_lm_module, write_family_model

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
    "quantization": {"group_size": 64, "bits": 4},
}
CODER_V2_LITE = {
    **DEEPSEEK_V3,
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "vocab_size": 102400,
}
GPT_OSS_120B = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2880,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_every_model_type_belongs_to_one_family() -> None:
    seen = [t for family in FAMILIES for t in family.model_types]
    assert len(seen) == len(set(seen)) == len(model_types())
    for family in FAMILIES:
        assert ("expert" in family.splits) == (family.moe is not None), family.name
        assert all(registered(t) is family for t in family.model_types)
    assert registered("kimi_k2") is registered("deepseek_v3")
    assert registered("gemma3") is None


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.via_mlx_lm], ids=lambda f: f.name)
def test_mlx_lm_families_claim_a_pipeline_exactly_where_mlx_lm_has_one(family) -> None:
    config = copy.deepcopy(MLX_LM_CONFIGS[family.name])
    config.get("text_config", config).setdefault("vocab_size", 256)
    module = mlx_lm_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    assert family.mlx_lm_pipeline == hasattr(model.model, "pipeline")


def test_mlx_lm_pipeline_sizes_layers_by_weight_last_layers_on_rank_zero() -> None:
    qwen3_5 = {
        "model_type": "qwen3_5",
        "text_config": {
            **QWEN3_30B_A3B,
            "model_type": "qwen3_5_text",
            "full_attention_interval": 4,
        },
    }
    plan = make_plan(qwen3_5, 3, [2, 1, 1], "pipeline")
    assert plan.strategy == "pipeline" and plan.via_mlx_lm
    assert [r.layers for r in plan.ranks] == [(24, 48), (12, 24), (0, 12)]
    assert all(r.embeddings and r.head for r in plan.ranks)  # mlx-lm embeds and heads on all
    per_layer = 4 * 2 * 128 * 2  # every KV head of each local layer (bf16 keys and values)
    assert [per_token for per_token, _ in kv_bytes(plan, 2)] == [
        24 * per_layer,
        12 * per_layer,
        12 * per_layer,
    ]
    assert "through mlx-lm's pipeline()" in describe(plan)[0]
    assert make_plan(qwen3_5, 2, None, "tensor").strategy == "tensor-even"
    with pytest.raises(PlanError, match="iquestloopcoder has no pipeline split"):
        make_plan({**MLX_LM_CONFIGS["iquestloopcoder"], "vocab_size": 256}, 2, None, "pipeline")
    windows = make_plan({**MLX_LM_CONFIGS["step3p5"], "vocab_size": 256}, 2, None, "pipeline")
    assert not windows.via_mlx_lm and windows.shape.sliding_layers == (0,)  # our stage


def test_models_doc_table_is_generated_from_the_registry() -> None:
    text = DOC.read_text()
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert generated == table(), "run `python -m distributed.families.table --write`"


def test_moe_tensor_plan_splits_heads_experts_and_vocabulary_by_weight() -> None:
    plan = make_plan(QWEN3_30B_A3B, 3, [2, 1, 1], "tensor")
    assert plan.strategy == "tensor-uneven" and plan.split_experts and plan.split_heads
    assert [r.experts for r in plan.ranks] == [(0, 64), (64, 96), (96, 128)]
    assert [r.kv_heads for r in plan.ranks] == [(0, 2), (2, 3), (3, 4)]
    assert plan.ranks[0].vocab[0] == 0 and plan.ranks[-1].vocab[1] == 151936
    assert "by heads + experts + vocabulary" in describe(plan)[0]
    assert "experts 0-63 (64)" in describe(plan)[1]


def test_moe_attention_stays_whole_where_heads_cannot_split() -> None:
    plan = make_plan(QWEN3_30B_A3B, 5, None, "tensor")  # 4 KV heads, 5 ranks
    assert plan.is_tensor and plan.split_experts and not plan.split_heads
    assert "attention whole on every rank" in plan.note and "4 KV heads" in plan.note
    assert all(r.kv_heads == (0, 4) for r in plan.ranks)
    assert "attention whole" in describe(plan)[1]


def test_dense_models_still_refuse_heads_that_cannot_split() -> None:
    dense = {**QWEN3_30B_A3B, "model_type": "qwen3"}
    with pytest.raises(PlanError, match="4 KV heads, fewer than 5 ranks"):
        make_plan(dense, 5, None, "tensor")


def test_too_few_experts_refuse_expert_parallel_with_alternatives() -> None:
    few = {**QWEN3_30B_A3B, "num_experts": 4, "num_key_value_heads": 8}
    with pytest.raises(PlanError, match="4 experts, fewer than 5 ranks") as caught:
        make_plan(few, 5, None, "tensor")
    assert "PARALLELISM=pipeline works with 5 ranks" in str(caught.value)


def test_mla_splits_by_head_and_its_latent_cache_stays_whole() -> None:
    plan = make_plan(DEEPSEEK_V3, 3, [2, 1, 1], "tensor")
    assert [r.q_heads for r in plan.ranks] == [(0, 64), (64, 96), (96, 128)]
    assert [r.experts for r in plan.ranks] == [(0, 128), (128, 192), (192, 256)]
    latent = 61 * (512 + 64) * 2  # bf16 latent + roped key per layer, on every rank
    assert [per_token for per_token, _ in kv_bytes(plan, 2)] == [latent] * 3
    lite = make_plan(CODER_V2_LITE, 2, None, "tensor")
    per_head = 27 * (128 + 64 + 128) * 2  # deepseek_v2 caches full keys and values per head
    assert [per_token for per_token, _ in kv_bytes(lite, 2)] == [8 * per_head] * 2
    assert lite.shape.dense_layers == 1 and lite.shape.shared_size == 2 * 1408


def test_gpt_oss_mxfp4_experts_split_by_expert_and_windows_cost_per_sequence() -> None:
    plan = make_plan(GPT_OSS_120B, 3, [2, 1, 1], "auto")
    assert plan.is_tensor and not plan.shape.quantized  # only the experts are mxfp4
    assert [r.experts for r in plan.ranks] == [(0, 64), (64, 96), (96, 128)]
    assert plan.shape.sliding_layers == tuple(range(0, 36, 2))
    per_token, window = kv_bytes(plan, 2)[0]
    assert per_token == 18 * 2 * 4 * 64 * 2  # 18 full layers, rank 0's 4 KV heads
    assert window == 18 * 2 * 4 * 64 * 2 * 128


def test_quantized_shared_experts_too_narrow_to_split_stay_whole_on_rank_zero() -> None:
    narrow = {**CODER_V2_LITE, "n_shared_experts": 1, "moe_intermediate_size": 128}
    plan = make_plan(narrow, 3, None, "tensor")  # 128 columns: 2 groups of 64 for 3 ranks
    assert [r.shared_columns for r in plan.ranks] == [(0, 128), (0, 0), (0, 0)]
    assert "shared experts whole on rank 0" in plan.note


def test_unregistered_families_are_refused_by_name() -> None:
    with pytest.raises(PlanError, match="'gemma3' cannot be split: it is not in the family"):
        make_plan({**QWEN3_30B_A3B, "model_type": "gemma3"}, 2, None, "auto")
    assert make_plan({**QWEN3_30B_A3B, "model_type": "gemma3"}, 1, None).strategy == "single"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


def test_fits_predicts_each_rank_and_refuses_a_short_one(tiny_moe: Path) -> None:
    roomy = [RankHost(host=f"mac{i}", cores=8, memory_bytes=2**34) for i in range(3)]
    report = check_fit(tiny_moe, roomy, [2, 1, 1], "tensor", 8, 4096)
    weights = [r.weight_bytes for r in report.ranks]
    assert weights[0] > 1.8 * weights[1] and weights[1] > 0
    assert report.ranks[1].kv_bytes == 8 * 4096 * report.ranks[1].kv_bytes_per_token
    short = [roomy[0], roomy[1], RankHost(host="mini", cores=8, memory_bytes=2**20)]
    with pytest.raises(DoesNotFit, match=r"rank 2 on mini needs .* short by") as caught:
        check_fit(tiny_moe, short, [2, 1, 1], "tensor", 8, 4096)
    assert caught.value.report.ranks[2].short_bytes > 0
    assert "What would work" in str(caught.value)


def test_plan_command_prints_memory_and_exits_2_when_short(
    tiny_moe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(_env_file=None, num_devices=2, parallelism="tensor")
    assert check(settings, tiny_moe, speed=False) == 0  # the speeds: tests/test_launch.py
    out = capsys.readouterr().out
    assert "by heads + mlp columns + experts + vocabulary" in out and "fits" in out
    huge = Settings(_env_file=None, num_devices=2, max_sequence_length=10**9, max_batch_size=256)
    assert check(huge, tiny_moe, speed=False) == 2
    assert "short by" in capsys.readouterr().err


moe_configs = st.builds(
    lambda kv, group, experts, shared, layers, dense, bits: {
        **QWEN3_30B_A3B,
        "model_type": "glm4_moe",
        "hidden_size": 256,
        "num_key_value_heads": kv,
        "num_attention_heads": kv * group,
        "head_dim": 64,
        "n_routed_experts": experts,
        "moe_intermediate_size": 128,
        "n_shared_experts": shared,
        "num_hidden_layers": layers,
        "first_k_dense_replace": min(dense, layers - 1),
        "intermediate_size": 512,
        **({"quantization": {"group_size": 64, "bits": bits}} if bits else {}),
    },
    kv=st.integers(1, 8),
    group=st.integers(1, 4),
    experts=st.integers(1, 64),
    shared=st.integers(0, 2),
    layers=st.integers(2, 12),
    dense=st.integers(0, 3),
    bits=st.sampled_from([None, 4]),
)


@settings(max_examples=200, deadline=None)
@given(cfg=moe_configs, weights=st.lists(st.floats(0.2, 5), min_size=2, max_size=6))
def test_every_moe_plan_gives_each_expert_row_and_column_to_one_rank(
    cfg: dict, weights: list[float]
) -> None:
    try:
        plan = make_plan(cfg, len(weights), weights, "tensor")
    except PlanError as exc:
        assert "What would work" in str(exc)
        assert cfg["n_routed_experts"] < len(weights) or "MLP" in str(exc)
        return
    ranks = plan.ranks
    assert _covers([r.experts for r in ranks], cfg["n_routed_experts"])
    assert _covers([r.vocab for r in ranks], cfg["vocab_size"])
    shared = [r.shared_columns for r in ranks]
    width = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    assert _covers(shared, width) or shared == [(0, width)] + [(0, 0)] * (len(ranks) - 1)
    if plan.split_heads:
        assert _covers([r.kv_heads for r in ranks], cfg["num_key_value_heads"])
    else:
        assert all(r.kv_heads == (0, cfg["num_key_value_heads"]) for r in ranks)
    # Weight follows the experts: a heavier rank never holds fewer experts.
    counts = [end - start for start, end in (r.experts for r in ranks)]
    if cfg["n_routed_experts"] >= 4 * len(weights):
        for i in range(len(weights) - 1):
            if weights[i] > 1.5 * weights[i + 1]:
                assert counts[i] >= counts[i + 1], (weights, counts)


def _covers(spans: list[tuple[int, int]], total: int) -> bool:
    """Contiguous, non-empty ranges from 0 to `total`."""
    return (
        spans[0][0] == 0
        and spans[-1][1] == total
        and all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
        and all(start < end for start, end in spans)
    )


def test_launch_status_shows_what_an_moe_plan_splits() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "status_summary", Path(__file__).resolve().parents[1] / "scripts" / "status_summary.py"
    )
    assert spec is not None and spec.loader is not None
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    plan = make_plan(QWEN3_30B_A3B, 3, [2, 1, 1], "tensor").model_dump(mode="json")
    lines = summary.summarise({"state": "ready", "world_size": 3, "plan": plan})
    assert "plan tensor-uneven by heads + experts + vocabulary" in lines[0]
    assert "experts 0-64" in lines[1] and "vocab 0-" in lines[1]
    model = {"predicted_decode_ms": {"1": 30.0}, "expert_load": 0.61}
    lines = summary.summarise(
        {"state": "ready", "world_size": 3, "plan": plan, "step_model": model}
    )
    assert "expert split: the busiest rank takes 61% of the routes" in lines


def test_the_plan_names_each_ranks_longest_context_and_lowers_the_models(
    tiny_moe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MAX_SEQUENCE_LENGTH empty: the model's context (4096 here), lowered to what every
    rank holds at MAX_BATCH_SIZE beside its weights, prefix cache and runtime overhead
    (distributed/overhead.py); under 256 refused."""
    roomy = [RankHost(host=f"mac{i}", cores=8, memory_bytes=2**34) for i in range(2)]
    report = check_fit(tiny_moe, roomy, None, "tensor", 8)
    assert report.sequence_length == 4096  # the model's own
    assert all(r.longest_context and r.longest_context > 4096 for r in report.ranks)
    weights = max(r.weight_bytes for r in report.ranks)
    per_token = max(r.kv_bytes_per_token for r in report.ranks)
    runtime = max(r.overhead_bytes for r in report.ranks)
    assert 0 < runtime < 2**30
    # a machine that leaves each rank room for 1000 tokens x 8 sequences after the prefix
    # cache's quarter of what the weights leave, and the runtime's overhead
    tight = 2 * (weights + int((runtime + 1000 * 8 * per_token) / 0.75)) + 2**12
    small = [RankHost(host="mini", cores=8, memory_bytes=tight)] * 2
    lowered = check_fit(tiny_moe, small, None, "tensor", 8)
    assert 900 <= lowered.sequence_length < 1100
    assert lowered.sequence_length == min(r.longest_context or 0 for r in lowered.ranks)
    assert "longest context at MAX_BATCH_SIZE=8" in "\n".join(lowered.describe())
    tiny = [RankHost(host="mini", cores=8, memory_bytes=2 * weights + 2**14)] * 2
    with pytest.raises(DoesNotFit, match="under 256"):
        check_fit(tiny_moe, tiny, None, "tensor", 8)


def test_the_plan_counts_quantized_kv(tiny_moe: Path) -> None:
    roomy = [RankHost(host=f"mac{i}", cores=8, memory_bytes=2**34) for i in range(2)]
    plain = check_fit(tiny_moe, roomy, None, "tensor", 8, 4096)
    eight = check_fit(tiny_moe, roomy, None, "tensor", 8, 4096, kv_bits=8)
    for a, b in zip(plain.ranks, eight.ranks, strict=True):
        # float32 here: 4 bytes an element against 1 + 2 x 4 / 64
        assert b.kv_bytes_per_token == math.ceil(a.kv_bytes_per_token * 1.125 / 4)
        assert b.longest_context is not None and a.longest_context is not None
        assert b.longest_context > 3 * a.longest_context
    assert "8 bits (KV_CACHE_BITS)" in "\n".join(eight.describe())
