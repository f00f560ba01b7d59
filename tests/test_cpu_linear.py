"""Linear layers stored transposed (engine/cpu_linear.py) compute what nn.Linear does: the
same logits for a tied head, an untied one and biased projections, through prefill and a
decode step; with LINEAR_LAYOUT=plain the layers keep theirs and the head alone is
transposed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from engine.cpu_linear import TransposedEmbedding, TransposedLinear, transpose_linears
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

    assert transpose_linears(model, "transposed") == linears + tied
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    kinds = {type(m) for _, m in model.named_modules()}
    assert TransposedLinear in kinds and (TransposedEmbedding in kinds) == tied
    for name, module in model.named_modules():
        if name in weights:  # `weight` still reads as [out, in]
            np.testing.assert_array_equal(np.array(module.weight), weights[name])
    np.testing.assert_allclose(logits_of(model, prompt), before, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_plain_layers_keep_their_layout_and_the_head_is_transposed(tmp_path, tied):
    directory = write_tiny_model(tmp_path, num_hidden_layers=2, tie_word_embeddings=tied)
    model = load_model(directory)[0]
    prompt = list(range(30, 60))
    before = logits_of(model, prompt)
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())

    assert transpose_linears(model, "plain") == 1
    head = model.model.embed_tokens if tied else model.lm_head
    assert type(head) is (TransposedEmbedding if tied else TransposedLinear)
    plain = sum(type(m) is nn.Linear for _, m in model.named_modules())
    assert plain == linears - (0 if tied else 1) == 7 * len(model.layers)
    np.testing.assert_allclose(logits_of(model, prompt), before, atol=1e-5)
