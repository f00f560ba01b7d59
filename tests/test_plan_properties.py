"""Split planner, property tests over many configs and weights: every unit assigned once,
shares near their weighted ideal, refusals exactly when the counts cannot split."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed.model_shape import PlanError
from distributed.plan import make_plan
from distributed.shares import apportion
from tests.support.plan_parameters import held_parameters

weights_strategy = st.lists(
    st.floats(min_value=0.05, max_value=20, allow_nan=False), min_size=1, max_size=8
)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(min_value=1, max_value=5000), weights=weights_strategy)
def test_apportion_assigns_every_unit_once_near_its_ideal(total: int, weights: list) -> None:
    if total < len(weights):
        with pytest.raises(ValueError):
            apportion(total, weights)
        return
    shares = apportion(total, weights)
    assert sum(shares) == total and min(shares) >= 1
    ideal = [total * w / sum(weights) for w in weights]
    if min(ideal) >= 1:
        assert all(abs(s - i) < 1 for s, i in zip(shares, ideal, strict=True))
    else:
        # A rank whose ideal is under one unit still gets exactly one; the others only
        # give units away, so none holds more than its rounded-up ideal.
        for share, want in zip(shares, ideal, strict=True):
            assert share == 1 if want < 1 else 1 <= share <= math.ceil(want)


def _covers(ranges: list[tuple[int, int]], total: int) -> bool:
    return (
        ranges[0][0] == 0
        and ranges[-1][1] == total
        and all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False))
        and ranges[-1][0] < ranges[-1][1]
    )


model_configs = st.builds(
    lambda kv, group, head_dim, units, layers, bits, gs: {
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_attention_heads": kv * group,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": units * (gs if bits else 1),
        "num_hidden_layers": layers,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
        **({"quantization": {"group_size": gs, "bits": bits}} if bits else {}),
    },
    kv=st.integers(1, 16),
    group=st.integers(1, 8),
    head_dim=st.sampled_from([16, 32, 48, 64, 80, 128]),
    units=st.integers(1, 200),
    layers=st.integers(1, 64),
    bits=st.sampled_from([None, 4, 8]),
    gs=st.sampled_from([32, 64, 128]),
)


@settings(max_examples=400, deadline=None)
@given(
    cfg=model_configs,
    weights=weights_strategy,
    mode=st.sampled_from(["auto", "tensor", "pipeline"]),
)
def test_every_plan_assigns_every_unit_exactly_once(cfg: dict, weights: list, mode: str) -> None:
    world = len(weights)
    try:
        plan = make_plan(cfg, world, weights, mode)
    except PlanError as exc:
        assert "What would work" in str(exc) or "world" in str(exc)
        return
    assert len(plan.ranks) == world
    if plan.is_tensor:
        kv = [r.kv_heads for r in plan.ranks]
        mlp = [r.mlp_columns for r in plan.ranks]
        assert _covers(kv, cfg["num_key_value_heads"])
        assert _covers(mlp, cfg["intermediate_size"])
        group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
        assert all(r.q_heads == (r.kv_heads[0] * group, r.kv_heads[1] * group) for r in plan.ranks)
        unit = cfg["quantization"]["group_size"] if "quantization" in cfg else 1
        for r in plan.ranks:
            assert r.mlp_columns[0] % unit == 0
            assert (r.q_heads[0] * cfg["head_dim"]) % unit == 0
        assert _covers([r.vocab for r in plan.ranks], cfg["vocab_size"])
        # Where whole heads leave room, the MLP columns and vocabulary rows even out each
        # rank's parameters to its weighted share, within one MLP unit and one row.
        held = held_parameters(plan, cfg)
        total = sum(held)
        attention = [
            cfg["num_hidden_layers"] * 2 * (q1 - q0 + k1 - k0) * cfg["head_dim"] * 256
            for (q0, q1), (k0, k1) in ((r.q_heads, r.kv_heads) for r in plan.ranks)
        ]
        targets = [total * w / sum(weights) for w in weights]
        slack = cfg["num_hidden_layers"] * 3 * 256 * unit + 2 * 256 + 256 * 2 * len(weights)
        if all(a + slack < t for a, t in zip(attention, targets, strict=True)):
            for count, target in zip(held, targets, strict=True):
                assert abs(count - target) <= 2 * slack, (held, targets)
    elif plan.strategy == "pipeline":
        layers = [r.layers for r in plan.ranks]
        assert _covers(layers, cfg["num_hidden_layers"])
        ideal = [cfg["num_hidden_layers"] * w / sum(weights) for w in weights]
        if min(ideal) >= 1:
            assert all(abs(b - a - i) < 1 for (a, b), i in zip(layers, ideal, strict=True))
        assert sum(r.embeddings for r in plan.ranks) == 1 and plan.ranks[0].embeddings
        assert sum(r.head for r in plan.ranks) == 1 and plan.ranks[-1].head
    else:
        assert world == 1


@settings(max_examples=200, deadline=None)
@given(cfg=model_configs, world=st.integers(2, 12))
def test_refusals_happen_exactly_when_counts_cannot_split(cfg: dict, world: int) -> None:
    kv_ok = world <= cfg["num_key_value_heads"]
    try:
        plan = make_plan(cfg, world, None, "tensor")
    except PlanError as exc:
        assert not kv_ok or "quantization" in str(exc) or "MLP units" in str(exc)
    else:
        assert kv_ok and plan.is_tensor
    layers_ok = world <= cfg["num_hidden_layers"]
    try:
        make_plan(cfg, world, None, "pipeline")
    except PlanError as exc:
        assert not layers_ok and "layers" in str(exc)
    else:
        assert layers_ok
