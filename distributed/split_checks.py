"""What can split how: the reasons a tensor or pipeline split of a model cannot be honoured,
and the alternatives a refusal names. The planner (distributed/plan.py) asks these."""

from __future__ import annotations

from distributed.families.spec import Family
from distributed.model_shape import ModelShape, PlanError
from distributed.shares import split


def head_problems(shape: ModelShape, world: int, weights: list[float]) -> list[str]:
    """Reasons attention cannot split by heads (empty when it can)."""
    problems = []
    if shape.num_heads % shape.num_kv_heads:
        problems.append(
            f"{shape.num_heads} query heads do not group evenly over {shape.num_kv_heads} KV heads"
        )
    if world > shape.num_kv_heads:
        problems.append(
            f"tensor parallel gives each rank whole KV heads: the model has "
            f"{shape.num_kv_heads} KV heads, fewer than {world} ranks"
        )
    if problems or not shape.quantized:
        return problems
    unit = shape.mlp_unit
    per_kv = shape.num_heads // shape.num_kv_heads * shape.o_columns_per_head
    for start, _ in split(shape.num_kv_heads, weights)[1:]:
        column = start * per_kv
        if column % unit:
            problems.append(
                f"the o_proj split at input column {column} would cut a quantization group "
                f"of {unit} ({per_kv} columns per KV-head group)"
            )
            break
    return problems


def column_problems(size: int, unit: int, world: int, what: str) -> list[str]:
    if size % unit:
        return [f"{what} size {size} is not a whole number of quantization groups of {unit}"]
    if size // unit < world:
        return [f"{size // unit} {what} units of {unit} columns, fewer than {world} ranks"]
    return []


# Column counts mlx-lm's shard() divides among the ranks (quantized: in whole groups).
MLX_LM_COLUMNS = (
    "intermediate_size",
    "moe_intermediate_size",
    "dense_intermediate_size",
    "shared_intermediate_size",
    "shared_expert_intermediate_size",
    "share_expert_dim",
    "ffn_hidden_size",
    "expert_ffn_hidden_size",
)


def mlx_lm_problems(
    shape: ModelShape, family: Family, config: dict, world: int, weights: list[float]
) -> list[str]:
    problems = []
    if len(set(weights)) != 1:
        problems.append(f"{family.name} splits only evenly (through mlx-lm's shard())")
    text = {**(config.get("text_config") or {}), **config}
    for key in family.mlx_lm_shard_divides:
        value = text.get(key)
        if isinstance(value, int) and value % world:
            problems.append(f"{key}={value} does not divide by {world} ranks")
    if shape.quantized and shape.group_size:
        unit = world * shape.group_size
        widths = {key: text.get(key) for key in MLX_LM_COLUMNS}
        widths["attention output"] = shape.num_heads * shape.o_columns_per_head
        for key, value in widths.items():
            if isinstance(value, int) and value and value % unit:
                problems.append(
                    f"{key}={value} gives {world} ranks no whole quantization groups of "
                    f"{shape.group_size}"
                )
    return problems


def tensor_problems(
    shape: ModelShape, family: Family, config: dict, world: int, weights: list[float]
) -> list[str]:
    """Reasons a tensor (heads + experts) split cannot be honoured (empty when it can)."""
    if family.via_mlx_lm:
        return mlx_lm_problems(shape, family, config, world, weights)
    problems = []
    if not shape.is_moe:
        problems += head_problems(shape, world, weights)
    elif "expert" not in family.splits:
        problems.append(f"{family.name} has no expert split")
    elif shape.num_experts < world:
        problems.append(
            f"expert parallel gives each rank whole experts: {shape.num_experts} experts, "
            f"fewer than {world} ranks"
        )
    if shape.dense_layer_count:
        problems += column_problems(shape.intermediate_size, shape.mlp_unit, world, "MLP")
    return problems


def pipeline_problems(shape: ModelShape, family: Family, world: int) -> list[str]:
    if "pipeline" not in family.splits:
        why = f" ({family.note})" if family.note else ""
        return [f"{family.name} has no pipeline split in the registry{why}"]
    if world > shape.num_layers:
        return [f"pipeline gives each rank whole layers: {shape.num_layers} layers, {world} ranks"]
    return []


def is_even(shape: ModelShape, world: int, weights: list[float], split_heads: bool) -> bool:
    if len(set(weights)) != 1:
        return False
    counts = [shape.num_experts] if shape.is_moe else []
    if split_heads:
        counts += [shape.num_kv_heads, shape.num_heads]
    unit = shape.mlp_unit
    if shape.dense_layer_count:
        counts.append(shape.intermediate_size // unit)
    if any(count % world for count in counts):
        return False
    if shape.quantized and split_heads:
        return (shape.num_heads * shape.o_columns_per_head // world) % unit == 0
    return True


class Context:
    """What the refusal message needs to suggest alternatives."""

    def __init__(self, shape: ModelShape, family: Family, config: dict) -> None:
        self.shape, self.family, self.config = shape, family, config

    def tensor_ok(self, world: int, weights: list[float]) -> bool:
        return not tensor_problems(self.shape, self.family, self.config, world, weights)

    def pipeline_ok(self, world: int) -> bool:
        return not pipeline_problems(self.shape, self.family, world)


def alternatives(ctx: Context, world: int, weights: list[float], failed: str) -> list[str]:
    """What would work instead, for the refusal message."""
    out = []
    if failed != "tensor" and ctx.tensor_ok(world, weights):
        out.append(f"PARALLELISM=tensor works with {world} ranks")
    if failed != "pipeline" and ctx.pipeline_ok(world):
        out.append(f"PARALLELISM=pipeline works with {world} ranks")
    if failed == "tensor":
        if ctx.family.via_mlx_lm and ctx.tensor_ok(world, [1.0] * world):
            out.append("equal RANK_WEIGHTS (empty)")
        fits = [n for n in range(2, world) if ctx.tensor_ok(n, [1.0] * n)]
        if fits:
            out.append(f"tensor parallel works with NUM_DEVICES in {fits} (equal weights)")
    elif failed == "pipeline" and "pipeline" in ctx.family.splits:
        out.append(f"pipeline works with at most {ctx.shape.num_layers} ranks")
    out.append("NUM_DEVICES=1 always works if the model fits one machine")
    return out


def refuse(reasons: list[str], alternatives: list[str]) -> PlanError:
    return PlanError("; ".join(reasons) + ". What would work: " + "; ".join(alternatives))


def unregistered(model_type: str) -> PlanError:
    from distributed.families import FAMILIES

    names = ", ".join(f.name for f in FAMILIES)
    return PlanError(
        f"model type {model_type!r} cannot be split: it is not in the family registry "
        f"(docs/MODELS.md: {names}). What would work: NUM_DEVICES=1"
    )
