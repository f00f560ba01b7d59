"""Split planner: shares, strategies, refusals, the CLI, slicing (property tests over many
configs: tests/test_plan_properties.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from config.settings import parse_rank_weights
from distributed.hosts import RankHost
from distributed.model_shape import PlanError
from distributed.plan import Plan, make_plan, resolve_weights
from distributed.plan_text import describe
from distributed.slicing import slice_columns, slice_rows
from tests.support.plan_parameters import held_parameters

PROJECT = Path(__file__).resolve().parents[1]

SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def config(**changes: object) -> dict:
    return {**SMOLLM2, **changes}


def q4(group_size: int = 32, **changes: object) -> dict:
    return config(quantization={"group_size": group_size, "bits": 4}, **changes)


def test_smollm2_on_two_ranks_is_uneven_tensor_with_whole_kv_groups() -> None:
    plan = make_plan(SMOLLM2, 2, None, "auto")
    assert plan.strategy == "tensor-uneven"
    assert [r.kv_heads for r in plan.ranks] == [(0, 2), (2, 3)]
    assert [r.q_heads for r in plan.ranks] == [(0, 6), (6, 9)]
    # Rank 0's third KV head is made up for with fewer MLP columns and vocabulary rows.
    (a, b), (_, c) = [r.mlp_columns for r in plan.ranks]
    assert (a, c) == (0, 1536) and b < 768
    assert plan.ranks[0].vocab[1] < 49152 // 2


@pytest.mark.parametrize(("world", "weights"), [(2, None), (3, None), (3, [2, 1, 1])])
def test_smollm2_ranks_hold_their_weighted_share_of_parameters(
    world: int, weights: list[float] | None
) -> None:
    plan = make_plan(SMOLLM2, world, weights, "tensor")
    held = held_parameters(plan, SMOLLM2)
    shares = weights or [1.0] * world
    for count, weight in zip(held, shares, strict=True):
        assert count <= 1.01 * sum(held) * weight / sum(shares), (held, shares)


def test_smollm2_on_three_equal_ranks_uses_even_sharding() -> None:
    plan = make_plan(SMOLLM2, 3, None, "tensor")
    assert plan.strategy == "tensor-even"
    assert [r.q_heads for r in plan.ranks] == [(0, 3), (3, 6), (6, 9)]


def test_weights_two_one_one_give_rank_zero_the_most_mlp_columns() -> None:
    plan = make_plan(SMOLLM2, 3, [2, 1, 1], "tensor")
    assert plan.strategy == "tensor-uneven"
    widths = [end - start for start, end in (r.mlp_columns for r in plan.ranks)]
    # One KV head each: rank 0's half of the model comes from MLP columns and vocabulary.
    assert widths[0] > 768 and abs(widths[1] - widths[2]) <= 1


def test_quantized_mlp_moves_in_whole_groups() -> None:
    plan = make_plan(q4(32), 3, [2, 1, 1], "tensor")
    for share in plan.ranks:
        start, end = share.mlp_columns
        assert start % 32 == 0 and end % 32 == 0


def test_pipeline_layers_follow_weights_with_embeddings_first_and_norm_last() -> None:
    plan = make_plan(config(tie_word_embeddings=False), 3, [2, 1, 1], "pipeline")
    assert [r.layers for r in plan.ranks] == [(0, 15), (15, 23), (23, 30)]
    assert [r.embeddings for r in plan.ranks] == [True, False, False]
    assert [r.head for r in plan.ranks] == [False, False, True]
    assert "final norm" in describe(plan)[-1]


def test_pipeline_with_tied_embeddings_keeps_the_head_on_rank_zero() -> None:
    plan = make_plan(SMOLLM2, 2, None, "pipeline")
    assert [r.head for r in plan.ranks] == [True, False]


def test_auto_falls_back_to_pipeline_when_tensor_cannot_split() -> None:
    plan = make_plan(SMOLLM2, 4, None, "auto")
    assert plan.strategy == "pipeline"
    assert [r.layers[1] - r.layers[0] for r in plan.ranks] == [8, 8, 7, 7]


def test_single_rank_holds_everything() -> None:
    plan = make_plan(SMOLLM2, 1, None, "tensor")
    assert plan.strategy == "single" and plan.ranks[0].layers == (0, 30)


def test_plan_dump_round_trips_and_describes_every_rank() -> None:
    plan = make_plan(SMOLLM2, 3, [2, 1, 1], "auto")
    assert Plan.model_validate(plan.model_dump()) == plan
    lines = describe(plan)
    assert len(lines) == 4 and "rank 2 (weight 1)" in lines[3]


@pytest.mark.parametrize(
    ("cfg", "world", "weights", "mode", "reason", "alternative"),
    [
        (SMOLLM2, 4, None, "tensor", "3 KV heads, fewer than 4 ranks", "PARALLELISM=pipeline"),
        (SMOLLM2, 31, None, "pipeline", "30 layers, 31 ranks", "at most 30 ranks"),
        (SMOLLM2, 31, None, "auto", "30 layers, 31 ranks", "NUM_DEVICES=1"),
        (SMOLLM2, 3, [1, 1], "auto", "2 rank weights given for 3 ranks", "RANK_WEIGHTS=1,1,1"),
        (SMOLLM2, 2, [1, 0], "auto", "must all be positive", "2,1,1"),
        (SMOLLM2, 2, [1, -2], "auto", "must all be positive", "2,1,1"),
        (SMOLLM2, 2, [1, math.nan], "auto", "must all be positive", "2,1,1"),
        # head_dim 48 with groups of 32: one KV group per rank puts a cut at column 48.
        (
            q4(32, head_dim=48, num_attention_heads=3),
            3,
            None,
            "tensor",
            "cut a quantization",
            "PARALLELISM=pipeline",
        ),
        (
            q4(64, intermediate_size=1000),
            2,
            None,
            "tensor",
            "quantization groups of 64",
            "pipeline",
        ),
        (config(model_type="gemma3"), 2, None, "auto", "cannot be split", "NUM_DEVICES=1"),
    ],
)
def test_refusals_say_why_and_what_would_work(
    cfg: dict, world: int, weights: list | None, mode: str, reason: str, alternative: str
) -> None:
    with pytest.raises(PlanError) as caught:
        make_plan(cfg, world, weights, mode)
    assert reason in str(caught.value)
    assert alternative in str(caught.value)


def test_refusal_lists_world_sizes_where_tensor_works() -> None:
    with pytest.raises(PlanError, match=r"NUM_DEVICES in \[2, 3\]"):
        make_plan(SMOLLM2, 4, None, "tensor")


def test_per_layer_quantization_overrides_tighten_the_group() -> None:
    cfg = q4(32, head_dim=32, num_attention_heads=6, num_key_value_heads=6)
    assert make_plan(cfg, 2, [1, 2], "tensor").strategy == "tensor-uneven"
    cfg["quantization"]["model.layers.0.self_attn.o_proj"] = {"group_size": 128, "bits": 8}
    with pytest.raises(PlanError, match="cut a quantization group of 128"):
        make_plan(cfg, 2, [1, 2], "tensor")


def test_parse_weights() -> None:
    assert parse_rank_weights("2,1,1") == [2.0, 1.0, 1.0]
    assert parse_rank_weights(" ") is None
    assert parse_rank_weights("auto") == "auto"
    with pytest.raises(ValueError, match="comma-separated numbers"):
        parse_rank_weights("2,x")


def test_cli_prints_the_plan_and_refuses_with_status_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    run = [sys.executable, "-m", "distributed.plan_cli", "--model", str(tmp_path), "--world", "3"]
    done = subprocess.run(
        run + ["--weights", "2,1,1"], capture_output=True, text=True, cwd=PROJECT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0 (weight 2): kv heads 0 (1)" in done.stdout
    bad = subprocess.run(
        run[:-1] + ["5", "--parallelism", "tensor"],
        capture_output=True,
        text=True,
        cwd=PROJECT,
        check=False,
    )
    assert bad.returncode == 2 and "refused:" in bad.stderr


# ---- slicing helpers on one process (the all_sum of a group of one is the identity) ----


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_column_slices_sum_to_the_full_layer_with_the_bias_added_once(bits: int | None) -> None:
    mx.random.seed(1)
    group = mx.distributed.init(strict=False)
    full = nn.Linear(128, 16, bias=True)
    if bits:
        full = nn.QuantizedLinear.from_linear(full, group_size=32, bits=bits)
    x = mx.random.normal((2, 3, 128))
    expected = full(x)
    parts = []
    for start, end in ((0, 64), (64, 128)):
        copy = nn.QuantizedLinear(128, 16, True, 32, bits) if bits else nn.Linear(128, 16)
        copy.update(full.parameters())
        parts.append(slice_columns(copy, start, end, group))
    bias = full["bias"]
    total = parts[0](x[..., :64]) + parts[1](x[..., 64:]) - bias
    assert mx.abs(total - expected).max().item() < 1e-4


def test_row_slices_concatenate_to_the_full_layer() -> None:
    full = nn.QuantizedLinear.from_linear(nn.Linear(64, 96, bias=True), group_size=32, bits=4)
    x = mx.random.normal((1, 2, 64))
    expected = full(x)
    halves = []
    for start, end in ((0, 40), (40, 96)):
        copy = nn.QuantizedLinear(64, 96, True, 32, 4)
        copy.update(full.parameters())
        halves.append(slice_rows(copy, start, end)(x))
    assert mx.abs(mx.concatenate(halves, axis=-1) - expected).max().item() < 1e-5


def test_column_slice_that_cuts_a_group_is_refused() -> None:
    layer = nn.QuantizedLinear(128, 16, False, 32, 4)
    with pytest.raises(ValueError, match="cut a quantization group"):
        slice_columns(layer, 0, 48, mx.distributed.init(strict=False))


# ---- loader helpers on one process ---------------------------------------------------


def test_rank_weights_resolve_from_the_setting() -> None:
    from distributed.hosts import gather_hosts

    hosts = gather_hosts(mx.distributed.init(strict=False))
    assert resolve_weights(None, hosts) is None
    assert resolve_weights([2.0, 1.0, 1.0], hosts) == [2.0, 1.0, 1.0]
    auto = resolve_weights("auto", hosts)
    assert auto is not None and len(auto) == 1 and auto[0] > 0.1  # memory in GiB


def test_local_ranks_that_outnumber_the_cores_run_pipeline() -> None:
    two_cores = [RankHost(host="mac", cores=2, memory_bytes=2**34)]
    crowded = make_plan(SMOLLM2, 3, None, "auto", two_cores * 3)
    assert crowded.strategy == "pipeline"
    assert "3 local ranks on 2 cores of mac" in describe(crowded)[0]
    assert make_plan(SMOLLM2, 3, None, "tensor", two_cores * 3).strategy == "tensor-even"
    spread = [RankHost(host=f"mac{i}", cores=2, memory_bytes=2**34) for i in range(3)]
    assert make_plan(SMOLLM2, 3, None, "auto", spread).strategy == "tensor-even"


def test_loader_refuses_a_plan_made_for_another_model(tmp_path: Path) -> None:
    from distributed.loader import load_rank_model, weight_bytes
    from tests.support.tiny_models import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    group = mx.distributed.init(strict=False)
    with pytest.raises(PlanError, match="different model"):
        load_rank_model(model_dir, group, make_plan(SMOLLM2, 1, None, "auto"))
    own = json.loads((model_dir / "config.json").read_text())
    model = load_rank_model(model_dir, group, make_plan(own, 1, None, "auto"))
    assert 0 < weight_bytes(model) <= (model_dir / "model.safetensors").stat().st_size
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, own["vocab_size"])
