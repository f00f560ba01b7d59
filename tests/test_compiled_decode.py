"""Compiled decode against the eager step, in one process: the same logits (within 1e-4,
float32) and greedy tokens step by step, while sequences join, leave (which trims the
buffers' left padding) and grow past 256 positions; the same for speculative steps (rows
of several positions, rejected ones rolled back unevenly); and where it cannot apply, the
eager step runs."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.batch_engine import BatchEngine
from engine.compiled_decode import STEP, CompiledDecode
from engine.last_logits import head_on_last_position
from engine.step_plan import Insert, StepPlan
from tests.support.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)
    return load_model(directory)[0]


# step -> (inserted prompts, removed sequence ids)
SCHEDULE: dict[int, tuple[list[list[int]], list[int]]] = {
    0: ([list(range(40, 230))], []),
    3: ([list(range(5, 9)), list(range(60, 75))], []),
    9: ([], [3]),
    14: ([list(range(100, 140))], []),
    # sequence 1 passed position 256 and goes: the others' left padding is trimmed away,
    # and their buffers are sized to a multiple of STEP again
    80: ([], [1]),
}
STEPS = 100


def run(model, compiled: CompiledDecode | None) -> list[tuple[list[int], np.ndarray]]:
    """Every step's (seq ids, logits) under SCHEDULE, feeding back greedy tokens."""
    engine = BatchEngine(model, 256, compiled=compiled)
    tokens: dict[int, int] = {}
    steps = []
    next_id = 1
    for step in range(STEPS):
        prompts, removes = SCHEDULE.get(step, ([], []))
        inserts = []
        for prompt in prompts:
            inserts.append(Insert(next_id, prompt))
            next_id += 1
        keep = [s for s in engine.decode_ids if s not in removes]
        plan = StepPlan(
            engine.step_index,
            engine.fingerprint(),
            removes=removes,
            inserts=inserts,
            tokens=[tokens[s] for s in keep],
        )
        engine.apply(plan)
        result = engine.run()
        logits = np.array(result.logits.astype(mx.float32))
        for seq, row in zip(result.seq_ids, logits, strict=True):
            tokens[seq] = int(row.argmax())
        steps.append((result.seq_ids, logits))
    return steps


def test_compiled_steps_give_the_eager_logits_and_tokens(model):
    compiled = CompiledDecode(model)
    eager_steps = run(model, None)
    compiled_steps = run(model, compiled)
    assert compiled.enabled
    # every batch size the schedule makes, and buffers past 256 positions
    assert {batch for batch, _, _ in compiled.shapes} == {1, 2, 3}
    assert max(size for _, _, size in compiled.shapes) > 256
    assert all(size % STEP == 0 for _, _, size in compiled.shapes)
    for (ids, eager), (same_ids, logits) in zip(eager_steps, compiled_steps, strict=True):
        assert ids == same_ids
        np.testing.assert_allclose(logits, eager, atol=1e-4)
        assert (logits.argmax(axis=1) == eager.argmax(axis=1)).all()


def speculate(model, compiled: CompiledDecode | None) -> list[tuple[list[int], np.ndarray]]:
    """Three rows of different prompt lengths proposing 0-3 tokens a step (the greedy
    token repeated: some accepted, some not), each keeping its longest greedy-equal run;
    a row leaves at step 12. Every step's (seq ids, logits)."""
    engine = BatchEngine(model, 256, compiled=compiled)
    prompts = [list(range(40, 90)), list(range(7, 20)), list(range(100, 131))]
    plan = StepPlan(
        0, engine.fingerprint(), inserts=[Insert(i + 1, p) for i, p in enumerate(prompts)]
    )
    steps = []
    for step in range(30):
        engine.apply(plan)
        result = engine.run()
        logits = np.array(result.logits.astype(mx.float32))
        steps.append((result.seq_ids, logits))
        chosen = logits.argmax(axis=1)
        tokens, rollbacks, at = {}, [], 0
        drafts = dict(zip(engine.decode_ids, engine._drafts or [[]] * 3, strict=False))
        for seq, width in zip(result.seq_ids, result.widths, strict=True):
            draft = drafts.get(seq, [])
            kept = 0
            while kept < len(draft) and draft[kept] == chosen[at + kept]:
                kept += 1
            tokens[seq] = int(chosen[at + kept])
            rollbacks.append(width - 1 - kept)
            at += width
        removes = [2] if step == 12 else []
        keep = [s for s in engine.decode_ids if s not in removes]
        plan = StepPlan(
            engine.step_index,
            engine.fingerprint(),
            rollbacks=rollbacks if any(rollbacks) else [],
            removes=removes,
            tokens=[tokens[s] for s in keep],
            drafts=[[tokens[s]] * ((step + s) % 4) for s in keep],
        )
    return steps


def test_compiled_speculative_steps_give_the_eager_logits(model):
    """Also across dropped traces: at most 2 are kept here, the least recently used
    dropped first."""
    head_on_last_position(model)
    compiled = CompiledDecode(model, max_traces=2)
    eager_steps = speculate(model, None)
    compiled_steps = speculate(model, compiled)
    assert compiled.enabled
    assert 0 < len(compiled.shapes) <= 2 and compiled.dropped > 0
    for (ids, eager), (same_ids, logits) in zip(eager_steps, compiled_steps, strict=True):
        assert ids == same_ids
        np.testing.assert_allclose(logits, eager, atol=1e-4)
        assert (logits.argmax(axis=1) == eager.argmax(axis=1)).all()


class EvaluatesInside:
    """A forward that evaluates mid-way, as pipeline stages and expert routing do."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, inputs, cache=None):
        mx.eval(inputs)
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_forward_that_does_not_trace_decodes_eagerly(model, caplog):
    wrapped = EvaluatesInside(model)
    compiled = CompiledDecode(wrapped)
    with caplog.at_level(logging.WARNING, logger="engine.compiled_decode"):
        steps = run(wrapped, compiled)[:20]
    assert not compiled.enabled and not compiled.shapes
    assert "compiled decode off for this model" in caplog.text
    for (ids, eager), (same_ids, logits) in zip(run(model, None)[:20], steps, strict=True):
        assert ids == same_ids
        np.testing.assert_allclose(logits, eager, atol=1e-4)


def test_the_least_recently_used_trace_is_dropped_first(model):
    compiled = CompiledDecode(model, max_traces=2)
    one, two, three = (1, 1, 64), (1, 2, 64), (2, 1, 64)
    kept = compiled._compiled(one)
    compiled._compiled(two)
    assert compiled._compiled(one) is kept  # used again: now the most recent
    compiled._compiled(three)
    assert compiled.shapes == [one, three] and compiled.dropped == 1
