"""Rank 0's prefill budget (leader/prefill_budget.py): large chunks alone, and beside
running answers the most tokens the fitted step-time model keeps within the slowdown."""

from __future__ import annotations

import pytest

from leader.prefill_budget import MIN_CHUNK, QUIET_STEPS, SAVED_STEPS, PrefillBudget

F, A, B = 2.0, 0.02, 1e-5  # ms per forward, per token, per token x context position


def true_ms(pieces: list[tuple[int, int]]) -> float:
    return sum(F + A * c + B * c * (L + c / 2) for L, c in pieces if c)


def trained(decode_ms: float = 10.0, rows: int = 4) -> PrefillBudget:
    """A budget that saw decode steps and prefill steps of a machine of known costs."""
    budget = PrefillBudget(alone=2048, slowdown=2.0)
    for _ in range(5):
        budget.observe(rows, [], decode_ms)
    for context in range(0, 30000, 1500):
        for chunk in (16, 200, 1000):  # alone, and beside the decodes
            budget.observe(0, [(context, chunk)], true_ms([(context, chunk)]))
            both = decode_ms + true_ms([(context, 16)])  # within the budget
            budget.observe(rows, [(context, 16)], both)
    return budget


def test_alone_a_prompt_prefills_the_large_chunk():
    assert PrefillBudget(alone=1024, slowdown=2.0).tokens(0, [(0, 30000)]) == 1024


def test_before_any_decode_step_is_measured_the_chunk_is_the_smallest():
    assert PrefillBudget(alone=1024, slowdown=2.0).tokens(4, [(0, 30000)]) == MIN_CHUNK


def test_the_fit_finds_the_machines_costs():
    budget = trained()
    for pieces in ([(0, 500)], [(20000, 64)], [(8000, 300)]):
        assert budget.predict(pieces) == pytest.approx(true_ms(pieces), rel=0.05)


def prefill_beside_answers(budget: PrefillBudget, start: int, tokens: int) -> list[tuple]:
    """Steps of 4 answers (10 ms) beside a prompt of `tokens` after `start` cached ones,
    on the machine of known costs: (chunk, step ms) each."""
    steps = []
    context = start
    while context < start + tokens:
        chunk = budget.tokens(4, [(context, start + tokens - context)])
        ms = 10.0 + true_ms([(context, chunk)])
        budget.observe(4, [(context, chunk)] if chunk else [], ms)
        steps.append((chunk, ms))
        context += chunk
    return steps


def test_beside_answers_the_steps_stay_within_the_slowdown_on_average():
    for start in (0, 8000, 16000, 30000):
        steps = prefill_beside_answers(trained(decode_ms=10.0), start, 3000)
        mean = sum(ms for _, ms in steps) / len(steps)
        assert mean <= 2.0 * 10.0 * 1.1, (start, mean)
        assert max(ms for _, ms in steps) <= (1 + SAVED_STEPS) * 10.0 * 1.1
        assert mean >= 1.5 * 10.0  # and the prefill uses most of what it may


def test_a_long_context_prefills_in_fewer_larger_steps_than_its_allowance_per_step():
    """At 60K positions even 16 tokens cost more than one step's 10 ms: some steps only
    decode and save their allowance for the next chunk."""
    steps = prefill_beside_answers(trained(decode_ms=10.0), 60000, 1000)
    assert any(chunk == 0 for chunk, _ in steps)
    early = prefill_beside_answers(trained(decode_ms=10.0), 0, 1000)
    assert all(chunk for chunk, _ in early)


def test_a_chunk_is_at_most_twice_the_largest_forward_measured():
    budget = PrefillBudget(alone=2048, slowdown=2.0)
    budget.observe(4, [], 10.0)
    budget.observe(0, [(0, 40)], 2.0)
    taken = []
    for _ in range(4):  # the prior thinks prefill is cheap: the chunk doubles step by step
        budget.credit = 1000.0
        taken.append(budget.tokens(4, [(100, 50000)]))
        budget.observe(4, [(100, taken[-1])], 10.0 + 0.01 * taken[-1])
    assert taken == [80, 160, 320, 640]


def test_a_step_that_ran_over_is_paid_back_by_steps_that_only_decode():
    budget = trained(decode_ms=10.0)
    budget.observe(4, [(1000, 300)], 60.0)  # 50 ms of prefill against 10 allowed a step
    assert budget.credit < 0
    skipped = 0
    while budget.tokens(4, [(1000, 50000)]) == 0:
        budget.observe(4, [], 10.0)
        skipped += 1
    assert skipped >= 3


