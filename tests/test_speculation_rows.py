"""Rows with penalties, logprobs or a grammar speculate, and answer as without: each later
position of a step samples as the plain step reaching it would (leader/sampler.py
`rows_after`); a grammar's row proposes what it allows, first the tokens it forces."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from ipc.protocol import OutputFormat, SamplingParams, Submit
from leader.constraints import GrammarTokens
from leader.sampler import RequestSampler
from leader.speculation import Speculator
from tests.support.tiny_models import write_tiny_model
from tests.test_speculation import flat_costs, generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), never_stops=True)
    return load_model(directory)[0], load_tokenizer(directory)


SAYING = {"type": "object", "properties": {"said": {"type": "string"}}, "required": ["said"]}


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.15},
        {"presence_penalty": 0.4, "frequency_penalty": 0.2},
        {"logprobs": True, "top_logprobs": 3},
        {"temperature": 0.3, "seed": 11, "frequency_penalty": 0.05, "logprobs": True},
        {"grammar": True},
        {"grammar": True, "temperature": 0.7, "seed": 5, "repetition_penalty": 1.1},
    ],
    ids=["repetition", "presence", "logprobs", "sampled", "grammar", "grammar-sampled"],
)
def test_penalties_grammars_and_logprobs_speculate_and_answer_as_without(tiny, params):
    """A row with penalties, a grammar or logprobs proposes too; each later position of a
    step samples as the plain step reaching it would (the proposals before it counted by
    its penalties, its grammar advanced past them), so tokens and logprobs are the same
    with speculation on and off, and some proposals are accepted. A grammar's row proposes
    only what the grammar allows, and first the tokens it forces."""
    model, tokenizer = tiny
    params = dict(params)
    grammar = None
    output = None
    if params.pop("grammar", False):
        grammar = GrammarTokens(tokenizer, model.args.vocab_size, tokenizer.eos_token_ids)
        output = OutputFormat(type="json_schema", json_schema=SAYING)
    prompts = {"a": "abcabcabcabc", "b": '{"said": "the cat sat on the mat, the cat sat'}
    submits = [
        Submit(
            id=key,
            prompt=prompt,
            params=SamplingParams(**{"max_tokens": 48, "temperature": 0.0, **params}),
            output=output,
        )
        for key, prompt in prompts.items()
    ]
    off_logprobs: dict[str, list] = {}
    off = generate(tiny, submits, 0, grammar=grammar, logprobs=off_logprobs)
    on_logprobs: dict[str, list] = {}
    speculator = Speculator(4, costs=flat_costs())
    on = generate(tiny, submits, 4, speculator=speculator, grammar=grammar, logprobs=on_logprobs)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert {k: v[1].finish_reason for k, v in on.items()} == {
        k: v[1].finish_reason for k, v in off.items()
    }
    if params.get("logprobs"):
        for key in prompts:
            assert len(on_logprobs[key]) == len(on[key][0])
            for a, b in zip(on_logprobs[key], off_logprobs[key], strict=True):
                assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
                assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    timings = [done.timings for _, done in on.values()]
    assert sum(t.proposed_tokens for t in timings) > 0
    assert sum(t.accepted_tokens for t in timings) > 0
    if grammar is not None:  # what the grammar let through is the schema's JSON
        assert speculator.forced_odds.chance(0) > 0.9  # `{"said": "` proposed, accepted
        for tokens, done in on.values():
            if done.finish_reason == "stop":
                assert "said" in json.loads(tokenizer.decode(tokens))


def test_a_steps_later_positions_count_the_proposals_before_them():
    """Position j of a speculative step: the key of the answer's token j on, penalties
    counting proposals[:j] as drawn (lookup's proposals are copies, so repetition and
    presence rarely change; frequency does, and a draft model's new tokens would)."""
    params = SamplingParams(max_tokens=9, presence_penalty=0.5, frequency_penalty=0.25)
    sampler = RequestSampler(params, [1, 2], None)
    sampler.record(7)
    first, second = sampler.rows_after([7, 8])
    assert first.counts == {7: 2} and second.counts == {7: 2, 8: 1}
    assert (first.seed, second.seed) == (
        sampler._row(1, (), None).seed,
        sampler._row(2, (), None).seed,
    )
    assert sampler.row().counts == {7: 1}  # the next token's own row is as before
    repeated = RequestSampler(SamplingParams(max_tokens=9, repetition_penalty=1.2), [1, 2], None)
    assert list(repeated.rows_after([5, 1])[1].seen) == [1, 2, 5]
