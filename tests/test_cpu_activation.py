"""The CPU backend's SwiGLU (engine/cpu_activation.py): mlx-lm's result within float32's
rounding at every row count (whole blocks, a remainder, both), other dtypes and shapes
through mlx-lm's own, and installed where the families look it up."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import activations, llama

from engine import cpu_activation
from engine.cpu_activation import BLOCK, ORIGINAL, swiglu


@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (BLOCK, 96), (2 * BLOCK + 5, 96), (2, 7, 33)])
def test_it_matches_mlx_lms_swiglu(shape):
    gate = mx.random.normal(shape, key=mx.random.key(1)) * 8  # far into both tails
    x = mx.random.normal(shape, key=mx.random.key(2))
    ours, theirs = swiglu(gate, x), ORIGINAL(gate, x)
    assert ours.shape == theirs.shape
    relative = mx.abs(ours - theirs) / (mx.abs(theirs) + 1e-30)
    assert relative.max().item() < 1e-6
    # compiled into a step, as the decode runs it
    assert mx.allclose(mx.compile(swiglu)(gate, x), ours, rtol=0, atol=0).item()


def test_other_dtypes_shapes_and_empty_arrays_take_mlx_lms():
    half = mx.random.normal((4, 16)).astype(mx.float16)
    assert mx.array_equal(swiglu(half, half), ORIGINAL(half, half)).item()
    gate, x = mx.random.normal((4, 16)), mx.random.normal((1, 16))  # broadcast
    assert mx.array_equal(swiglu(gate, x), ORIGINAL(gate, x)).item()
    empty = mx.zeros((0, 16))
    assert swiglu(empty, empty).shape == (0, 16)


def test_install_reaches_the_families_already_imported(monkeypatch):
    families = [m for n, m in sys.modules.items() if n.startswith("mlx_lm.models.")]
    for module in families:  # each restored after the test
        if getattr(module, "swiglu", None) is ORIGINAL:
            monkeypatch.setattr(module, "swiglu", ORIGINAL)
    monkeypatch.setattr(activations, "swiglu", ORIGINAL)
    monkeypatch.setattr(llama, "swiglu", ORIGINAL)
    monkeypatch.setattr(cpu_activation, "on_cpu_backend", lambda: True)
    assert cpu_activation.install()
    assert activations.swiglu is swiglu and llama.swiglu is swiglu
    monkeypatch.setattr(cpu_activation, "on_cpu_backend", lambda: False)
    monkeypatch.setattr(llama, "swiglu", ORIGINAL)
    assert not cpu_activation.install() and llama.swiglu is ORIGINAL
