"""Speculative decoding in one process: rank 0's scheduler and the batch engine, stepped as
the leader steps them (without the broadcast), on a tiny random model.

Greedy and seeded answers are the same with speculation on and off (the rows of a batch
accepting different runs, their rejected positions rolled back); sampled answers keep the
model's distribution over many draws with different seeds.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from bench.spec_replay import replay
from distributed.chips import link_named
from distributed.plan import make_plan
from distributed.step_model import ClusterModel, Machine, Speed
from distributed.step_work import plan_work
from engine.batch_engine import BatchEngine
from engine.compiled_decode import STEP
from engine.step_plan import StepPlan
from ipc.protocol import Delta, Done, Error, SamplingParams, Submit
from leader.constraints import GrammarTokens
from leader.new_shapes import CHARGE, NewShapes
from leader.prompt_lookup import PromptLookup
from leader.requests import Requests
from leader.scheduler import Scheduler
from leader.spec_rule import Evidence, MatchOdds, StepCosts, choose_width
from leader.speculation import Speculator
from tests.support.tiny_models import write_tiny_model
from tests.test_step_model import SMOL


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), never_stops=True)
    return load_model(directory)[0], load_tokenizer(directory)


def flat_costs() -> StepCosts:
    """Step costs of a host where positions are nearly free (a small model on a GPU): the
    per-step rule then speculates wherever a row proposes."""
    costs = StepCosts(max_rows=1024, prior=lambda rows: 10.0)
    for rows in range(1, 1025):
        costs.observe(rows, eager=False, ms=10.0)
        costs.observe(rows, eager=True, ms=10.0 + rows / 1000)
    return costs


def generate(
    tiny,
    submits: list[Submit],
    spec_tokens: int,
    batch: int = 8,
    speculator=None,
    grammar: GrammarTokens | None = None,
    logprobs: dict[str, list] | None = None,
) -> dict:
    """Run `submits` to the end, `batch` at a time; {id: (token ids, Done)}. `speculator`:
    one of the test's own instead of prompt lookup with `spec_tokens`; `logprobs`: filled
    with each answer's streamed logprobs."""
    model, tokenizer = tiny
    speculator = speculator or Speculator(spec_tokens, costs=flat_costs())
    scheduler = Scheduler(Requests(tokenizer, 512, grammar=grammar), batch, speculator=speculator)
    engine = BatchEngine(model, 256)
    for submit in submits:
        scheduler.requests.submit("conn", submit)
    tokens: dict[str, list[int]] = {s.id: [] for s in submits}
    accepted: dict[str, int] = {s.id: 0 for s in submits}
    done: dict[str, Done] = {}
    if logprobs is not None:
        logprobs.update({s.id: [] for s in submits})
    while scheduler.has_work(engine):
        plan = StepPlan.decode(scheduler.build_plan(engine).encode())
        engine.apply(plan)
        scheduler.on_result(engine.run(scheduler.sampling_rows))
        scheduler.stream_pending()
        for _, message in scheduler.requests.outbox:
            assert not isinstance(message, Error), message
            if isinstance(message, Delta):
                tokens[message.id] += message.token_ids
                accepted[message.id] += message.accepted
                if logprobs is not None:
                    logprobs[message.id] += message.logprobs or []
            elif isinstance(message, Done):
                done[message.id] = message
        scheduler.requests.outbox = []
    for key, count in accepted.items():  # the Deltas say which tokens were proposals
        total = done[key].timings.accepted_tokens  # a run cut by a stop string sends less
        assert total - speculator.tokens <= count <= total, (key, count, done[key].timings)
    return {key: (tokens[key], done[key]) for key in tokens}


def request(request_id: str, prompt: str, max_tokens: int = 40, **params) -> Submit:
    params = {"max_tokens": max_tokens, "temperature": 0.0, **params}
    return Submit(id=request_id, prompt=prompt, params=SamplingParams(**params))


def test_prompt_lookup_proposes_the_latest_continuation():
    index = PromptLookup()
    index.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3])
    assert index.propose(3) == [5, 6, 7]  # (2, 3) last came before 5; (7, 2, 3) never did
    index.extend([5])
    assert index.propose(2) == [6, 7]  # the match is followed: 5 came after (2, 3)
    assert index.propose(0) == []
    lone = PromptLookup()
    lone.extend([1, 2, 3])
    assert lone.propose(4) == []


