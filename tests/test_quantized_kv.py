"""KV_CACHE_BITS in one process: the quantized batch cache keeps what BatchKVCache keeps, and
the batch engine decodes with it.

Quantizing is per position (groups run along the head), so padding, filtering, joining,
extracting and rolling commute with it: a BatchKVCache fed the dequantized keys must hold
exactly what the quantized batch cache dequantizes to, after every operation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache
from mlx_lm.utils import load_model

from distributed.memory import KV_GROUP_SIZE, element_bytes
from engine.batch_caches import left_pad, merged, roll_back
from engine.batch_engine import BatchEngine
from engine.prefill_group import LAST_TOKEN_ALONE
from engine.prefix_store import PrefixStore, kv_bytes_per_token
from engine.quantized_kv import BatchQuantizedKVCache, agreed_bits, make_caches
from engine.step_plan import Insert, StepPlan, Store
from tests.support.tiny_models import write_tiny_model
from tests.test_batch_engine import PROMPTS, greedy_run

HEADS, DIM = 2, 64


def _kv(length: int, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, HEADS, length, DIM)).astype(np.float32)
    values = rng.standard_normal((1, HEADS, length, DIM)).astype(np.float32)
    return mx.array(keys), mx.array(values)


def _round_trip(x: mx.array, bits: int) -> mx.array:
    return mx.dequantize(*mx.quantize(x, group_size=KV_GROUP_SIZE, bits=bits), KV_GROUP_SIZE, bits)


def _pair(lengths: list[int], bits: int, seed: int = 0) -> tuple[list, list]:
    """Per-sequence caches: quantized ones, and plain ones fed the dequantized keys."""
    quantized, plain = [], []
    for i, length in enumerate(lengths):
        keys, values = _kv(length, seed + i)
        q, p = QuantizedKVCache(KV_GROUP_SIZE, bits), KVCache()
        q.update_and_fetch(keys, values)
        p.update_and_fetch(_round_trip(keys, bits), _round_trip(values, bits))
        quantized.append([q])
        plain.append([p])
    return quantized, plain


def _same(quantized: BatchQuantizedKVCache, plain: BatchKVCache, bits: int) -> None:
    (qk, qv), (pk, pv) = quantized.keys_and_values(), plain.keys_and_values()
    for triple, expected in ((qk, pk), (qv, pv)):
        got = mx.dequantize(*triple, KV_GROUP_SIZE, bits)
        assert got.shape == expected.shape
        np.testing.assert_array_equal(np.array(got), np.array(expected))
    assert quantized.offset.tolist() == plain.offset.tolist()
    assert quantized.left_padding.tolist() == plain.left_padding.tolist()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_quantized_batch_cache_holds_what_the_plain_one_holds(bits: int) -> None:
    quantized, plain = _pair([5, 12, 3], bits)
    q_batch, p_batch = merged(quantized)[0], merged(plain)[0]
    assert isinstance(q_batch, BatchQuantizedKVCache) and q_batch.bits == bits
    _same(q_batch, p_batch, bits)
    keys, values = _kv(1, 99)
    step = mx.concatenate([keys] * 3), mx.concatenate([values] * 3)
    q_batch.update_and_fetch(*step)
    p_batch.update_and_fetch(*(_round_trip(x, bits) for x in step))
    _same(q_batch, p_batch, bits)
    # a speculative step's rollback: rows drop 0, 2 and 1 positions
    q_batch.update_and_fetch(*(mx.concatenate([x] * 2, axis=2) for x in step))
    p_batch.update_and_fetch(*(mx.concatenate([_round_trip(x, bits)] * 2, axis=2) for x in step))
    roll_back([q_batch], [0, 2, 1])
    roll_back([p_batch], [0, 2, 1])
    _same(q_batch, p_batch, bits)
    # a sequence leaves, another joins (its own batch cache, padded), one is extracted
    q_batch.filter([0, 2])
    p_batch.filter([0, 2])
    _same(q_batch, p_batch, bits)
    q_more, p_more = _pair([20], bits, seed=7)
    q_join, p_join = merged(q_more)[0], merged(p_more)[0]
    q_batch.extend(q_join)
    p_batch.extend(p_join)
    _same(q_batch, p_batch, bits)
    row_q, row_p = q_batch.extract(2), p_batch.extract(2)
    assert row_q.offset == row_p.offset == 20
    np.testing.assert_array_equal(
        np.array(mx.dequantize(*row_q.keys, KV_GROUP_SIZE, bits)), np.array(row_p.keys)
    )


def test_prompts_padded_into_an_empty_quantized_batch_take_the_padding() -> None:
    caches = merged([[QuantizedKVCache(KV_GROUP_SIZE, 8)], [QuantizedKVCache(KV_GROUP_SIZE, 8)]])
    left_pad(caches, [3, 0])
    keys, values = _kv(4, 1)
    caches[0].update_and_fetch(mx.concatenate([keys] * 2), mx.concatenate([values] * 2))
    assert caches[0].left_padding.tolist() == [3, 0]
    assert caches[0].offset.tolist() == [1, 4]


def test_bytes_per_element() -> None:
    assert element_bytes(2, None) == 2
    assert element_bytes(4, 8) == 1 + 8 / 64  # float32 scales and biases, a group of 64
    assert element_bytes(2, 4) == 0.5 + 4 / 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = write_tiny_model(
        tmp_path_factory.mktemp("tiny-kv"),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
    )
    return load_model(directory)[0]


def test_the_engine_decodes_with_8_bit_kv_as_with_float(model) -> None:
    assert agreed_bits(model, 8, None) == (8, None)
    assert isinstance(make_caches(model, 8)[0], QuantizedKVCache)
    base = greedy_run(model, 16, PROMPTS, steps=16)
    quantized = greedy_run(model, 16, PROMPTS, steps=16, kv_bits=8)
    same = sum(a == b for seq in base for a, b in zip(base[seq][0], quantized[seq][0], strict=True))
    total = sum(len(tokens) for tokens, _ in base.values())
    assert same / total >= 0.95, (same, total)
    for seq in base:  # the first token's logits, within the quantization error
        np.testing.assert_allclose(base[seq][1], quantized[seq][1], atol=0.05)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_measured_kv_bytes_follow_the_bits(model, bits: int) -> None:
    plain = kv_bytes_per_token(model)
    assert kv_bytes_per_token(model, None, bits) * 4 == plain * element_bytes(4, bits)


def test_heads_that_do_not_split_into_groups_keep_float_kv(tmp_path) -> None:
    small = load_model(write_tiny_model(tmp_path, num_hidden_layers=1))[0]  # 16-wide heads
    bits, why = agreed_bits(small, 8, None)
    assert bits is None
    assert why is not None and "groups of 64" in why and "16" in why


def _decode(engine: BatchEngine, plan: StepPlan, steps: int) -> tuple[list[int], list]:
    """Apply `plan`, then decode one sequence greedily: its tokens and each step's logits."""
    tokens, rows = [], []
    for _ in range(steps):
        engine.apply(plan)
        row = np.array(engine.run().logits.astype(mx.float32))[-1]
        tokens.append(int(row.argmax()))
        rows.append(row)
        plan = StepPlan(engine.step_index, engine.fingerprint(), tokens=[tokens[-1]])
    return tokens, rows


