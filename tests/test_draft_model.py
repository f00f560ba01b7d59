"""The draft model (DRAFT_MODEL, leader/draft_model.py) in one process, on tiny random models
that share one tokenizer: its proposals are its greedy continuation, its per-row cache
follows the history across accepted and rejected proposals (the same keys and values as a
fresh prefill), a draft with another tokenizer or none at all is refused with its reason,
speculation with it gives the answers speculation off gives, and the plan counts its
memory on rank 0.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

from config.settings import Settings
from distributed.hosts import RankHost
from distributed.memory import check_fit
from launcher.plan_check import draft_dir
from leader.draft_model import DraftError, load_draft, tokenizer_difference
from leader.speculation import Speculator
from tests.support.tiny_models import write_tiny_model
from tests.test_speculation import generate, request

VOCAB = 259  # the tiny models' embedding rows


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("served"), never_stops=True)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another random model with the same tokenizer (a poor draft)."""
    return write_tiny_model(tmp_path_factory.mktemp("other"), never_stops=True, seed=5)


def draft_of(directory, served_dir, **fields):
    settings = Settings(_env_file=None, draft_model=str(directory))
    return load_draft(settings, load_tokenizer(served_dir), VOCAB, "served", **fields)


def greedy(model, history: list[int], count: int) -> list[int]:
    """The model's greedy continuation, each token from a forward of the whole sequence
    without a cache."""
    tokens = list(history)
    for _ in range(count):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1, :VOCAB])))
    return tokens[len(history) :]


def cache_matches_a_fresh_prefill(draft, seq_id: int) -> None:
    row = draft.rows[seq_id]
    fresh = make_prompt_cache(draft.model)
    draft.model(mx.array([row.consumed]), cache=fresh)
    for ours, theirs in zip(row.cache, fresh, strict=True):
        assert ours.offset == theirs.offset == len(row.consumed)
        for a, b in zip(ours.state[:2], theirs.state[:2], strict=True):
            n = len(row.consumed)
            assert mx.allclose(a[..., :n, :], b[..., :n, :], atol=1e-4).item()


def test_the_draft_proposes_its_greedy_continuation(served):
    draft = draft_of(served, served)
    reference = load_model(served)[0]
    prompt = list(b"def main():\n    return")
    assert draft.propose(1, prompt, 5) == greedy(reference, prompt, 5)
    # a row's cache grows by the plan's bytes a token (the context choice counts them)
    cache = draft.rows[1].cache
    held = sum(array.nbytes for layer in cache for array in layer.state[:2])
    assert draft.kv_bytes_per_token == held / cache[0].state[0].shape[2] > 0  # its buffer
    assert draft.token_ms > 0  # timed: the per-step rule's cost of a proposal
    assert draft.propose(2, prompt, 0) == [] and 2 not in draft.rows


def test_the_cache_follows_the_history_across_accepted_and_rejected_steps(served, other):
    draft = draft_of(other, served, chunk=16)
    reference = load_model(other)[0]
    history = list(b"the cat sat on the mat, and the dog")  # 35 tokens: chunks of 16
    assert draft.propose(7, history, 4) == []  # catching up: one chunk a step
    assert draft.propose(7, history, 4) == []
    steps = [4, 0, 2, 4, 1]  # proposals accepted each step (0: the first one rejected)
    for accepted in steps:
        proposals = draft.propose(7, history, 4)
        assert proposals == greedy(reference, history, 4)
        assert draft.rows[7].consumed == history + proposals[:-1]
        cache_matches_a_fresh_prefill(draft, 7)
        other_token = (proposals[accepted] + 1) % 256 if accepted < 4 else 65
        history = history + proposals[:accepted] + [other_token]
    draft.forget({8: None})
    assert draft.rows == {}


