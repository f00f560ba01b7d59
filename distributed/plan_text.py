"""A split plan (distributed/plan.py) as text: one headline plus one line per rank, for the
ranks' logs, `./launch.sh plan` (launcher/plan_check.py) and `python -m distributed.plan_cli`."""

from __future__ import annotations

from distributed.plan import Plan, RankShare
from distributed.shares import Span


def describe(plan: Plan) -> list[str]:
    """One headline plus one line per rank."""
    s = plan.shape
    quant = f"{s.bits}-bit {s.quant_mode}, group {s.group_size}" if s.quantized else "float"
    kind = f" by {split_parts(plan)}" if plan.is_tensor else ""
    if plan.strategy == "pipeline" and plan.via_mlx_lm:
        kind = " through mlx-lm's pipeline() (last layers on rank 0)"
    moe = ""
    if s.is_moe:
        moe = (
            f", {s.num_experts} experts x {s.expert_size} (top {s.experts_per_token}) in "
            f"{s.moe_layers} MoE layers" + (f", shared {s.shared_size}" if s.shared_size else "")
        )
    mlp = f"mlp {s.intermediate_size}" + (
        f" in {s.dense_layer_count} dense layers" if s.is_moe else ""
    )
    lines = [
        f"plan {plan.strategy}{kind} (asked {plan.requested}) for {s.model_type} on "
        f"{plan.world_size} rank(s), weights {','.join(f'{w:g}' for w in plan.weights)}: "
        f"{s.num_heads} q / {s.num_kv_heads} kv heads x {s.head_dim}, {mlp}{moe}, "
        f"{s.num_layers} layers, {quant}"
    ]
    if plan.note:
        lines[0] += f"; {plan.note}"
    lines += [f"  rank {r.rank} (weight {r.weight:g}): {_rank_body(plan, r)}" for r in plan.ranks]
    return lines


def split_parts(plan: Plan) -> str:
    """What a tensor plan splits, e.g. 'heads + experts + vocabulary'."""
    if plan.via_mlx_lm:
        return "mlx-lm's shard()"
    parts = [
        name
        for name, on in (
            ("heads", plan.split_heads),
            ("mlp columns", plan.shape.dense_layer_count > 0),
            ("experts", plan.split_experts),
            ("vocabulary", plan.split_vocab),
        )
        if on
    ]
    return " + ".join(parts)


def _rank_body(plan: Plan, r: RankShare) -> str:
    s = plan.shape
    if plan.is_tensor and plan.via_mlx_lm:
        body = f"1/{plan.world_size} of every head and MLP, all {s.num_layers} layers"
    elif plan.is_tensor:
        parts = (
            [f"kv heads {_span(r.kv_heads)}", f"q heads {_span(r.q_heads)}"]
            if plan.split_heads
            else ["attention whole"]
        )
        if s.dense_layer_count:
            parts.append(f"mlp columns {_span(r.mlp_columns)}")
        if s.is_moe:
            parts.append(f"experts {_span(r.experts)}")
        if s.shared_size:
            parts.append(f"shared columns {_span(r.shared_columns)}")
        if plan.split_vocab:
            parts.append(f"vocab {_span(r.vocab)}")
        body = ", ".join(parts) + f", all {s.num_layers} layers"
    else:
        body = f"layers {_span(r.layers)}"
    head = "head"
    if not plan.is_tensor and s.tie_word_embeddings and plan.world_size > 1:
        head = "tied head (on the final hidden state from the last stage)"
    final_norm = not plan.is_tensor and (plan.via_mlx_lm or r.rank == plan.world_size - 1)
    parts_on = (("embeddings", r.embeddings), ("final norm", final_norm), (head, r.head))
    extras = [name for name, on in parts_on if on and not plan.split_vocab]
    return body + (" + " + " + ".join(extras) if extras else "")


def _span(span: Span) -> str:
    start, end = span
    if end == start:
        return "none"
    return f"{start}-{end - 1} ({end - start})" if end - start != 1 else f"{start} (1)"