def _positions(layers: list, length: int) -> list[np.ndarray]:
    """Every array of every layer's (keys, values) triples, cut to `length` positions."""
    return [np.array(x[..., :length, :]) for keys, values in layers for x in (*keys, *values)]


@pytest.mark.parametrize("length", [LAST_TOKEN_ALONE - 8, LAST_TOKEN_ALONE + 8])
def test_a_quantized_prefix_entry_holds_the_bytes_the_answer_used(model, length: int) -> None:
    """The prompt's entry (stored as it prefilled) and the finished conversation's (stored
    from the decode batch) hold the very quantized triples the answer attended to: no second
    quantization, no other scale. A hit computes the prompt's last token alone: beyond
    LAST_TOKEN_ALONE tokens the first answer did so too, and the hit's answer is the same
    computation (its logits equal bit for bit); a shorter prompt's last token ran inside the
    prompt's forward, its sums in another order, and its own keys and values may quantize
    one step apart (logits within the quantization error)."""
    prompt = [(7 * i) % 250 + 3 for i in range(length)]
    engine = BatchEngine(model, 256, prefix=PrefixStore(8))
    first = StepPlan(0, engine.fingerprint(), inserts=[Insert(1, prompt, store_as=7)])
    tokens, rows = _decode(engine, first, 12)
    assert engine._decode_cache is not None
    used = [layer.extract(0) for layer in engine._decode_cache]
    attended = _positions([(c.keys, c.values) for c in used], length + 11)
    # the conversation (the prompt and 11 tokens fed back) kept from the decode batch as 8
    store = Store(1, 8, length + 11)
    hit = Insert(2, prompt[-1:], prefix_entry=7, prefix_len=length - 1)
    plan = StepPlan(
        engine.step_index, engine.fingerprint(), removes=[1], stores=[store], inserts=[hit]
    )
    again, again_rows = _decode(engine, plan, 12)
    for entry, held in ((7, length), (8, length + 11)):
        stored = _positions(engine.prefix.entries[entry], held)
        cut = [x[..., :held, :] for x in attended]
        assert all(np.array_equal(a, b) for a, b in zip(stored, cut, strict=True)), entry
    if length > LAST_TOKEN_ALONE:
        assert again == tokens
        assert all(np.array_equal(a, b) for a, b in zip(again_rows, rows, strict=True))
    else:
        np.testing.assert_allclose(again_rows[0], rows[0], atol=0.05)