def test_a_draft_with_another_tokenizer_is_refused_with_the_difference(served, tmp_path):
    words = write_tiny_model(tmp_path / "words", words=("hello",))
    with pytest.raises(DraftError) as refused:
        draft_of(words, served)
    message = str(refused.value)
    assert f"DRAFT_MODEL={words}" in message and "served model served" in message
    assert "vocabularies differ (259 and 260 tokens: 0 only in the served model's, 1" in message
    eos = write_tiny_model(tmp_path / "eos")
    config = json.loads((eos / "tokenizer_config.json").read_text())
    (eos / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    why = tokenizer_difference(load_tokenizer(served), load_tokenizer(eos))
    assert why == "the end-of-text ids differ ([258] and [256])"
    assert tokenizer_difference(load_tokenizer(served), load_tokenizer(served)) is None


def test_a_draft_that_cannot_load_is_refused_with_the_reason(served, tmp_path):
    with pytest.raises(DraftError, match=r"DRAFT_MODEL='/nowhere/x' is neither .* no draft"):
        draft_of("/nowhere/x", served)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftError, match="not an MLX model .missing config.json"):
        draft_of(tmp_path / "empty", served)
    broken = write_tiny_model(tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(DraftError, match="cannot load it"):
        draft_of(broken, served)


@pytest.mark.parametrize("which", ["served", "other"])
def test_speculation_with_a_draft_gives_the_same_answers(served, other, which):
    """Greedy rows, alone and four together (one with a penalty, whose positions count the
    proposals before them); prompt lookup first, the draft where it has nothing. The served
    model as its own draft is nearly always right, another random model mostly wrong."""
    tiny = load_model(served)[0], load_tokenizer(served)
    submits = [
        request("a", "abcabcabc", max_tokens=24),
        request("b", "the cat sat on the mat", max_tokens=24),
        request("c", "0101 0101", max_tokens=24),
        request("penalty", "xyz xyz", max_tokens=24, presence_penalty=0.5),
    ]
    off = generate(tiny, submits, spec_tokens=0)
    draft = draft_of(served if which == "served" else other, served)
    speculator = Speculator(4, rule=False, draft=draft)
    on = generate(tiny, submits, spec_tokens=4, speculator=speculator)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert on["penalty"][1].timings.proposed_tokens > 0
    figures = speculator.draft_totals
    assert figures.proposed > 0
    if which == "served":
        assert figures.accepted >= 0.9 * figures.proposed
    else:
        assert figures.accepted < 0.5 * figures.proposed
    stats = speculator.stats()
    assert stats.draft_model == str(draft.name) and stats.draft_proposed_tokens == figures.proposed
    assert draft.rows == {}  # every row left: their caches went with them
    alone = generate(tiny, submits[:1], 4, speculator=Speculator(4, rule=False, draft=draft))
    assert alone["a"][0] == off["a"][0]


def test_the_plan_counts_the_draft_on_rank_0(served, other):
    hosts = [RankHost(host="here", cores=2, memory_bytes=2**34)] * 2
    plain = check_fit(served, hosts, None, "tensor", sequences=4, sequence_length=512)
    report = check_fit(served, hosts, None, "tensor", 4, 512, draft_dir=other)
    first, second = report.ranks
    weights = (other / "model.safetensors").stat().st_size
    assert weights - 4096 < first.draft_weight_bytes < weights  # the file less its header
    assert first.draft_kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, k+v, heads, dim, f32
    assert first.draft_kv_bytes == 4 * 512 * first.draft_kv_bytes_per_token
    assert first.needed_bytes == plain.ranks[0].needed_bytes + first.draft_bytes
    assert second.draft_bytes == 0 and second.needed_bytes == plain.ranks[1].needed_bytes
    assert first.longest_context < plain.ranks[0].longest_context  # the draft's KV beside
    text = "\n".join(report.describe())
    assert "+ draft model" in text and f"(DRAFT_MODEL): {other}" in text


def test_the_plan_command_resolves_the_draft_or_names_why_not(other, capsys):
    assert draft_dir(Settings(_env_file=None, draft_model=str(other))) == other.resolve()
    assert draft_dir(Settings(_env_file=None, draft_model="")) is None
    assert draft_dir(Settings(_env_file=None, draft_model="/nowhere/x")) is None
    assert "draft model left out: DRAFT_MODEL='/nowhere/x'" in capsys.readouterr().err