def test_prompt_lookup_follows_its_match_past_common_repeats():
    """A copy is followed while the answer keeps to it, though its last tokens occur later
    elsewhere; a token off the copy searches anew."""
    source = [10, 11, 12, 13, 14, 15, 16, 17]
    index = PromptLookup()
    index.extend([*source, 99, 12, 13, 50, 10, 11])  # (12, 13) repeats later, before 50
    assert index.propose(2) == [12, 13]
    index.extend([12, 13])  # on the copy: its continuation, not the latest (12, 13)'s 50
    assert index.propose(3) == [14, 15, 16] and index.run == 4
    index.extend([77])  # off the copy, nothing matches (13, 77)
    assert index.propose(3) == [] and index.run == 0


@pytest.mark.parametrize("before", [500, 1020, 1022])  # 1024: the history's first array
def test_prompt_lookup_follows_an_answer_repeating_itself_into_its_new_tokens(before):
    """An answer looping on a short cycle follows a match whose continuation is its own
    latest tokens; a step that accepts several moves the match into the tokens it adds,
    across the history's growth too (rank 0 once stopped there with an IndexError)."""
    cycle = [7, 8, 9]
    index = PromptLookup()
    index.extend([1, 2] + [cycle[i % 3] for i in range(before)])
    proposal = index.propose(8)
    assert proposal and proposal == [cycle[(before + i) % 3] for i in range(len(proposal))]
    run = index.run
    accepted = [cycle[(before + i) % 3] for i in range(6)]
    index.extend(accepted)  # the match walks past the history as it was before this call
    assert index.cursor is not None and index.run == run + 6
    assert index.propose(3) == [cycle[(before + 6 + i) % 3] for i in range(3)]
    index.extend([42])  # off the cycle: searched anew
    assert index.run == 0


def test_greedy_and_seeded_answers_are_the_same_with_speculation(tiny):
    submits = [
        request("loop", "abcabcabc"),
        request("text", "the cat sat on the mat, the cat"),
        request("penalty", "abab", repetition_penalty=1.3),
        request("seeded", "hello hello", temperature=0.4, top_k=20, seed=3),
        request("short", "xyz", max_tokens=5),
    ]
    off = generate(tiny, submits, spec_tokens=0)
    for spec_tokens in (1, 4):
        on = generate(tiny, submits, spec_tokens=spec_tokens)
        assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
        timings = {k: v[1].timings for k, v in on.items()}
        assert timings["loop"].accepted_tokens > 0
        assert sum(t.proposed_tokens - t.accepted_tokens for t in timings.values()) > 0
        assert all(len(on[k][0]) == s.params.max_tokens for k, s in zip(on, submits, strict=True))
    alone = generate(tiny, [submits[3]], spec_tokens=4)  # a seeded answer, alone
    assert alone["seeded"][0] == off["seeded"][0]
    # two at a time: later requests prefill and join while the others speculate
    pairs = generate(tiny, submits, spec_tokens=4, batch=2)
    assert {k: v[0] for k, v in pairs.items()} == {k: v[0] for k, v in off.items()}


def test_a_stop_string_inside_an_accepted_run_ends_the_answer_there(tiny):
    """The answer loops 5 tokens from its 15th; a stop string of two loops first completes
    inside a run of 4 accepted tokens (3 proposals and one), and the tokens taken after it
    are not counted (they were, before `Request.stream` dropped them)."""
    model, tokenizer = tiny
    (tokens, _), *_ = generate(tiny, [request("loop", "abcabcabc")], 0).values()
    text = tokenizer.decode(tokens)
    start = len(tokenizer.decode(tokens[:15]))
    submit = request("stop", "abcabcabc", stop=[text[start : start + 8]])
    off = generate(tiny, [submit], spec_tokens=0)["stop"]
    on = generate(tiny, [submit], spec_tokens=3)["stop"]
    assert on[1].timings.accepted_tokens > 0
    assert on[1].finish_reason == off[1].finish_reason == "stop"
    assert on[0] == off[0]
    assert on[1].usage == off[1].usage


