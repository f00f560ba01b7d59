"""The context rank 0 admits: the model's own, bounded by memory, or MAX_SEQUENCE_LENGTH."""

from __future__ import annotations

from distributed.model_shape import model_context
from ipc.status import RankStatus
from leader.context_window import choose_context, memory_context

GIB = 2**30


def rank(index: int, host: str = "a", memory: int = 16 * GIB, per_token: int = 1024) -> RankStatus:
    return RankStatus(
        rank=index,
        host=host,
        weight_bytes=2 * GIB,
        machine_memory_bytes=memory,
        kv_bytes_per_token=per_token,
        prefix_cache_bytes=1 * GIB,
    )


def test_the_models_positions_and_rope_scaling():
    assert model_context({"max_position_embeddings": 8192}) == 8192
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert model_context({"max_position_embeddings": 32768, "rope_scaling": yarn}) == 131072
    # llama3 names the stretched length itself; its factor must not stretch it again
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert model_context({"max_position_embeddings": 131072, "rope_scaling": llama3}) == 131072
    nested = {"text_config": {"max_position_embeddings": 65536}}
    assert model_context(nested) == 65536
    assert model_context({}) is None


def test_memory_bounds_the_longest_full_batch():
    # two ranks on one 16 GiB host: 8 GiB each, less 2 GiB weights and 1 GiB prefix cache
    ranks = [rank(0), rank(1)]
    fits, bounding = memory_context(ranks, sequences=8) or (0, None)
    assert fits == 5 * GIB // (8 * 1024)
    # a host of its own doubles rank 1's share; the shared host bounds
    alone = [rank(0), rank(1, host="b")]
    fits_alone, bounding = memory_context(alone, sequences=8) or (0, None)
    assert fits_alone == 13 * GIB // (8 * 1024) and bounding is not None
    assert memory_context([rank(0, per_token=0)], 8) is None  # no per-token size known
    # what the runtime holds beyond weights, KV and prefix cache (traces, buffers) too
    busy = [rank(0).model_copy(update={"overhead_bytes": GIB}), rank(1)]
    fits_busy, bounding = memory_context(busy, sequences=8) or (0, None)
    assert fits_busy == 4 * GIB // (8 * 1024) and bounding is not None and bounding.rank == 0


def test_choice_takes_the_setting_else_the_model_else_memory():
    config = {"max_position_embeddings": 65536}
    roomy = [rank(0, memory=512 * GIB)]
    assert choose_context(None, config, roomy, 8).tokens == 65536
    assert choose_context(2048, config, roomy, 8).tokens == 2048
    beyond = choose_context(100_000, config, roomy, 8)
    assert beyond.tokens == 100_000 and "beyond the model's 65536" in beyond.why
    tight = choose_context(None, config, [rank(0, memory=13 * GIB // 4)], 8)
    assert tight.tokens == GIB // 4 // (8 * 1024) == 32768
    assert "lowered from the model's 65536" in tight.why and "rank 0 on a" in tight.why
    assert choose_context(None, {}, roomy, 8).tokens == 4096


def test_a_draft_model_counts_on_rank_0():
    """Rank 0 holds the draft's weights and its rows' KV beside its own share."""
    ranks = [rank(0, host="a"), rank(1, host="b")]  # a host each: 13 GiB free a rank
    without = memory_context(ranks, sequences=8)
    assert without is not None and without[0] == 13 * GIB // (8 * 1024)
    # 1 GiB of draft weights and 1024 bytes a token more: rank 0 bounds at 12 / 2048
    bound = memory_context(ranks, sequences=8, draft=(GIB, 1024))
    assert bound is not None and bound[0] == 12 * GIB // (8 * 2048) and bound[1].rank == 0
    config = {"max_position_embeddings": 1_000_000}
    chosen = choose_context(None, config, ranks, 8, draft=(GIB, 1024))
    assert chosen.tokens == bound[0] and "and the draft model's" in chosen.why
    assert "draft" not in choose_context(None, config, ranks, 8).why
