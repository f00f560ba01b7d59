"""The step-time model's arithmetic (distributed/step_model.py, step_work.py, chips.py,
plan_speed.py): what a plan reads and sends each step, and the milliseconds it makes of
them on given machines and links. How well it predicts real steps is a benchmark
(bench/step_time.py, bench/step_model.py; docs/BENCHMARKS.md), not asserted here."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from distributed.chips import LINKS, chip_named, link_named, parse_link
from distributed.expert_load import (
    FIRST_REFRESH_ROUTES,
    SORTED_ROUTES,
    ExpertLoad,
    busiest_share,
    routed_reads,
    touched,
)
from distributed.hosts import RankHost
from distributed.memory import activation_bytes, predict_weight_bytes
from distributed.plan import make_plan
from distributed.plan_speed import SplitSpeed, balance, choose, choose_plan, measure_split, splits
from distributed.prefill_pieces import MIN_PIECE, prefill_pieces, streamed_ms
from distributed.shares import split
from distributed.step_model import (
    ClusterModel,
    Machine,
    Speed,
    StepTime,
    _synced_compute,
    predict,
)
from distributed.step_overhead import Overhead
from distributed.step_work import bytes_per_param, plan_work
from engine.prefix_disk import layout_digest
from launcher.plan_machines import parse_host
from leader.step_times import StepTimes
from tests.support.family_configs import CONFIGS
from tests.support.step_machines import FREE, LINK, SMOL, flat
from tests.support.tiny_families import write_family_model


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_ranks_weights_from_the_shape_match_the_safetensors(family: str, tmp_path: Path):
    model = write_family_model(tmp_path / family, family)
    config = json.loads((model / "config.json").read_text())
    for kind in ("tensor", "pipeline"):
        plan = make_plan(config, 2, None, kind)
        work = plan_work(plan, activation_bytes(model, config))
        real = predict_weight_bytes(model, plan)
        for rank, actual in zip(work.ranks, real, strict=True):
            assert rank.weight_bytes == pytest.approx(actual, rel=0.02), (kind, rank.rank)
        assert work.calibrated(real).ranks[1].weight_bytes == real[1]


def test_quantized_weights_count_their_scales_and_biases(tmp_path: Path) -> None:
    model = write_family_model(tmp_path / "q", "qwen3_moe", bits=4)
    config = json.loads((model / "config.json").read_text())
    plan = make_plan(config, 2, None, "tensor")
    per_param = bytes_per_param(plan.shape, 4)
    assert per_param == pytest.approx(4 / 8 + 2 * 4 / 32)  # 4 bits + float32 scale, bias
    work = plan_work(plan, 4)
    for rank, actual in zip(work.ranks, predict_weight_bytes(model, plan), strict=True):
        assert rank.weight_bytes == pytest.approx(actual, rel=0.1)


def test_a_tensor_plan_pays_its_collectives_and_waits_for_its_busiest_rank() -> None:
    plan = make_plan(SMOL, 2, None, "tensor")  # 3 KV heads: 2 on rank 0, 1 on rank 1
    work = plan_work(plan, 4)
    kinds = {(c.kind, c.what): c.count for c in work.collectives}
    # two all_sums a layer, the embedding's, the head's gather, the step plan
    assert kinds[("all_sum", "attention and MLP outputs")] == 60
    assert kinds[("all_sum", "embedding lookup")] == 1
    assert kinds[("all_gather", "the head's logits")] == 1
    assert kinds[("all_sum", "step plan broadcast")] == 1
    speed = Speed((flat(), flat()), LINK)
    step = predict(work, speed, 1)
    assert step.collectives == 63
    # every all_sum waits for the slower rank: rank 0 holds 6 of the 9 query heads, rank 1
    # the most MLP columns and vocabulary rows, so each part costs its own busiest rank
    attention = [r.attention_params * r.param_bytes for r in work.ranks]
    rest = [(r.dense_params - r.attention_params) * r.param_bytes for r in work.ranks]
    head = [r.head_params * r.param_bytes for r in work.ranks]
    assert attention[0] > attention[1] and rest[1] > rest[0] and head[1] > head[0]
    synced = max(attention) + max(rest) + max(head)
    assert step.compute_ms == pytest.approx(synced / 1e7, rel=0.01)
    assert step.compute_ms > 1.1 * max(r.weight_bytes for r in work.ranks) / 1e7
    # an all_sum of 576 float32 between 2 ranks: 0.1 ms + 2304 bytes at 1 GB/s; the plan's
    # 4 KiB; the head's gather of about half the vocabulary's float32 logits
    expected = 61 * (0.1 + 2304 / 1e6) + (0.1 + 4096 / 1e6) + (0.1 + 24576 * 4 / 1e6)
    assert step.collective_ms == pytest.approx(expected, rel=0.02)
    # a pipeline's stages run in turn: every rank's weights, and 2 hand-overs
    pipe = plan_work(make_plan(SMOL, 2, None, "pipeline"), 4)
    staged = predict(pipe, speed, 1)
    assert staged.compute_ms == pytest.approx(
        sum(r.weight_bytes for r in pipe.ranks) / 1e7, rel=0.01
    )
    assert staged.collectives == 3 and staged.collective_ms < 1.0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_measured_rates_interpolate_between_rows_and_grow_past_the_last() -> None:
    machine = Machine("m", 1, 1, rates=((1, 10.0), (8, 5.0), (128, 1.0)))
    assert machine.weights_ms(100, 0, 1) == pytest.approx(10)
    assert machine.weights_ms(100, 0, 8) == pytest.approx(20)
    assert 10 < machine.weights_ms(100, 0, 4) < 20
    assert machine.weights_ms(100, 0, 256) == pytest.approx(2 * 100)  # arithmetic-bound


def test_an_apple_chip_reads_at_its_bandwidth_until_its_arithmetic_binds() -> None:
    mac = Machine.of_chip(chip_named("M2 Ultra"), 192 * 2**30)
    nbytes, params = 4e9, 8e9  # 8 B parameters at 4 bits
    one = mac.weights_ms(nbytes, params, 1)
    assert one == pytest.approx(4e9 / (800 * 0.8 * 1e6))
    assert mac.weights_ms(nbytes, params, 2) == one  # a few rows: still memory-bound
    assert mac.weights_ms(nbytes, params, 2048) > 20 * one  # a prefill: arithmetic-bound


def test_routed_experts_cost_where_tokens_go_and_the_busiest_rank_sets_the_pace() -> None:
    assert touched(8, 16, 4, 1) == pytest.approx(2.0)  # 4 picks, half of them its own
    assert touched(8, 16, 4, 64) == pytest.approx(8.0, rel=1e-3)  # every expert
    moe = write_config("qwen3_moe")
    work = plan_work(make_plan(moe, 2, None, "tensor"), 4)
    (busiest, share), _ = routed_reads(work, 1)
    mean = touched(work.ranks[0].experts_held, work.num_experts, work.experts_per_token, 1)
    assert busiest > mean  # the routes split unevenly, and every rank waits
    assert share == pytest.approx(0.5)  # as many routes to each rank's experts, uncounted
    assert routed_reads(work, 1) == routed_reads(work, 1)  # seeded: every rank computes the same


def test_a_decode_steps_routes_each_read_their_expert_and_a_prefills_each_expert_once() -> None:
    """Under SORTED_ROUTES routes mlx-lm's SwitchGLU leaves them unsorted and gather_mm reads
    each route's expert for it alone: the bench's MoE at 8 clients, one rank, read -25% by
    the experts touched and +6% by the routes at commit 44ac89c (docs/BENCHMARKS.md)."""
    moe = write_config("qwen3_moe")
    whole = plan_work(make_plan(moe, 1, None, "tensor"), 4)
    picks, total = whole.experts_per_token, whole.num_experts
    rows = (SORTED_ROUTES - 1) // picks  # the most rows whose routes stay unsorted
    assert routed_reads(whole, rows) == [(rows * picks, 1.0)]
    many = SORTED_ROUTES // picks + 1
    assert routed_reads(whole, many)[0][0] == pytest.approx(touched(total, total, picks, many))
    split = plan_work(make_plan(moe, 2, None, "tensor"), 4)
    for count in (2, rows):  # the busiest rank's routes, each read (E[max] where few)
        (reads, share), _ = routed_reads(split, count)
        assert share * count * picks <= reads < count * picks
    assert routed_reads(split, 2)[0][0] > share * 2 * picks
    model = ClusterModel(whole, Speed((flat(1e7),), LINK))
    assert model.decode_ms(rows) > model.decode_ms(1) * 2  # every route reads its expert


def test_routes_as_counted_make_the_busiest_rank_of_an_expert_split_busier() -> None:
    moe = write_config("qwen3_moe")
    model = ClusterModel(
        plan_work(make_plan(moe, 2, None, "tensor"), 4), Speed((flat(1e7),) * 2, LINK)
    )
    total = model.work.num_experts
    load = ExpertLoad(total)
    rng = np.random.default_rng(1)
    for layer in range(2):  # layer 0 favours the first rank's experts, layer 1 the second's
        odds = np.r_[np.full(total // 2, 3.0), np.ones(total // 2)]
        routes = rng.choice(total, size=(4096, 1), p=odds / odds.sum())
        load.record(layer, routes if layer == 0 else total - 1 - routes)
    assert load.seen == 2 * 4096
    shares = load.shares()
    assert [sum(s) for s in shares] == pytest.approx([1.0, 1.0])
    held = [r.experts_held for r in model.work.ranks]
    assert busiest_share(shares, held) == pytest.approx(0.75, abs=0.02)
    assert busiest_share((), held) == pytest.approx(0.5)
    counted = model.routed_as(shares)
    assert routed_reads(counted.work, 1024)[0][1] == pytest.approx(0.75, abs=0.02)  # not 1/2
    assert counted.prefill_ms(1024) > model.prefill_ms(1024)
    assert counted.decode_ms(1) >= model.decode_ms(1)
    pipeline = plan_work(make_plan(moe, 2, None, "pipeline"), 4)  # every stage takes every route
    assert routed_reads(replace(pipeline, expert_shares=shares), 512) == routed_reads(pipeline, 512)


def test_status_follows_the_routes_rank_0_counts() -> None:
    moe = write_config("qwen3_moe")
    work = plan_work(make_plan(moe, 2, None, "tensor"), 4)
    load = ExpertLoad(work.num_experts)
    times = StepTimes(ClusterModel(work, Speed((flat(1e7),) * 2, LINK)), load)
    times.prefilled([(0, 512)], 50.0)
    even = times.status()
    assert even.expert_load == 0.0 and even.speed["expert_shares"] == []
    load.record(0, np.zeros(FIRST_REFRESH_ROUTES, dtype=np.int64))  # all to rank 0's expert 0
    times.prefilled([(0, 512)], 50.0)
    counted = times.status()
    assert counted.expert_load == 1.0
    assert counted.speed["expert_shares"][0][0] == 1.0
    # the second prefill was predicted with rank 0 taking every route: slower
    assert counted.predicted_prefill_tokens_per_s < even.predicted_prefill_tokens_per_s


def write_config(family: str) -> dict:
    return dict(CONFIGS[family], vocab_size=512)


def test_attention_whole_on_every_rank_syncs_once_a_layer() -> None:
    # one KV head over 2 ranks: the experts split, attention stays whole on every rank, and
    # a layer's one all_sum follows its MoE block, so a layer costs its busiest rank whole
    moe = dict(write_config("qwen3_moe"), num_key_value_heads=1)
    work = plan_work(make_plan(moe, 2, None, "tensor"), 4)
    assert not work.attention_synced
    # (attention, the rest of the layers, the head) a rank: rank 0 slower in attention,
    # rank 1 in the rest
    segments = [(3.0, 1.0, 0.5), (1.0, 2.0, 0.25)]
    assert _synced_compute(work, segments) == 4.0 + 0.5
    synced = replace(work, attention_synced=True)  # heads split: a sync after attention too
    assert _synced_compute(synced, segments) == 3.0 + 2.0 + 0.5


def test_prefill_coefficients_give_back_the_models_own_prefill() -> None:
    machine = Machine(
        "m", 1, 1, rates=((1, 1e7), (16, 5e6), (128, 1e6)), attention_flops_per_ms=1e7,
        kv_bytes_per_ms=1e7, overhead=Overhead(1.0, 0.1, 0.001, "test"),
    )  # fmt: skip
    model = ClusterModel(plan_work(make_plan(SMOL, 1, None), 4, [46080.0]), Speed((machine,), LINK))
    f, g, a, b = model.prefill_coefficients()
    assert min(f, g, a, b) >= 0 and a > 0 and b > 0
    for tokens, context in ((64, 0), (256, 4096), (512, 1000)):
        form = f + g * context + a * tokens + b * tokens * (context + tokens / 2)
        assert form == pytest.approx(model.prefill_ms(tokens, context), rel=0.1)
    assert model.decode_ms(4, context=100) < model.decode_ms(4, context=5000)


def test_chips_and_links_are_found_by_name_or_said_unknown() -> None:
    assert chip_named("apple m2 ultra").bandwidth_gb_s == 800
    with pytest.raises(ValueError, match=r"unknown chip 'M9'.*M1, M1 Pro"):
        chip_named("M9")
    assert link_named("jaccl") is LINKS[0] and parse_link("50:6").latency_us == 50
    with pytest.raises(ValueError, match="known links are jaccl"):
        parse_link("carrier-pigeon")
    assert parse_host("M4 Pro:64GB") == ("M4 Pro", 64 * 2**30)
    with pytest.raises(ValueError, match="CHIP:MEMORY"):
        parse_host("64GB")
    # a ring's small all_sum grows a hop a rank; jaccl's mesh does not
    ring, mesh = link_named("ring-thunderbolt"), link_named("jaccl")
    assert ring.all_sum_ms(0, 3) == pytest.approx(2 * ring.all_sum_ms(0, 2))
    assert mesh.all_sum_ms(0, 3) == pytest.approx(mesh.all_sum_ms(0, 2))


def test_auto_takes_the_fastest_split_that_fits_and_says_why() -> None:
    hosts = [RankHost(host="here", cores=2, memory_bytes=2**34)] * 3
    machine = flat(1e7, Overhead(1.0, 0.2, 0.0, "test"))
    crowded = Speed((machine,) * 3, link_named("ring-local"), crowding=(1.5,) * 3)
    plan = choose_plan(SMOL, None, "auto", hosts, crowded, 4)
    assert plan.strategy == "pipeline" and plan.requested == "auto"
    assert plan.note.startswith("auto: predicted (decode at 1 client") and "tensor" in plan.note
    # on their own machines, over RDMA, the tensor split's halved weights win
    apart = [RankHost(host=f"mac{i}", cores=8, memory_bytes=2**34) for i in range(2)]
    fast = Speed((machine,) * 2, link_named("jaccl"))
    assert choose_plan(SMOL, None, "auto", apart, fast, 4).is_tensor
    assert choose_plan(SMOL, None, "pipeline", apart, fast, 4).strategy == "pipeline"
    # a restart keeps the split that ran before it, where that one fits
    kept = choose_plan(SMOL, None, "auto", apart, fast, 4, kept="pipeline")
    assert kept.strategy == "pipeline" and kept.requested == "auto"
    assert kept.note.startswith("auto: kept 2 ranks pipeline, chosen before this restart")
    assert choose_plan(SMOL, None, "auto", apart, fast, 4, kept="tensor").is_tensor
    assert choose_plan(SMOL, None, "tensor", apart, fast, 4, kept="pipeline").is_tensor
    # the prefix cache's directory on disk is named by what ranks hold, not by the note's
    # predictions of each start, nor by what was asked or what a restart keeps
    slower = Speed((flat(5e6, Overhead(1.0, 0.2, 0.0, "test")),) * 2, link_named("jaccl"))
    again = choose_plan(SMOL, None, "auto", apart, slower, 4, kept="tensor")
    first = choose_plan(SMOL, None, "auto", apart, fast, 4)
    assert again.note != first.note and again.identity() == first.identity()
    asked = choose_plan(SMOL, None, "tensor", apart, fast, 4)
    assert layout_digest(asked.identity()) == layout_digest(first.identity())
    assert layout_digest(kept.identity()) != layout_digest(first.identity())  # pipeline
    # ... not one that no longer fits (350 MB a Mac: the tensor split's halves alone fit)
    tight = [RankHost(host=f"m{i}", cores=8, memory_bytes=350 * 2**20) for i in range(2)]
    unfit = choose_plan(SMOL, None, "auto", tight, fast, 4, kept="pipeline")
    assert unfit.is_tensor and "kept" not in unfit.note, unfit.note
    # the table: every split over 1..N hosts, those that fit best first
    small = [RankHost(host=f"m{i}", cores=8, memory_bytes=400 * 2**20) for i in range(2)]
    options = splits(SMOL, small, lambda h: None, lambda n: Speed((machine,) * n, LINK), 4)
    assert [o.name for o in options][-1] == "1 rank" and options[-1].why_not  # 538 MB
    assert all(not o.why_not for o in options[:-1])
    best, why = choose([o for o in options if o.ranks == 2])
    assert best is options[0] and why.startswith(
        f"predicted (decode at 1 client, at 8, prefill): {best.name}"
    )
    assert measure_split(best.plan, small, Speed((machine,) * 2, LINK), SMOL, 4).steps[8].ms > 0


def test_auto_weighs_prefill_and_many_clients_beside_one_client() -> None:
    """A split a little slower for one client but much faster to prefill is chosen, and one
    much faster for one client is chosen over a little faster prefill."""

    def option(kind: str, one_ms: float, eight_ms: float, prefill_ms: float) -> SplitSpeed:
        plan = make_plan(SMOL, 2, None, kind)
        step = lambda ms: StepTime(ms, ms, 0.0, 0.0, 0)  # noqa: E731
        steps = {1: step(one_ms), 8: step(eight_ms)}
        return SplitSpeed(plan, plan_work(plan, 4), steps, 512, prefill_ms, 8192)

    # the long-context test model at 2 ranks: pipeline 6% ahead at 1 client
    tensor, pipeline = option("tensor", 3.4, 6.0, 100.0), option("pipeline", 3.2, 6.1, 250.0)
    assert choose([pipeline, tensor])[0] is tensor
    assert balance(tensor, [tensor, pipeline]) < 1.0  # not best at one client
    tensor, pipeline = option("tensor", 6.0, 9.0, 100.0), option("pipeline", 3.0, 6.0, 110.0)
    assert choose([tensor, pipeline])[0] is pipeline
    both = [tensor, pipeline]
    assert balance(pipeline, both) > balance(tensor, both) and balance(pipeline, both) < 1.0
    assert balance(pipeline, [pipeline]) == 1.0


def test_the_prefill_figure_is_an_agents_prompt_with_attention_over_its_cache() -> None:
    """The plan's prefill figure is a prompt of PREFILL_PROMPT tokens chunk by chunk, each
    chunk attending over the ones before it."""
    from distributed.plan_speed import PREFILL_CHUNK, PREFILL_PROMPT

    slow_attention = Machine(
        "m", 2**34, 8, rates=((1, 1e7), (16, 1e7)), attention_flops_per_ms=1e6, overhead=FREE
    )
    hosts = [RankHost(host=f"mac{i}", cores=8, memory_bytes=2**34) for i in range(2)]
    speed = Speed((slow_attention,) * 2, link_named("jaccl"))
    tensor, pipeline = (
        measure_split(make_plan(SMOL, 2, None, kind), hosts, speed, SMOL, 4)
        for kind in ("tensor", "pipeline")
    )
    first_chunk = 1000 * PREFILL_CHUNK / predict(tensor.work, speed, 1, prefill=PREFILL_CHUNK).ms
    assert tensor.prefill_tokens == PREFILL_PROMPT
    assert tensor.prefill_tokens_per_s < first_chunk / 2  # later chunks attend over more
    first_chunk = 1000 * PREFILL_CHUNK / predict(pipeline.work, speed, 1, prefill=PREFILL_CHUNK).ms
    assert pipeline.prefill_tokens_per_s < first_chunk / 2


def test_a_pipelines_long_prefill_streams_through_its_stages_in_pieces() -> None:
    """A pipeline's prefill of MIN_PIECE tokens runs its stages one after another; a long
    one streams through them in pieces: near the slowest stage's time, not the sum. A later
    piece attends over the earlier ones, so the stages wait out the last piece, which costs
    more than an average one."""
    attending = replace(flat(1e7), attention_flops_per_ms=1e8)  # prices attention's work
    work = plan_work(make_plan(SMOL, 2, None, "pipeline"), 4)
    for machine, later_cost_more in ((flat(1e7), False), (attending, True)):
        speed = Speed((machine,) * 2, LINK)
        short, long = (predict(work, speed, 1, prefill=n) for n in (MIN_PIECE, 16 * MIN_PIECE))
        assert short.compute_ms == pytest.approx(sum(short.parts.values()))
        stages = list(long.parts.values())
        assert max(stages) < long.compute_ms < 0.6 * sum(stages)  # about (8 + 1) / 8 of one
        alike = sum(stages) / 8 + 7 * max(stages) / 8  # were the eight pieces to cost alike
        assert (long.compute_ms > 1.01 * alike) == later_cost_more
        assert long.compute_ms > 0.999 * alike
    assert prefill_pieces(MIN_PIECE, 2) == 1 and prefill_pieces(16 * MIN_PIECE, 2) == 8
    assert [end - start for start, end in split(10, [1.0] * 4)] == [3, 3, 2, 2]  # the pieces


def test_each_stage_takes_a_piece_once_it_and_the_stage_before_are_done() -> None:
    """streamed_ms: a slow first stage sets the pace, or a slow last stage does."""
    assert streamed_ms([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]]) == 7.0  # 1, 3, 6, then 7
    assert streamed_ms([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]]) == 10.0  # 1, then 4, 7, 10
    assert streamed_ms([[2.0], [3.0], [4.0]]) == 9.0  # one piece: the stages in turn


def test_a_prefills_experts_cost_their_measured_arithmetic() -> None:
    moe = write_config("qwen3_moe")
    work = plan_work(make_plan(moe, 1, None), 4)
    plain = flat(1e7)
    slow = Machine("m", 2**34, 2, rates=plain.rates, expert_flops_per_ms=1e7, overhead=FREE)
    decode = [predict(work, Speed((m,), LINK), 1).ms for m in (plain, slow)]
    prefill = [predict(work, Speed((m,), LINK), 1, prefill=512).ms for m in (plain, slow)]
    assert decode[1] == pytest.approx(decode[0], rel=0.05)  # a token's few experts: bytes
    assert prefill[1] > 2 * prefill[0]  # many tokens an expert: gather_mm's arithmetic


def test_a_decode_steps_routes_read_at_the_rate_probed_for_them() -> None:
    """Where the ranks probed a decode step's routed reads (distributed/route_probe.py),
    its unsorted routes take that rate, each row count its own; a prefill's sorted ones
    keep the products' rates. A tiny probe runs as the start's does."""
    import mlx.core as mx

    from distributed.machine_probe import REPEATS, median_ms
    from distributed.model_shape import ModelShape
    from distributed.route_probe import probe_routes

    moe = write_config("qwen3_moe")
    work = plan_work(make_plan(moe, 1, None), 4)
    rows = (SORTED_ROUTES - 1) // work.experts_per_token
    plain = flat(1e7)
    probed = replace(plain, route_rates=((1, 1e7), (rows, 4e7)))  # shared routes: 4x
    one, many = [
        [predict(work, Speed((m,), LINK), n).ms for m in (plain, probed)] for n in (1, rows)
    ]
    assert one[1] == pytest.approx(one[0])  # one row's routes at the same rate
    assert many[1] < many[0]  # the step's shared routes cheaper, as probed
    prefill = [predict(work, Speed((m,), LINK), 1, prefill=512).ms for m in (plain, probed)]
    assert prefill[1] == pytest.approx(prefill[0])
    shape = ModelShape.from_config(moe)
    rates = probe_routes(shape, mx.float32, 2**21, lambda run: median_ms(run, REPEATS))
    assert [n for n, _ in rates] == [1, 8] and all(rate > 0 for _, rate in rates)
    dense = ModelShape.from_config(SMOL)
    assert probe_routes(dense, mx.float32, 2**21, lambda run: median_ms(run, REPEATS)) == ()