def chi_square_z(first: Counter, second: Counter) -> float:
    """Two-sample chi-square of two samples' category counts, as a z-score
    (Wilson-Hilferty); categories seen fewer than 10 times in all are pooled."""
    n1, n2 = sum(first.values()), sum(second.values())
    pooled = Counter({k: first[k] + second[k] for k in first | second})
    rare = [k for k, n in pooled.items() if n < 10]
    for sample in (first, second, pooled):
        sample["rare"] = sum(sample.pop(k, 0) for k in rare)
    categories = [k for k in pooled if pooled[k]]
    statistic = 0.0
    for k in categories:
        for sample, size in ((first, n1), (second, n2)):
            expected = pooled[k] * size / (n1 + n2)
            statistic += (sample[k] - expected) ** 2 / expected
    dof = len(categories) - 1
    return ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))


def test_sampled_answers_keep_the_models_distribution(tiny):
    """Many seeds with speculation on against other seeds with it off: the tokens at answer
    positions where the answers loop (and proposals are accepted or rejected) are drawn
    alike. At temperature 0.3 the tiny model loops often enough to propose."""
    draws, length = 320, 24

    def sampled(seeds: range, spec_tokens: int) -> dict:
        submits = [
            request(f"s{seed}", "abcabcabc", max_tokens=length, temperature=0.3, seed=seed)
            for seed in seeds
        ]
        return generate(tiny, submits, spec_tokens, batch=64)

    on = sampled(range(draws), spec_tokens=4)
    off = sampled(range(draws, 2 * draws), spec_tokens=0)
    proposed = sum(done.timings.proposed_tokens for _, done in on.values())
    accepted = sum(done.timings.accepted_tokens for _, done in on.values())
    assert draws < accepted < proposed - draws  # many accepted, many rejected
    positions = (4, 8, 12, 16, 20, 23)
    for position in positions:
        z = chi_square_z(
            Counter(tokens[position] for tokens, _ in on.values()),
            Counter(tokens[position] for tokens, _ in off.values()),
        )
        assert z < 4.0, f"answer position {position}: z = {z:.2f}"
    # and the test can tell: the same draws against the greedy answer's tokens differ
    (greedy, _), *_ = generate(tiny, [request("g", "abcabcabc", max_tokens=length)], 0).values()
    z = chi_square_z(Counter(tokens[12] for tokens, _ in on.values()), Counter({greedy[12]: draws}))
    assert z > 4.0


def cpu_step_model() -> ClusterModel:
    """The step-time model of the default model on one rank of this project's CPU host, from
    its probe's rates (2 threads, native/sgemm_rows.c; distributed/step_probe.py)."""
    rates = ((1, 16.0e6), (2, 14.1e6), (4, 13.0e6), (8, 10.5e6), (16, 6.7e6), (128, 2.2e6))
    machine = Machine("cpu", 2**34, 2, rates=rates, attention_flops_per_ms=3e7, kv_bytes_per_ms=5e6)
    plan = make_plan(SMOL, 1, None)
    return ClusterModel(plan_work(plan, 4, [46080.0]), Speed((machine,), link_named("ring-local")))


def test_the_step_rule_speculates_where_tokens_per_ms_rise():
    costs = StepCosts(prior=cpu_step_model().decode_ms)
    assert choose_width([[0.8] * 4], costs) >= 4  # one row, proposals usually accepted
    assert choose_width([[0.02] * 4], costs) == 1  # rarely accepted: a plain step
    assert choose_width([[], [0.9] * 3], costs) > 1  # zero proposals in a wide step
    full = [[0.4] * 4] * 8
    assert choose_width(full, costs) == 1  # a full batch: rows fill the step
    assert choose_width([[0.95] * 4] * 8, costs) == 2  # ... unless nearly all are accepted
    assert choose_width([[1.0] * 4] * 16, costs) == 1  # past the measured rows
    # a proposal counts only while the ones before it are accepted: a sure first and a
    # hopeless second make a step of 2 positions
    assert choose_width([[0.99, 0.01, 0.99, 0.99]], costs) == 2
    # rank 0's own measurements replace the prior: here extra positions cost a full step
    for _ in range(30):  # a running average: one slow step does not decide
        for rows in (1, 2, 3, 4, 5):
            costs.observe(rows, eager=False, ms=30.0 * rows)
    assert choose_width([[0.8] * 4], costs) == 1


