"""Rank 0's sampling (each request's state through the batched MLX sampler), incremental
detokenizer and stop-string filter."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from ipc.protocol import SamplingParams
from leader.detokenize import IncrementalDecoder, StopFilter, token_bytes
from leader.sampler import RequestSampler
from tests.support.tiny_models import write_byte_tokenizer

VOCAB = 300


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=VOCAB).astype(np.float32) * 3


def params(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=10, **fields)


def draw(sampler: RequestSampler, rows: int = 20) -> list[int]:
    return [sampler.sample_one(mx.array(logits(i))).token for i in range(rows)]


def test_greedy_is_argmax():
    sampler = RequestSampler(params(temperature=0.0), [])
    assert draw(sampler) == [int(np.argmax(logits(i))) for i in range(20)]


def test_seed_reproduces_and_differs_between_seeds():
    first = draw(RequestSampler(params(temperature=1.0, seed=7), []))
    again = draw(RequestSampler(params(temperature=1.0, seed=7), []))
    other = draw(RequestSampler(params(temperature=1.0, seed=8), []))
    assert first == again
    assert first != other


def test_top_k_one_and_tiny_top_p_are_greedy():
    greedy = [int(np.argmax(logits(i))) for i in range(20)]
    assert draw(RequestSampler(params(temperature=1.5, top_k=1, seed=1), [])) == greedy
    assert draw(RequestSampler(params(temperature=1.5, top_p=1e-6, seed=1), [])) == greedy
    assert draw(RequestSampler(params(temperature=1.5, min_p=1.0, seed=1), [])) == greedy


def test_top_k_limits_the_candidates():
    row = logits(3)
    allowed = set(np.argsort(-row)[:3].tolist())
    sampler = RequestSampler(params(temperature=5.0, top_k=3, seed=2), [])
    assert {sampler.sample_one(mx.array(row)).token for _ in range(200)} <= allowed


def test_top_p_keeps_the_nucleus():
    row = np.full(VOCAB, -10.0, dtype=np.float32)
    row[[4, 9]] = [5.0, 4.9]  # these two hold almost all of the mass
    sampler = RequestSampler(params(temperature=1.0, top_p=0.9, seed=3), [])
    assert {sampler.sample_one(mx.array(row)).token for _ in range(100)} == {4, 9}


def test_penalties_push_repeats_down():
    row = np.zeros(VOCAB, dtype=np.float32)
    row[5], row[6] = 2.0, 1.9
    assert RequestSampler(params(temperature=0.0), [5]).sample_one(mx.array(row)).token == 5
    repeated = RequestSampler(params(temperature=0.0, repetition_penalty=1.5), [5])
    assert repeated.sample_one(mx.array(row)).token == 6
    presence = RequestSampler(params(temperature=0.0, presence_penalty=1.0), [])
    assert [presence.sample_one(mx.array(row)).token for _ in range(2)] == [5, 6]
    frequency = RequestSampler(params(temperature=0.0, frequency_penalty=0.06), [])
    assert [frequency.sample_one(mx.array(row)).token for _ in range(3)] == [5, 5, 6]


def test_logprobs_and_top_logprobs():
    row = logits(4)
    greedy = RequestSampler(params(temperature=0.0, logprobs=True, top_logprobs=3), [])
    sample = greedy.sample_one(mx.array(row))
    expected = row - row.max() - np.log(np.exp(row - row.max()).sum())
    assert sample.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    assert [t for t, _ in sample.top] == np.argsort(-row)[:3].tolist()
    assert [lp for _, lp in sample.top] == sorted((lp for _, lp in sample.top), reverse=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(directory)
    return load_tokenizer(directory)


def test_deltas_never_split_a_character(tokenizer):
    text = "héllo wörld ✓ 🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.add(t) for t in ids]
    assert "".join(deltas) + decoder.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # a multi-byte character was held back at least once


def test_token_bytes_are_the_raw_pieces(tokenizer):
    text = "é ✓"
    pieces = [token_bytes(tokenizer, t) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert all(len(p) == 1 for p in pieces)  # one byte per token, halves of characters
    assert b"".join(pieces).decode() == text


def test_stop_filter_holds_back_a_possible_stop():
    stops = StopFilter(["END", "xyz"])
    assert stops.push("hello E") == ("hello ", False)
    assert stops.push("N") == ("", False)
    assert stops.push("Dless") == ("", True)
    passthrough = StopFilter(["END"])
    assert passthrough.push("hello EN") == ("hello ", False)
    assert passthrough.push("d") == ("ENd", False)
    assert passthrough.flush() == ""
    held = StopFilter(["xyz"])
    assert held.push("abx") == ("ab", False)
    assert held.flush() == "x"