def test_a_larger_slowdown_gives_larger_chunks():
    small = prefill_beside_answers(trained(), 10000, 2000)
    budget = trained()
    budget.slowdown = 3.0
    large = prefill_beside_answers(budget, 10000, 2000)
    assert len(large) < len(small)


def test_the_decode_cost_is_the_mean_of_quiet_steps():
    """The answers' rate counts their slow steps too (one in four here: another process, a
    collection), so their allowance does; decode-only steps taken while a prompt waits do
    not set it (they carry work of the chunk before them still finishing elsewhere)."""
    budget = PrefillBudget(alone=2048, slowdown=2.0)
    for step in range(QUIET_STEPS):
        budget.observe(4, [], 20.0 if step % 4 == 0 else 4.0)
    assert budget.decode(4) == pytest.approx(8.0)
    for _ in range(40):
        budget.observe(4, [], 25.0, waiting=True)
    assert budget.decode(4) == pytest.approx(8.0)
    assert budget.decode(3) == budget.decode(16) == budget.decode(4)  # the nearest count measured


def test_a_chunks_step_and_the_one_after_it_spend_what_they_took_beyond_a_quiet_one():
    """The decode-only step after a chunk, slowed by it, spends; one faster than the quiet
    mean gives back; decode-only steps further on spend nothing, whatever they took (a
    phase of the host's slow steps must not leave a waiting prompt without credit)."""
    budget = trained(decode_ms=10.0)
    budget.credit = 0.0
    budget.observe(4, [(1000, 16)], 15.0, waiting=True)  # 5 ms of chunk, 10 allowed
    assert budget.credit == pytest.approx(5.0)
    budget.observe(4, [], 16.0, waiting=True)  # 6 ms of the chunk's aftermath
    assert budget.credit == pytest.approx(9.0)
    budget.observe(4, [], 40.0, waiting=True)  # a slow step, two after the chunk
    assert budget.credit == pytest.approx(19.0)
    budget.observe(4, [(1000, 16)], 12.0, waiting=True)
    budget.observe(4, [], 4.0, waiting=True)  # faster than the quiet steps: gives back
    assert budget.credit == pytest.approx(20.0)  # 19 + 8, then + 16, the most kept: 20


def test_the_step_time_models_prior_predicts_before_any_prefill_is_measured():
    # the prior in ms (a forward, a cached position, a token, a token x cached position)
    budget = PrefillBudget(alone=2048, slowdown=2.0, prior=(F, 0.0, A, B))
    for pieces in ([(0, 500)], [(20000, 64)]):
        assert budget.predict(pieces) == pytest.approx(true_ms(pieces), rel=1e-6)
    # measured steps of a machine twice as slow move the fit away from the prior
    for context in range(0, 30000, 1500):
        for chunk in (16, 200, 1000):
            budget.observe(0, [(context, chunk)], 2 * true_ms([(context, chunk)]))
    assert budget.predict([(8000, 300)]) == pytest.approx(2 * true_ms([(8000, 300)]), rel=0.1)


def test_where_any_forward_costs_much_a_chunk_is_worth_its_forward():
    """A machine whose forwards cost 20 ms whatever their tokens (reading a long cache, the
    dispatch) and 0.5 ms a token: 16 tokens would spend 28 ms for 8 ms of prompt, so the
    credit saves past SAVED_STEPS' allowance for 40 tokens (20 ms of them), and the
    answers' steps still average within the slowdown."""
    fixed, per_token = 20.0, 0.5
    budget = PrefillBudget(alone=2048, slowdown=2.0)
    for _ in range(5):
        budget.observe(4, [], 10.0)
    for context in range(0, 30000, 1500):
        for chunk in (16, 200, 1000):
            budget.observe(0, [(context, chunk)], fixed + per_token * chunk)
    steps, done = [], 0
    while done < 2000:
        chunk = budget.tokens(4, [(10000 + done, 2000 - done)])
        ms = 10.0 + (fixed + per_token * chunk if chunk else 0.0)
        budget.observe(4, [(10000 + done, chunk)] if chunk else [], ms, waiting=True)
        steps.append((chunk, ms))
        done += chunk
    chunks = [chunk for chunk, _ in steps if chunk]
    assert min(chunks[:-1]) >= 0.9 * fixed / per_token, chunks  # the last takes what is left
    assert sum(ms for _, ms in steps) / len(steps) <= 2.0 * 10.0 * 1.1
    assert max(ms for _, ms in steps) <= 10.0 + 2 * fixed * 1.1  # a chunk costs about 2x fixed