def test_a_width_that_would_trace_a_new_shape_is_priced_for_it():
    """The compiled decode traces each (rows, width, buffer length) once: rank 0 follows
    the shapes its plans made and charges a new one part of what such steps measured."""
    shapes = NewShapes(keep=3)
    assert shapes.take(1, 4, 100) and not shapes.take(1, 4, 101)  # one buffer of STEP
    assert shapes.take(1, 4, 100 + STEP)  # the buffer grew: a new length
    assert shapes.take(2, 4, 101) and shapes.take(1, 9, 101)  # other rows, another width
    assert shapes.take(1, 4, 100)  # past `keep`, the least recent was dropped
    assert shapes.price(1, 5, 101) == 0.0  # nothing measured yet: no charge
    costs = StepCosts(prior=lambda rows: 40.0 + 5.0 * rows)
    for _ in range(40):  # steps that traced: 60 ms over their width's time
        costs.observe(4, eager=False, ms=60.0 + 60.0, new_shape=True)
    assert costs.predict(4, eager=False) == 60.0  # they do not count in the width's time
    assert abs(costs.shapes.extra_ms - 60.0) < 0.1
    assert costs.shapes.price(1, 4, 300) == CHARGE * costs.shapes.extra_ms
    chances = [[0.5]]  # one proposal, even odds
    assert choose_width(chances, costs) == 2  # unpriced: 1.5 tokens in 50 ms beat 1 in 45
    costs.shapes.take(1, 1, 300)  # the plain width's shape at this length is made
    assert choose_width(chances, costs, cached=300) == 1  # a new 2-wide shape: 80 ms
    costs.shapes.take(1, 2, 300)
    assert choose_width(chances, costs, cached=300) == 2  # made already: no charge


def test_a_rows_estimate_follows_its_latest_trials():
    evidence = Evidence()
    assert evidence.rate == 0.5
    evidence.verified(0, 4)  # its first proposals missed (an answer opening with prose)
    evidence.verified(0, 4)
    evidence.trial(False)
    assert evidence.rate < 0.2 and choose_width([[evidence.rate] * 4], StepCosts()) <= 2
    for _ in range(4):  # then it copies: free shadow trials while the rule leaves it out
        evidence.trial(True)
    assert choose_width([[evidence.rate] * 4], StepCosts()) >= 4
    for _ in range(200):  # no trials for long: back toward the prior, never locked out
        evidence.idle()
    assert abs(evidence.rate - 0.5) < 0.01


def test_the_odds_of_a_match_follow_how_long_it_has_held():
    """Short matches that often break and long ones that hold: the odds learn each length's
    own rate, forget old trials, and a long match is proposed for wider than a fresh one
    in the same row."""
    odds = MatchOdds()
    assert odds.chance(2) == odds.chance(40) == 0.5  # the prior
    for i in range(400):
        odds.trial(2, i % 3 == 0)  # a fresh 2-gram: accepted one time in three
        odds.trial(40, i % 20 != 0)  # a match held for 40 tokens: 95%
    assert abs(odds.chance(2) - 1 / 3) < 0.05 and abs(odds.chance(44) - 0.95) < 0.03
    assert odds.chance(1) == odds.chance(2)  # below the shortest length: counted with it
    costs = StepCosts(prior=cpu_step_model().decode_ms)
    recent = 0.5
    fresh = choose_width([odds.chances(2, 8, recent)], costs)
    held = choose_width([odds.chances(40, 8, recent)], costs)
    assert held > fresh
    for _ in range(600):  # the traffic changes: long matches start to break
        odds.trial(40, False)
    assert odds.chance(40) < 0.1


def test_an_answer_that_opens_with_prose_then_copies_is_sped_up(tiny):
    """A row rank 0 left out after its first proposals missed is proposed for again once
    it copies (a lifetime average kept it out for good: issue 37). The answer: 8 tokens
    of prose, then a 120-token file of the prompt verbatim; a greedy model that writes it
    is played by taking the answer's own tokens as each position's sample
    (bench/spec_replay.py)."""
    _, tokenizer = tiny
    source = [((i * 37) % 200) + 20 for i in range(120)]  # distinct 6-grams
    prompt = [3, 4, 5, *source, 6, 7]
    answer = [9, 10, 20, 11, 12, 5, 13, 14, *source]  # prose, a false start, then the file
    played = replay(prompt, answer, StepCosts(), 4, tokenizer)
    print(f"{played.tokens} tokens in {played.steps} steps")
    # of the copied tokens, all a 5-position step can accept (4 of 5), less the few
    # before the copy's first 2-gram is found
    assert sum(played.accepted) >= 0.7 * len(source)
    assert not any(played.accepted[:8])  # the prose: nothing to copy
    assert played.steps <= 0.4 * played.tokens
