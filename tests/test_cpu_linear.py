"""Linear layers stored transposed (engine/cpu_linear.py) compute what nn.Linear does: the
same logits for a tied head, an untied one and biased projections, through prefill and a
decode step; and the head's and the layers' layouts are chosen apart, by a chooser or by
timing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from engine import cpu_linear
from engine.cpu_linear import (
    PLAIN_MARGIN,
    TIMED_ROWS,
    LayoutTiming,
    MeasuredLayout,
    TransposedEmbedding,
    TransposedLinear,
    layout_chooser,
    transpose_linears,
)
from tests.support.tiny_models import write_tiny_model

CASES = {
    "llama, tied head": {"tie_word_embeddings": True},
    "llama, untied head": {},
    "qwen2, biased projections": {"model_type": "qwen2", "tie_word_embeddings": True},
}


def logits_of(model, prompt: list[int]) -> np.ndarray:
    """The prompt's last logits, then one decode step's."""
    cache = make_prompt_cache(model)
    first = model(mx.array([prompt]), cache=cache)[:, -1, :]
    second = model(mx.argmax(first, axis=-1)[:, None], cache=cache)[:, -1, :]
    return np.array(mx.concatenate([first, second]))


@pytest.mark.parametrize("case", list(CASES))
def test_transposed_layers_give_the_same_logits(tmp_path, case):
    directory = write_tiny_model(tmp_path, num_hidden_layers=2, **CASES[case])
    model = load_model(directory)[0]
    prompt = list(range(30, 60))
    before = logits_of(model, prompt)
    weights = {name: np.array(m.weight) for name, m in model.named_modules() if "weight" in m}
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    tied = CASES[case].get("tie_word_embeddings", False)

    assert transpose_linears(model) == linears + tied
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    kinds = {type(m) for _, m in model.named_modules()}
    assert TransposedLinear in kinds and (TransposedEmbedding in kinds) == tied
    for name, module in model.named_modules():
        if name in weights:  # `weight` still reads as [out, in]
            np.testing.assert_array_equal(np.array(module.weight), weights[name])
    np.testing.assert_allclose(logits_of(model, prompt), before, atol=1e-5)


def test_a_chooser_picks_the_head_and_the_layers_apart(tmp_path):
    directory = write_tiny_model(tmp_path, num_hidden_layers=2, tie_word_embeddings=True)
    model = load_model(directory)[0]
    prompt = list(range(30, 60))
    before = logits_of(model, prompt)
    asked: dict[str, list[tuple[int, ...]]] = {}

    def head_only(group: str, weights: list[mx.array]) -> bool:
        asked[group] = [tuple(weight.shape) for weight in weights]
        return group == "head"

    assert transpose_linears(model, head_only) == 1
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    assert asked["head"] == [tuple(model.model.embed_tokens.weight.shape)]
    assert len(asked["layers"]) == linears == 7 * len(model.layers)
    first = model.layers[0].self_attn.q_proj.weight.shape  # model order: layer 0 first
    assert asked["layers"][0] == tuple(first)
    assert type(model.model.embed_tokens) is TransposedEmbedding
    np.testing.assert_allclose(logits_of(model, prompt), before, atol=1e-5)
    assert transpose_linears(model, lambda group, _weights: group == "layers") == linears
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    np.testing.assert_allclose(logits_of(model, prompt), before, atol=1e-5)


def test_measured_layouts_follow_their_timings(tmp_path):
    directory = write_tiny_model(tmp_path, num_hidden_layers=2)  # an untied lm_head
    model = load_model(directory)[0]
    prompt = list(range(30, 60))
    before = logits_of(model, prompt)
    chooser = layout_chooser("auto")
    assert isinstance(chooser, MeasuredLayout)

    swapped = transpose_linears(model, chooser)
    timed = {timing.group: timing for timing in chooser.timings}
    assert set(timed) == {"head", "layers"} and len(chooser.timings) == 2
    assert timed["head"].count == 1 and timed["layers"].count == 7 * len(model.layers)
    for timing in chooser.timings:
        assert len(timing.plain_ms) == len(timing.transposed_ms) == len(TIMED_ROWS)
        assert min(timing.plain_ms + timing.transposed_ms) > 0
    assert (type(model.lm_head) is TransposedLinear) == timed["head"].transposed
    kinds = {type(layer.mlp.down_proj) for layer in model.layers}
    kinds |= {type(layer.self_attn.q_proj) for layer in model.layers}
    assert kinds == {TransposedLinear if timed["layers"].transposed else nn.Linear}
    expected = timed["head"].transposed + timed["layers"].transposed * timed["layers"].count
    assert swapped == expected
    np.testing.assert_allclose(logits_of(model, prompt), before, atol=1e-5)


@pytest.mark.parametrize(
    ("plain_ms", "transposed_ms", "transposed"),
    [
        ((10.0, 10.0, 10.0), (10.0, 10.0, 10.0), True),
        ((10.0, 10.0, 10.0), (10.19, 10.19, 10.19), True),
        ((10.0, 10.0, 10.0), (10.21, 10.21, 10.21), False),
        ((10.0, 10.0, 10.0), (5.0, 12.0, 16.0), True),  # (0.5 x 1.2 x 1.6)^(1/3) < 1.02
        ((10.0, 10.0, 10.0), (9.0, 12.0, 12.0), False),  # (0.9 x 1.2 x 1.2)^(1/3) > 1.02
    ],
)
def test_the_usual_layout_must_win_by_a_margin(plain_ms, transposed_ms, transposed):
    assert PLAIN_MARGIN == 0.02 and len(TIMED_ROWS) == 3
    timing = LayoutTiming("layers", 2, plain_ms, transposed_ms)
    assert timing.transposed is transposed
    assert ("kept [in, out]" in timing.describe()) is transposed


def test_timing_stops_at_the_byte_cap_and_fixed_layouts_time_nothing(monkeypatch):
    weights = [mx.zeros((64, 32)) for _ in range(10)]
    monkeypatch.setattr(cpu_linear, "TIMED_BYTES", 3 * weights[0].nbytes + 1)
    chooser = MeasuredLayout()
    chooser("layers", weights)
    assert [timing.count for timing in chooser.timings] == [3]
    assert layout_chooser("transposed")("head", weights)
    assert not layout_chooser("plain")("layers", weights)
