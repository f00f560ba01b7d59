"""What a tensor plan gives each rank, counted from the config alone: the planner's tests
(tests/test_plan.py, tests/test_plan_properties.py) check the weighted shares against it."""

from __future__ import annotations

from distributed.plan import Plan


def held_parameters(plan: Plan, cfg: dict) -> list[int]:
    """Each rank's parameters of a llama-style tensor plan, counted from the config alone
    (attention by heads, MLP by columns, embeddings and head by vocabulary rows)."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg["head_dim"]
    tied = cfg.get("tie_word_embeddings", True)
    out = []
    for r in plan.ranks:
        q = (r.q_heads[1] - r.q_heads[0]) * head_dim
        kv = (r.kv_heads[1] - r.kv_heads[0]) * head_dim
        attention = (2 * q + 2 * kv) * hidden
        mlp = 3 * hidden * (r.mlp_columns[1] - r.mlp_columns[0])
        vocab = (r.vocab[1] - r.vocab[0]) * hidden * (1 if tied else 2)
        out.append(layers * (attention + mlp) + vocab)
    return out
