"""The batch engine in one process: batched, chunked and lone prefill agree; plans apply."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode
from engine.prefix_store import PrefixStore
from engine.step_plan import Insert, StepPlan, Store
from tests.support.tiny_models import write_tiny_model

PROMPTS = [list(range(40, 47)), list(range(60, 100)), list(range(3, 5)), list(range(120, 133))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)
    return load_model(directory)[0]


def greedy_run(
    model,
    chunk: int,
    prompts: list[list[int]],
    steps: int = 8,
    compiled: CompiledDecode | None = None,
    budgets: list[int | None] | None = None,
    kv_bits: int | None = None,
) -> dict:
    """Feed all prompts at once, decode greedily; {seq id: (tokens, first logits)}.
    `budgets`: the prefill budget each plan carries in turn (as rank 0's would), cycled."""
    engine = BatchEngine(model, chunk, compiled=compiled, prefix=PrefixStore(kv_bits))
    inserts = [Insert(i + 1, p) for i, p in enumerate(prompts)]
    cycle = itertools.cycle(budgets or [None])
    plan = StepPlan(step=0, fingerprint=engine.fingerprint(), inserts=inserts, prefill=next(cycle))
    out: dict[int, tuple[list[int], np.ndarray | None]] = {}
    next_tokens: dict[int, int] = {}
    while any(len(out.get(i + 1, ([], None))[0]) < steps for i in range(len(prompts))):
        engine.apply(plan)
        decoding = bool(engine.decode_ids)
        result = engine.run()
        if budgets and decoding:  # beside answers, a step prefills the plan's budget at most
            assert result.prefill_tokens <= engine.prefill_budget
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
            prefill=next(cycle),
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


def test_greedy_tokens_do_not_depend_on_the_plans_prefill_budgets(model):
    """Rank 0 changes the chunk every step, or skips it (leader/prefill_budget.py): a long
    prompt prefilled in uneven chunks beside running answers decodes as it does alone."""
    # the 130-token one arrives with them; its ids stay below the tiny model's 259 embedding
    # rows (a gather past them reads whatever memory follows: 200-330 made this test flaky)
    prompts = [*PROMPTS[:3], list(range(100, 230))]
    uneven = greedy_run(model, chunk=64, prompts=prompts, budgets=[7, 33, 0, 1, 64, 16, 5])
    for index, prompt in enumerate(prompts):
        alone = greedy_run(model, chunk=256, prompts=[prompt])[1]
        assert uneven[index + 1][0][: len(alone[0])] == alone[0]
        np.testing.assert_allclose(uneven[index + 1][1], alone[1], atol=1e-4)


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


def _last_logits(engine: BatchEngine, plan: StepPlan) -> np.ndarray:
    engine.apply(plan)
    result = engine.run()
    return np.array(result.logits.astype(mx.float32))[-1]


@pytest.mark.parametrize("reuse", [30, 20])
def test_a_prefix_entry_gives_the_logits_of_a_full_prefill(model, reuse):
    prompt = list(range(40, 100))
    full = greedy_run(model, chunk=256, prompts=[prompt], steps=1)[1][1]
    engine = BatchEngine(model, 256)
    first = Insert(1, prompt[:30], store_as=7)
    _last_logits(engine, StepPlan(0, engine.fingerprint(), inserts=[first]))
    assert engine.prefix.length(7) == 30
    again = Insert(2, prompt[reuse:], prefix_entry=7, prefix_len=reuse)
    plan = StepPlan(engine.step_index, engine.fingerprint(), removes=[1], inserts=[again])
    np.testing.assert_allclose(_last_logits(engine, plan), full, atol=1e-4)
    assert engine.prefix.length(7) == 30  # reusing an entry leaves it as it was


def test_a_prefilling_sequence_keeps_what_it_prefilled_when_it_leaves(model):
    """A prompt cancelled mid-prefill: its chunks so far become an entry (stored before the
    sequence is removed, in the plan's order), and a request resuming from it gets the
    logits of a full prefill."""
    prompt = list(range(40, 100))
    full = greedy_run(model, chunk=256, prompts=[prompt], steps=1)[1][1]
    engine = BatchEngine(model, 16)
    plan = StepPlan(0, engine.fingerprint(), inserts=[Insert(1, prompt)])
    for _ in range(2):  # two chunks of 16
        engine.apply(plan)
        assert engine.run().logits is None
        plan = StepPlan(engine.step_index, engine.fingerprint())
    resume = Insert(2, prompt[32:], prefix_entry=9, prefix_len=32)
    stores = [Store(1, 9, 32)]
    plan = StepPlan(engine.step_index, engine.fingerprint(), stores=stores, removes=[1])
    engine.apply(plan)
    assert [p.seq_id for p in engine.prefilling] == [] and engine.prefix.length(9) == 32
    engine.advance_idle()
    plan = StepPlan(engine.step_index, engine.fingerprint(), inserts=[resume], prefill=256)
    np.testing.assert_allclose(_last_logits(engine, plan), full, atol=1e-4)


def test_a_finished_sequence_is_stored_and_serves_its_continuation(model):
    prompt = list(range(60, 90))
    engine = BatchEngine(model, 256)
    row = _last_logits(engine, StepPlan(0, engine.fingerprint(), inserts=[Insert(1, prompt)]))
    fed = []
    for _ in range(4):
        token = int(row.argmax())
        fed.append(token)
        plan = StepPlan(engine.step_index, engine.fingerprint(), tokens=[token])
        row = _last_logits(engine, plan)
    store = Store(1, 9, len(prompt) + 4)  # the prompt and the four tokens fed back
    reuse = Insert(2, [int(row.argmax())], prefix_entry=9, prefix_len=len(prompt) + 4)
    plan = StepPlan(
        engine.step_index, engine.fingerprint(), removes=[1], stores=[store], inserts=[reuse]
    )
    whole = greedy_run(model, chunk=256, prompts=[prompt + fed + [int(row.argmax())]], steps=1)
    np.testing.assert_allclose(_last_logits(engine, plan), whole[1][1], atol=1e-4)


def test_a_burst_of_short_prompts_prefills_in_one_step_unless_answers_run(model):
    prompts = [list(range(10 + i, 50 + i)) for i in range(8)]  # 8 x 40 tokens > 64 budget
    engine = BatchEngine(model, 64)
    inserts = [Insert(i + 1, p) for i, p in enumerate(prompts)]
    engine.apply(StepPlan(0, engine.fingerprint(), inserts=inserts))
    assert len(engine.run().seq_ids) == 8  # one batched forward: every prompt is done
    later = [Insert(20 + i, p) for i, p in enumerate(prompts[:4])]
    tokens = [1] * 8
    engine.apply(StepPlan(engine.step_index, engine.fingerprint(), tokens=tokens, inserts=later))
    result = engine.run()
    assert len(result.seq_ids) == 8 + 1  # with answers running: one 40-token prompt fits 64


def test_a_burst_with_cached_prefixes_prefills_in_one_step_and_decodes_as_alone(model):
    """Rows from prefix entries (of different prefix lengths) beside a whole, left-padded
    prompt, as rank 0 aligns a burst (leader/prefix_cache.py): one forward, and each row's
    logits and greedy tokens those of its prompt alone."""
    shared = list(range(40, 70))
    prompts = [shared + list(range(200, 213)), shared[:25] + list(range(100, 121)), [5, 6, 7]]
    width = 21  # the longest rest: the second prompt's after its 25 cached tokens
    engine = BatchEngine(model, 32)  # one by one, 21 + 21 tokens would take two steps
    _last_logits(engine, StepPlan(0, engine.fingerprint(), inserts=[Insert(1, shared, store_as=7)]))
    reused = [len(prompts[0]) - width, 25]
    inserts = [
        Insert(2, prompts[0][reused[0] :], prefix_entry=7, prefix_len=reused[0]),
        Insert(3, prompts[1][25:], prefix_entry=7, prefix_len=25),
        Insert(4, prompts[2]),
    ]
    engine.apply(StepPlan(engine.step_index, engine.fingerprint(), removes=[1], inserts=inserts))
    result = engine.run()
    assert result.seq_ids == [2, 3, 4]  # one step: the three prefilled in one forward
    rows = np.array(result.logits.astype(mx.float32))
    tokens = {seq: [int(row.argmax())] for seq, row in zip(result.seq_ids, rows, strict=True)}
    for _ in range(4):
        plan = StepPlan(
            engine.step_index, engine.fingerprint(), tokens=[t[-1] for t in tokens.values()]
        )
        engine.apply(plan)
        rows = np.array(engine.run().logits.astype(mx.float32))
        for seq, row in zip(tokens, rows, strict=True):
            tokens[seq].append(int(row.argmax()))
    for seq, prompt, first in zip(
        tokens, prompts, np.array(result.logits.astype(mx.float32)), strict=True
    ):
        alone = greedy_run(model, chunk=256, prompts=[prompt], steps=5)[1]
        np.testing.assert_allclose(first, alone[1], atol=1e-4)
        assert tokens[seq] == alone[0][:5]


def test_a_requests_kv_grows_with_its_tokens(model):
    """Nothing reserves the context (MAX_SEQUENCE_LENGTH is rank 0's admission rule only):
    a 7-token request in a batch beside a 40-token one holds caches of a few hundred
    positions (mlx-lm grows them 256 at a time), not of any context length."""
    from engine.batch_caches import cache_arrays

    engine = BatchEngine(model, 64)
    engine.apply(
        StepPlan(
            step=0,
            fingerprint=engine.fingerprint(),
            inserts=[Insert(1, PROMPTS[0]), Insert(2, PROMPTS[1])],
        )
    )
    engine.run()
    assert engine.kv_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    held = sum(a.nbytes for a in cache_arrays(engine._decode_cache or []))
    layer = model.layers[0].self_attn
    per_position = 2 * layer.n_kv_heads * (layer.k_proj.weight.shape[0] // layer.n_kv_heads) * 4
    assert 0 < held <= 2 * 512 * per_position * len(model.layers)  # 2 rows, < 512 positions
