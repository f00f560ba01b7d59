"""engine/cpu_attention.py against MLX's own fused attention: the same numbers for every
head layout and mask kind, and for every family's tiny model, prompt and batched decode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from engine import cpu_attention
from engine.cpu_attention import _mlx_attention, grouped_attention
from tests.support.family_configs import CONFIGS, MLX_LM_CONFIGS
from tests.support.logits_probe import decode_in_batch
from tests.support.tiny_families import write_family_model

# (batch, query heads, KV heads, queries, keys, key dims, value dims): grouped, multi-head,
# multi-query, MLA-like (values narrower than keys)
SHAPES = [
    (1, 9, 3, 1, 300, 64, 64),
    (1, 9, 3, 22, 300, 64, 64),
    (2, 8, 8, 3, 7, 24, 24),
    (3, 4, 1, 1, 40, 8, 8),
    (2, 4, 1, 5, 12, 24, 16),
]


def _masks(batch: int, n: int, length: int) -> dict[str, object]:
    visible = mx.random.uniform(shape=(batch, 1, n, length)) > 0.3
    return {
        "none": None,
        "causal": "causal",
        "boolean": visible | (mx.arange(length) == 0),  # every row sees something
        "additive": mx.random.normal((batch, 1, n, length)),
    }


def _run(attend: Callable[..., mx.array], compiled: bool, *arrays: mx.array) -> mx.array:
    """`attend` eagerly, or traced inside `compiled_step` as engine/compiled_decode.py
    traces a step (where the softmax's exponential is exp2)."""
    if not compiled:
        return attend(*arrays)
    with cpu_attention.compiled_step():
        return mx.compile(attend)(*arrays)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_every_mask_kind_matches_mlx(shape: tuple[int, ...], compiled: bool) -> None:
    """Eagerly and compiled (`_run`)."""
    batch, heads, kv_heads, n, length, dims, value_dims = shape
    mx.random.seed(1)
    q = mx.random.normal((batch, heads, n, dims))
    k = mx.random.normal((batch, kv_heads, length, dims))
    v = mx.random.normal((batch, kv_heads, length, value_dims))
    for name, mask in _masks(batch, n, length).items():

        def attend(q: mx.array, k: mx.array, v: mx.array, mask: object = mask) -> mx.array:
            return grouped_attention(q, k, v, scale=dims**-0.5, mask=mask)  # type: ignore[arg-type]

        ours = _run(attend, compiled, q, k, v)
        theirs = _mlx_attention(q, k, v, scale=dims**-0.5, mask=mask)
        assert ours.shape == theirs.shape
        assert mx.abs(ours - theirs).max().item() < 1e-5, name


def test_exp2_is_as_accurate_as_powf_and_zero_past_float32_s_range() -> None:
    x = mx.concatenate([mx.linspace(-126, 0, 100_001), mx.random.uniform(-20, 0, (10_000,))])
    ours, powf = cpu_attention.exp2(x), mx.power(2.0, x)
    assert (mx.abs(ours - powf) / powf).max().item() < 1e-6
    lowest = mx.array([-127.0, -1000.0, mx.finfo(mx.float32).min])
    assert cpu_attention.exp2(lowest).tolist() == [0.0, 0.0, 0.0]
    assert cpu_attention.exp2(mx.array([0.0, -1.0, -126.0])).tolist() == [1.0, 0.5, 2.0**-126]


@pytest.mark.parametrize("shape", SHAPES[1:], ids=[str(s) for s in SHAPES[1:]])
def test_a_long_chunk_taken_in_blocks_of_rows_gives_the_same(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 1-2 query rows (as a 2,048-token chunk against a long cache is taken):
    every mask kind, the causal one seeing only the keys up to each block's last row."""
    batch, heads, kv_heads, n, length, dims, value_dims = shape
    mx.random.seed(2)
    q = mx.random.normal((batch, heads, n, dims))
    k = mx.random.normal((batch, kv_heads, length, dims))
    v = mx.random.normal((batch, kv_heads, length, value_dims))
    masks = _masks(batch, n, length)
    whole = {name: grouped_attention(q, k, v, scale=0.3, mask=m) for name, m in masks.items()}
    for rows in (1, 2):
        monkeypatch.setattr(cpu_attention, "SCORE_ELEMENTS", rows * heads * length)
        for name, mask in masks.items():
            blocked = grouped_attention(q, k, v, scale=0.3, mask=mask)
            assert mx.abs(blocked - whole[name]).max().item() < 1e-5, (rows, name)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_row_with_nothing_visible_stays_finite(compiled: bool) -> None:
    """A left-padded query position may see no key at all; it must not become NaN (its
    output feeds the next layer's keys at that position, masked but multiplied), whether
    the mask is boolean or additive with float32's lowest value (as mlx-lm's MLA families
    pass it) or -inf."""
    q, k, v = mx.ones((1, 2, 2, 4)), mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4))
    visible = mx.array([[False, False, False], [True, True, False]])
    lowest = mx.finfo(mx.float32).min
    for mask in (visible, mx.where(visible, 0.0, lowest), mx.where(visible, 0.0, -mx.inf)):

        def attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array = mask) -> mx.array:
            return grouped_attention(q, k, v, scale=0.5, mask=mask)

        out = _run(attend, compiled, q, k, v)
        assert mx.isfinite(out).all().item(), mask


def test_an_unknown_mask_name_is_refused() -> None:
    q = mx.ones((1, 1, 1, 4))
    with pytest.raises(ValueError, match="'causal' or an array"):
        grouped_attention(q, q, q, scale=1.0, mask="sliding")


FAMILIES = sorted(CONFIGS) + sorted(MLX_LM_CONFIGS)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_mlx_logits(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = load_model(write_family_model(tmp_path / family, family))
    prompts = [list(range(40, 75)), list(range(90, 102))]
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", _mlx_attention)
    prefilled, stepped = decode_in_batch(model, prompts, 4)
    want = [prefilled, *stepped]
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", grouped_attention)
    prefilled, stepped = decode_in_batch(model, prompts, 4)
    got = [prefilled, *stepped]
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert mx.abs(a - b).max().item() < 1e-4, f"step {step}"
