"""Step plan encoding and the batch fingerprint check (no model needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.batch_engine import BatchEngine, PlanMismatchError
from engine.step_plan import PLAN_VERSION, Insert, PlanDecodeError, StepPlan, Store

ids = st.integers(min_value=0, max_value=2**32 - 1)


@given(
    step=st.integers(min_value=0, max_value=2**63),
    fingerprint=st.integers(min_value=0, max_value=2**64 - 1),
    removes=st.lists(ids, max_size=20),
    tokens=st.lists(ids, max_size=20),
    inserts=st.lists(st.tuples(ids, st.lists(ids, max_size=50), ids, ids, ids), max_size=5),
    stores=st.lists(st.tuples(ids, ids, ids), max_size=5),
    evicts=st.lists(ids, max_size=5),
    prefill=st.none() | ids,
    stop=st.booleans(),
    sleep=st.booleans(),
)
def test_plan_round_trips(
    step, fingerprint, removes, tokens, inserts, stores, evicts, prefill, stop, sleep
):
    plan = StepPlan(
        step=step,
        fingerprint=fingerprint,
        removes=removes,
        tokens=tokens,
        inserts=[Insert(*fields) for fields in inserts],
        stores=[Store(*fields) for fields in stores],
        evicts=evicts,
        prefill=prefill,
        stop=stop,
        sleep=sleep,
    )
    assert StepPlan.decode(plan.encode()) == plan


def test_common_plan_is_small():
    plan = StepPlan(step=10, fingerprint=1, tokens=list(range(8)), removes=[3])
    assert len(plan.encode()) <= 64


def test_bad_bytes_are_refused():
    data = StepPlan(step=1, fingerprint=2, tokens=[1, 2, 3]).encode()
    with pytest.raises(PlanDecodeError, match="truncated"):
        StepPlan.decode(data[:-2])
    with pytest.raises(PlanDecodeError, match="trailing"):
        StepPlan.decode(data + b"\0")
    with pytest.raises(PlanDecodeError, match="version"):
        StepPlan.decode(bytes([PLAN_VERSION + 1]) + data[1:])


def _plan_for(engine: BatchEngine, **fields) -> StepPlan:
    return StepPlan(step=engine.step_index, fingerprint=engine.fingerprint(), **fields)


def test_matching_batches_pass_and_divergent_ones_stop():
    leader, worker = BatchEngine(None, 16), BatchEngine(None, 16)
    plan = _plan_for(leader, inserts=[Insert(1, [5, 6, 7]), Insert(2, [8])])
    for engine in (leader, worker):
        engine.check(plan)
        engine.apply(plan)
        engine.advance_idle()
    plan = _plan_for(leader, removes=[1])
    worker.check(plan)
    # The worker misses a removal: its batch no longer matches rank 0's.
    leader.apply(plan)
    leader.advance_idle()
    worker.advance_idle()
    with pytest.raises(PlanMismatchError, match="fingerprint mismatch"):
        worker.check(_plan_for(leader))


def test_token_count_must_match_the_decode_batch():
    engine = BatchEngine(None, 16)
    with pytest.raises(PlanMismatchError, match="next tokens"):
        engine.apply(_plan_for(engine, tokens=[1]))


@given(
    tokens=st.lists(ids, min_size=1, max_size=20),
    data=st.data(),
    rollbacks=st.lists(st.integers(min_value=1, max_value=2**16 - 1), max_size=20),
)
def test_speculative_plan_round_trips(tokens, data, rollbacks):
    drafts = [data.draw(st.lists(ids, max_size=8)) for _ in tokens]
    drafts = drafts if any(drafts) else []  # all empty: a step that does not speculate
    plan = StepPlan(1, 2, tokens=tokens, drafts=drafts, rollbacks=rollbacks)
    assert StepPlan.decode(plan.encode()) == plan
    without = StepPlan(1, 2, tokens=tokens)
    assert len(without.encode()) < len(plan.encode()) or not (drafts or rollbacks)
