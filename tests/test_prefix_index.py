"""Rank 0's prefix index and policy in one process: longest token-level match, budgets,
LRU eviction, replaced and pending entries, and the plan operations they produce."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from leader.prefix_cache import HOLD_FOR_TOKENS, PlanOps, PrefixCache
from leader.prefix_index import PrefixIndex

SEQUENCES = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), max_size=8)


def _common(a: list[int], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(stored=SEQUENCES, query=st.lists(st.integers(0, 3), max_size=14))
def test_match_is_the_longest_prefix_any_ready_entry_shares(stored, query):
    index = PrefixIndex(budget_tokens=10_000, min_tokens=1)
    for tokens in stored:
        index.reserve(tokens, ready=True)
    match = index.match(query)
    best = max((_common(query, e.tokens) for e in index.entries.values()), default=0)
    assert match.length == best
    if best:
        assert match.entry is not None
        assert index.entries[match.entry].tokens[:best] == tuple(query[:best])


@settings(max_examples=200, deadline=None)
@given(stored=SEQUENCES, budget=st.integers(1, 30))
def test_the_budget_is_never_exceeded_and_stores_that_cannot_fit_are_refused(stored, budget):
    index = PrefixIndex(budget_tokens=budget, min_tokens=1)
    for tokens in stored:
        before = dict(index.entries)
        reservation = index.reserve(tokens, ready=True)
        assert index.cached_tokens <= budget
        if reservation is None:
            assert index.entries == before  # a refused store evicts nothing
        else:
            assert index.entries[reservation.entry].tokens == tuple(tokens)


def test_least_recently_used_goes_first_and_replaced_entries_are_not_evictions():
    index = PrefixIndex(budget_tokens=10, min_tokens=1)
    a = index.reserve([1, 1, 1], ready=True)
    b = index.reserve([2, 2, 2], ready=True)
    assert a and b
    index.use(a.entry)  # b is now the least recently used
    c = index.reserve([3, 3, 3, 3, 3], ready=True)
    assert c is not None and c.evicts == [b.entry] and index.evictions == 1
    longer = index.reserve([1, 1, 1, 4], ready=True)  # extends a: a is replaced
    assert longer is not None and longer.evicts == [a.entry] and index.evictions == 1
    assert index.match([1, 1, 1, 4, 5]).length == 4


def test_pending_and_protected_entries_are_never_evicted():
    index = PrefixIndex(budget_tokens=6, min_tokens=1)
    pending = index.reserve([1, 1, 1], ready=False)
    used = index.reserve([2, 2, 2], ready=True)
    assert pending and used
    assert index.reserve([3, 3, 3], ready=True, protected={used.entry}) is None
    assert index.match([1, 1, 1]).length == 0 and index.match([1, 1, 1]).pending_length == 3
    index.forget(pending.entry)
    assert index.match([1, 1, 1]).pending_length == 0
    assert index.reserve([3, 3, 3], ready=True, protected={used.entry}) is not None


def test_admission_reuses_all_but_the_last_prompt_token_and_stores_the_prompt():
    cache = PrefixCache(budget_tokens=1000, min_tokens=4)
    prompt = list(range(100))
    first = cache.admit(1, prompt, PlanOps())
    assert first is not None and first.prefix_entry == 0 and first.store_as
    cache.prefilled(1)
    again = cache.admit(2, prompt, ops := PlanOps())
    assert again is not None and again.prefix_entry == first.store_as
    assert again.prefix_len == 99 and again.tokens == [99]  # the last token runs again
    assert first.store_as in ops.protected and cache.hits == 1 and cache.hit_tokens == 99


def test_a_request_waits_for_a_long_prefix_another_is_storing():
    cache = PrefixCache(budget_tokens=1000, min_tokens=4)
    shared = list(range(HOLD_FOR_TOKENS + 10))
    assert cache.admit(1, shared + [500], PlanOps()) is not None
    assert cache.admit(2, shared + [600], PlanOps()) is None  # pending: wait
    cache.prefilled(1)
    later = cache.admit(2, shared + [600], PlanOps())
    assert later is not None and later.prefix_len == len(shared)


def test_finished_requests_are_stored_and_cancelled_prefills_keep_what_they_prefilled():
    cache = PrefixCache(budget_tokens=1000, min_tokens=4)
    prompt = list(range(50))
    insert = cache.admit(1, prompt, PlanOps())
    assert insert is not None
    cache.finished(1, prompt, completed=False)  # cancelled before its prefill ended
    assert cache.index.entries == {}  # its prompt entry was never stored: forgotten
    ops = PlanOps()
    cache.plan_stores(ops, {1: 32})  # every rank holds 32 positions of it
    assert [(s.seq_id, s.entry, s.length) for s in ops.stores] == [(1, ops.stores[0].entry, 32)]
    assert cache.index.match(prompt).length == 32
    cache.admit(2, prompt, PlanOps())
    cache.prefilled(2)
    cache.finished(2, prompt + [7, 8, 9], completed=True)
    ops = PlanOps()
    cache.plan_stores(ops, {})
    assert [(s.seq_id, s.length) for s in ops.stores] == [(2, 53)]
    assert len(cache.index.entries) == 1  # the shorter entries were replaced by the longer one


def test_a_prefill_cancelled_before_its_first_chunk_stores_nothing():
    cache = PrefixCache(budget_tokens=1000, min_tokens=4)
    cache.admit(1, list(range(50)), PlanOps())
    cache.finished(1, list(range(50)), completed=False)
    ops = PlanOps()
    cache.plan_stores(ops, {})  # it left the engine's prefilling list, or never joined it
    assert ops.stores == [] and cache.index.entries == {}


def test_a_burst_gets_one_width_unless_that_recomputes_too_much():
    cache = PrefixCache(budget_tokens=1000, min_tokens=4)
    system = list(range(100, 140))  # a shared system prompt, stored by a first request
    assert cache.admit(1, system + [1], PlanOps()) is not None
    cache.prefilled(1)
    cache.finished(1, system + [1], completed=False)
    prompts = [system + list(range(200, 210)), system + list(range(300, 312)), list(range(5, 13))]
    inserts = [cache.admit(i + 2, p, PlanOps()) for i, p in enumerate(prompts)]
    assert all(inserts) and [i.prefix_len for i in inserts if i] == [40, 40, 0]
    before = cache.hit_tokens
    cache.align_burst([i for i in inserts if i], prompts, chunk=256)
    # one width, the longest rest (12): 2 tokens of the first prompt's prefix run again,
    # the short prompt stays whole (left-padded by the engine)
    assert [len(i.tokens) for i in inserts if i] == [12, 12, 8]
    assert [i.prefix_len for i in inserts if i] == [38, 40, 0]
    assert [i.tokens for i in inserts if i] == [p[-12:] for p in prompts[:2]] + [prompts[2]]
    assert cache.hit_tokens == before - 2
    # a hit whose whole prompt is no wider than the burst prefills whole: a miss after all
    hits, misses = cache.hits, cache.misses
    burst = [system[:30] + [7] * 5] + [list(range(1000 * k, 1000 * k + 40)) for k in (1, 2, 3, 4)]
    admitted = [cache.admit(20 + k, p, PlanOps()) for k, p in enumerate(burst)]
    assert [i.prefix_len for i in admitted if i] == [30, 0, 0, 0, 0]
    cache.align_burst([i for i in admitted if i], burst, 256)
    assert [(i.prefix_len, i.prefix_entry, len(i.tokens)) for i in admitted if i][0] == (0, 0, 35)
    assert (cache.hits, cache.misses) == (hits, misses + 5)
    # a long rest beside a short one would recompute most of the short one's prefix: no
    lopsided = [cache.admit(9, system + list(range(400, 600)), PlanOps()), inserts[0]]
    widths = [len(i.tokens) for i in lopsided if i]
    cache.align_burst([i for i in lopsided if i], [system + list(range(400, 600)), prompts[0]], 256)
    assert [len(i.tokens) for i in lopsided if i] == widths
