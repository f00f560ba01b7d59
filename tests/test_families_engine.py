"""The batch engine in one process on every cache kind the families bring: rotating windows
(mistral with layer_types, gpt_oss), MLA's latent cache (deepseek_v3) and MoE routing
(qwen3_moe, minimax): batched, chunked and lone prefill agree, and a cancelled sequence
leaves the others on track."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode
from engine.last_logits import head_on_last_position
from engine.prefix_store import kv_bytes_per_token
from engine.step_plan import Insert, StepPlan
from tests.support.family_configs import MLX_LM_CONFIGS, PLAIN_KV
from tests.support.tiny_families import write_family_model
from tests.test_batch_engine import PROMPTS, greedy_run

FAMILIES = ["mistral_swa", "gpt_oss", "deepseek_v3", "qwen3_moe", "minimax", *MLX_LM_CONFIGS]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    directory = write_family_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_model(directory)[0]


def test_batched_chunked_and_lone_prefill_agree(family_model):
    name, model = family_model
    together = greedy_run(model, chunk=256, prompts=PROMPTS)  # one padded prefill
    chunked = greedy_run(model, chunk=16, prompts=PROMPTS)  # longer than the window of 8
    for index, prompt in enumerate(PROMPTS):
        alone = greedy_run(model, chunk=256, prompts=[prompt])[1]
        for other in (together[index + 1], chunked[index + 1]):
            assert other[0][: len(alone[0])] == alone[0], name
            np.testing.assert_allclose(other[1], alone[1], atol=1e-4)


def test_a_cancelled_sequence_leaves_the_others_on_track(family_model):
    name, model = family_model
    reference = greedy_run(model, chunk=256, prompts=PROMPTS[1:2], steps=6)[1][0]
    engine = BatchEngine(model, 256)
    inserts = [Insert(1, PROMPTS[0]), Insert(2, PROMPTS[1]), Insert(3, PROMPTS[3])]
    engine.apply(StepPlan(0, engine.fingerprint(), inserts=inserts))
    rows = np.array(engine.run().logits)
    tokens = {seq: [int(row.argmax())] for seq, row in zip((1, 2, 3), rows, strict=True)}
    plan = StepPlan(
        engine.step_index, engine.fingerprint(), tokens=[t[-1] for t in tokens.values()]
    )
    engine.apply(plan)
    rows = np.array(engine.run().logits)
    for seq, row in zip((1, 2, 3), rows, strict=True):
        tokens[seq].append(int(row.argmax()))
    for _ in range(4):  # sequence 1 is cancelled, then 3: 2 decodes on alone
        removes = [1] if len(tokens[2]) == 2 else [3] if 3 in engine.decode_ids else []
        keep = [s for s in engine.decode_ids if s not in removes]
        plan = StepPlan(
            engine.step_index,
            engine.fingerprint(),
            removes=removes,
            tokens=[tokens[s][-1] for s in keep],
        )
        engine.apply(plan)
        result = engine.run()
        for seq, row in zip(result.seq_ids, np.array(result.logits), strict=True):
            tokens[seq].append(int(row.argmax()))
    assert tokens[2] == reference, name


def test_the_prefix_cache_measures_plain_kv_caches_only(family_model):
    name, model = family_model
    measured = kv_bytes_per_token(model)
    # Rotating windows, recurrent state and indexer caches keep the prefix cache off.
    assert (measured > 0) == (name in PLAIN_KV), name


def test_compiled_decode_gives_the_eager_tokens_or_steps_aside(family_model):
    name, model = family_model
    eager = greedy_run(model, chunk=256, prompts=PROMPTS)
    compiled = CompiledDecode(model)
    same = greedy_run(model, chunk=256, prompts=PROMPTS, compiled=compiled)
    assert {seq: run[0] for seq, run in same.items()} == {
        seq: run[0] for seq, run in eager.items()
    }, name
    # Plain KV caches compile; sliding windows, recurrent state and indexers decode eagerly.
    assert bool(compiled.shapes) == (name in PLAIN_KV), name


def test_the_head_on_the_last_position_gives_the_same_answers(family_model, tmp_path):
    name, model = family_model
    wrapped = load_model(write_family_model(tmp_path, name))[0]
    assert head_on_last_position(wrapped), name
    reference = greedy_run(model, chunk=16, prompts=PROMPTS)
    same = greedy_run(wrapped, chunk=16, prompts=PROMPTS)
    for seq, (tokens, first) in reference.items():
        assert same[seq][0] == tokens, name
        np.testing.assert_allclose(same[seq][1], first, atol=1e-5)
