"""The batch engine in one process: batched, chunked and lone prefill agree; plans apply."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.batch_engine import BatchEngine
from engine.step_plan import Insert, StepPlan
from tests.support.tiny_models import write_tiny_model

PROMPTS = [list(range(40, 47)), list(range(60, 100)), list(range(3, 5)), list(range(120, 133))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)
    return load_model(directory)[0]


def greedy_run(model, chunk: int, prompts: list[list[int]], steps: int = 8) -> dict:
    """Feed all prompts at once, decode greedily; {seq id: (tokens, first logits)}."""
    engine = BatchEngine(model, chunk)
    inserts = [Insert(i + 1, p) for i, p in enumerate(prompts)]
    plan = StepPlan(step=0, fingerprint=engine.fingerprint(), inserts=inserts)
    out: dict[int, tuple[list[int], np.ndarray | None]] = {}
    next_tokens: dict[int, int] = {}
    while any(len(out.get(i + 1, ([], None))[0]) < steps for i in range(len(prompts))):
        engine.apply(plan)
        result = engine.run()
        if result.logits is not None:
            rows = np.array(result.logits.astype(mx.float32))
            for seq_id, row in zip(result.seq_ids, rows, strict=True):
                tokens, first = out.get(seq_id, ([], None))
                out[seq_id] = (tokens + [int(row.argmax())], row if first is None else first)
                next_tokens[seq_id] = int(row.argmax())
        plan = StepPlan(
            step=engine.step_index,
            fingerprint=engine.fingerprint(),
            tokens=[next_tokens[s] for s in engine.decode_ids],
        )
    return out


def test_batched_chunked_and_lone_prefill_agree(model):
    together = greedy_run(model, chunk=256, prompts=PROMPTS)  # one padded prefill
    chunked = greedy_run(model, chunk=16, prompts=PROMPTS)  # 40-token prompt in 3 chunks
    for index, prompt in enumerate(PROMPTS):
        alone = greedy_run(model, chunk=256, prompts=[prompt])[1]
        for other in (together[index + 1], chunked[index + 1]):
            assert other[0][: len(alone[0])] == alone[0]
            np.testing.assert_allclose(other[1], alone[1], atol=1e-4)


def test_removing_a_sequence_keeps_the_others_on_track(model):
    reference = greedy_run(model, chunk=256, prompts=PROMPTS[:2], steps=6)
    engine = BatchEngine(model, 256)
    engine.apply(
        StepPlan(0, engine.fingerprint(), inserts=[Insert(1, PROMPTS[0]), Insert(2, PROMPTS[1])])
    )
    rows = np.array(engine.run().logits)
    tokens = {1: [int(rows[0].argmax())], 2: [int(rows[1].argmax())]}
    plan = StepPlan(engine.step_index, engine.fingerprint(), removes=[1], tokens=[tokens[2][-1]])
    for _ in range(5):
        engine.apply(plan)
        result = engine.run()
        assert result.seq_ids == [2]
        tokens[2].append(int(np.array(result.logits)[0].argmax()))
        plan = StepPlan(engine.step_index, engine.fingerprint(), tokens=[tokens[2][-1]])
    assert tokens[2] == reference[2][0][:6]
