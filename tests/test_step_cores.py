"""The step-time model where ranks share cores and a link (distributed/step_model.py,
step_overhead.py, step_probe.py, speed_records.py, hosts.py): the overhead of a rank with
one core, the scheduler's turns where ranks outnumber the cores, and the link's measures
kept. How well it predicts real steps is a benchmark (docs/BENCHMARKS.md), not asserted
here."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from distributed.chips import Link, link_named
from distributed.crowded_probe import hop_wait_ms, ms_per_mb_beyond, pipeline_wait_ms
from distributed.hosts import RankHost, largest_cache_bytes
from distributed.model_shape import ModelShape
from distributed.plan import make_plan
from distributed.speed_records import crowding_of, speed_from_record, speed_record
from distributed.step_model import CROWDED_MS_PER_MB, PREFILL_ROWS, Speed, predict
from distributed.step_overhead import CPU_ONE_CORE_OVERHEAD, CPU_OVERHEAD, EPYC, XEON, cpu_overhead
from distributed.step_probe import LinkTimes, crowded_link, crowded_waits, steadier
from distributed.step_work import PLAN_BUFFER_BYTES, PlanWork, plan_work
from tests.support.family_configs import CONFIGS
from tests.support.step_machines import LINK, SMOL, flat


def test_ranks_that_outnumber_the_cores_wait_at_each_hop_of_a_collective() -> None:
    """3 ranks on 2 cores: a ring all_sum's 2 hops and a hand-over's one each wait for the
    scheduler, whatever the split, and a large transfer waits again as its bytes pass."""
    work = plan_work(make_plan(SMOL, 3, None, "tensor"), 4)
    crowding = (1.5,) * 3
    hop = XEON.crowded_hop_ms  # a CPU not fitted waits the Xeon's hop

    def extra(plan: PlanWork, prefill: int = 0) -> float:
        """Its collectives' ms crowded, less the same uncrowded."""
        ms = [
            predict(plan, Speed((flat(),) * 3, LINK, crowding=c), 1, prefill=prefill)
            for c in (crowding, ())
        ]
        return ms[0].collective_ms - ms[1].collective_ms

    assert {c.kind for c in work.collectives} <= {"all_sum", "all_gather"}  # 2 hops each
    count = sum(c.count for c in work.collectives)
    moved = sum(  # a ring all_sum moves 2 (n - 1) / n of its bytes, a gather n - 1 times
        c.count * c.nbytes(1) * (4 / 3 if c.kind == "all_sum" else 2) for c in work.collectives
    )
    assert extra(work) == pytest.approx(count * 2 * hop + CROWDED_MS_PER_MB * moved / 1e6)
    # a prefill chunk's activations: the bytes' turns outweigh the hops'
    chunk = sum(c.count * c.nbytes(1440) * 4 / 3 for c in work.collectives if c.kind == "all_sum")
    chunk += sum(c.count * c.nbytes(1) * 2 for c in work.collectives if c.kind == "all_gather")
    assert extra(work, prefill=1440) == pytest.approx(
        count * 2 * hop + CROWDED_MS_PER_MB * chunk / 1e6
    )
    assert CROWDED_MS_PER_MB * chunk / 1e6 > count * 2 * hop
    alone = predict(work, Speed((flat(),) * 3, LINK), 1)
    crowded = predict(work, Speed((flat(),) * 3, LINK, crowding=crowding), 1)
    assert crowded.compute_ms == pytest.approx(1.5 * alone.compute_ms)
    # measured at start, the rates already hold the sharing of the cores
    shared = Speed((flat(),) * 3, LINK, crowding=crowding, rates_shared=True)
    assert predict(work, shared, 1).compute_ms == pytest.approx(alone.compute_ms)
    # a pipeline: the plan's all_sum (2 hops) and three hand-overs (one each)
    pipe = plan_work(make_plan(SMOL, 3, None, "pipeline"), 4)
    kinds = sorted((c.kind, c.count) for c in pipe.collectives)
    assert kinds == [("all_sum", 1), ("send", 1), ("send", 2)]
    sent = sum(
        c.count * c.nbytes(1) * (4 / 3 if c.kind == "all_sum" else 1) for c in pipe.collectives
    )
    assert extra(pipe) == pytest.approx(5 * hop + CROWDED_MS_PER_MB * sent / 1e6)
    # each CPU its own wait: the AMD EPYC's machines wait its hop
    epyc = replace(flat(), cpu="AMD EPYC")
    on_epyc = predict(pipe, Speed((epyc,) * 3, LINK, crowding=crowding), 1).collective_ms
    uncrowded = predict(pipe, Speed((epyc,) * 3, LINK), 1).collective_ms
    assert EPYC.crowded_hop_ms != XEON.crowded_hop_ms
    assert on_epyc - uncrowded == pytest.approx(
        5 * EPYC.crowded_hop_ms + CROWDED_MS_PER_MB * sent / 1e6
    )
    # ranks on hosts of their own: nobody waits
    apart = predict(work, Speed((flat(),) * 3, LINK, crowding=(0.5,) * 3), 1)
    assert apart.collective_ms == pytest.approx(alone.collective_ms)


def test_crowded_waits_timed_longer_at_start_price_each_split_by_its_own_pattern() -> None:
    """A hop's wait and a MB's timed at start (between work all ranks do at once) over the
    CPU's figures price a tensor split's collectives, ones under them leave the CPU's; a
    pipeline's hops pay what its own pattern timed (its stages working in turn) where that
    is more, and its MBs the CPU's; the timed figures survive the speed's record (status,
    bench/step_model.py), and a record of before keeps what it held."""
    fitted = Speed((flat(),) * 3, LINK, crowding=(1.5,) * 3)
    hop, per_mb = XEON.crowded_hop_ms, CROWDED_MS_PER_MB
    cases = [("tensor", (7.0, 30.0, 1.0), (7.0, 30.0)), ("tensor", (0.5, 1.0, 9.0), (hop, per_mb))]
    cases += [("pipeline", (7.0, 30.0, 4.0), (4.0, per_mb))]
    cases += [("pipeline", (7.0, 30.0, 0.5), (hop, per_mb))]
    for strategy, (timed_hop, timed_mb, timed_pipe), (want_hop, want_mb) in cases:
        timed = replace(
            fitted,
            crowded_hop_ms=timed_hop,
            crowded_ms_per_mb=timed_mb,
            pipeline_hop_ms=timed_pipe,
        )
        work = plan_work(make_plan(SMOL, 3, None, strategy), 4)
        hops = moved = 0.0
        for c in work.collectives:
            each = LINK.traffic(c.kind, c.nbytes(1), 3)
            hops, moved = hops + c.count * each[0], moved + c.count * each[1]
        gap = predict(work, timed, 1).collective_ms - predict(work, fitted, 1).collective_ms
        assert gap == pytest.approx(hops * (want_hop - hop) + moved / 1e6 * (want_mb - per_mb))
    timed = replace(fitted, crowded_hop_ms=7.0, crowded_ms_per_mb=30.0, pipeline_hop_ms=4.0)
    again = speed_from_record(speed_record(timed))
    assert (again.crowded_hop_ms, again.crowded_ms_per_mb, again.pipeline_hop_ms) == (
        7.0,
        30.0,
        4.0,
    )
    assert speed_from_record(speed_record(fitted)).crowded_hop_ms == 0.0
    before = speed_record(timed) | {"crowded": [7.0, 30.0]}
    assert speed_from_record(before).pipeline_hop_ms == 0.0


def test_each_hops_and_mbs_wait_is_read_back_from_a_crowded_all_sums_time() -> None:
    """What the model adds to a crowded all_sum for its hops and its bytes, read back from
    its time; the probe itself runs at a model's shape (one rank: nothing to wait for)."""
    import mlx.core as mx

    local, row, chunk = link_named("ring-local"), 576 * 4, 1024 * 576 * 4
    hops, moved = local.traffic("all_sum", row, 3)
    timed = local.all_sum_ms(row, 3) + hops * 2.5 + CROWDED_MS_PER_MB * moved / 1e6
    assert hop_wait_ms(timed, row, 3) == pytest.approx(2.5)
    assert hop_wait_ms(0.01, row, 3) == 0.0  # faster than the loopback: no wait
    hops, moved = local.traffic("all_sum", chunk, 3)
    timed = local.all_sum_ms(chunk, 3) + hops * 2.5 + 20.0 * moved / 1e6
    assert ms_per_mb_beyond(timed, chunk, 3, 2.5) == pytest.approx(20.0)
    # a pipeline's step: the plan's all_sum and a hand-over a stage, each hop waiting
    plan_hops = local.traffic("all_sum", PLAN_BUFFER_BYTES, 3)[0]
    step = local.all_sum_ms(PLAN_BUFFER_BYTES, 3) + 3 * local.ms("send", row, 3)
    assert pipeline_wait_ms(step + (plan_hops + 3) * 4.0, row, 3) == pytest.approx(4.0)
    assert pipeline_wait_ms(step / 2, row, 3) == 0.0
    alone = crowded_waits(mx.distributed.init(), ModelShape.from_config(SMOL), mx.float32)
    assert all(f >= 0.0 and math.isfinite(f) for f in alone)


def test_a_crowded_host_takes_the_loopback_from_its_table() -> None:
    """What ranks outnumbering one host's cores would time at start is the scheduler's
    turns: the loopback's table figure stands in for it, named for the crowding."""
    link = crowded_link(3, 2)
    local = link_named("ring-local")
    assert (link.latency_us, link.gb_s, link.topology) == (
        local.latency_us,
        local.gb_s,
        "ring",
    )
    assert link.name == "ring-local (3 ranks on 2 cores)"


def test_a_rank_with_one_core_while_it_computes_pays_the_one_core_overhead() -> None:
    """A tensor split's ranks on one host's 2 cores dispatch and compute in turn on one core
    each; ranks on hosts of their own, and a pipeline's stages (which compute in turn),
    keep CPU_OVERHEAD; a decode row's extra on one core is not a prefill's."""
    cpu = replace(flat(), overhead=CPU_OVERHEAD)  # 2 cores
    here = crowding_of([RankHost(host="here", cores=2, memory_bytes=2**34)] * 2)
    apart = crowding_of([RankHost(host=f"m{i}", cores=2, memory_bytes=2**34) for i in range(2)])
    assert here == (1.0, 1.0) and apart == (0.5, 0.5)
    shared, alone = Speed((cpu, cpu), LINK, here), Speed((cpu, cpu), LINK, apart)
    assert shared.overhead(0, at_once=True) is CPU_ONE_CORE_OVERHEAD
    assert alone.overhead(0, at_once=True) is shared.overhead(0, at_once=False) is CPU_OVERHEAD
    assert shared.crowd(0) == alone.crowd(0) == 1.0
    tensor = plan_work(make_plan(SMOL, 2, None, "tensor"), 4)
    assert predict(tensor, shared, 8).overhead_ms == pytest.approx(CPU_ONE_CORE_OVERHEAD.ms(30, 8))
    assert predict(tensor, alone, 8).overhead_ms == pytest.approx(CPU_OVERHEAD.ms(30, 8))
    # turns on one core cost a decode row more; at one row the two kinds, each fitted to its
    # own runs on the Xeon host, are within 4% of each other (16.8 and 17.5 ms, 30 layers)
    one_core_row = CPU_ONE_CORE_OVERHEAD.row_layer_ms + CPU_ONE_CORE_OVERHEAD.decode_row_layer_ms
    assert one_core_row > CPU_OVERHEAD.row_layer_ms
    assert CPU_ONE_CORE_OVERHEAD.ms(30, 8) > CPU_OVERHEAD.ms(30, 8)
    prefill = predict(tensor, shared, 1, prefill=256).overhead_ms
    assert prefill == pytest.approx(CPU_ONE_CORE_OVERHEAD.ms(30, 256, decode=False))
    assert prefill < CPU_ONE_CORE_OVERHEAD.ms(30, 256)
    pipe = plan_work(make_plan(SMOL, 2, None, "pipeline"), 4)
    assert pipe.eager and not tensor.eager  # a pipeline's stages evaluate inside the step
    eager = cpu_overhead(one_core=False, eager=True)
    assert eager is not CPU_OVERHEAD and eager is not cpu_overhead(True, True)
    assert predict(pipe, shared, 8).overhead_ms == pytest.approx(
        2 * eager.ms(15, 8) - eager.step_ms
    )
    # one rank on a host of one core
    assert Speed((replace(cpu, cores=1),), LINK).overhead(0, False) is CPU_ONE_CORE_OVERHEAD
    # an expert split's routing evaluates inside the step; experts sliced on every rank not
    moe = dict(CONFIGS["qwen3_moe"], vocab_size=512)
    assert plan_work(make_plan(moe, 2, None, "tensor"), 4).eager
    assert not plan_work(make_plan(moe, 1, None, "tensor"), 4).eager


def test_a_prefill_row_costs_what_the_machine_measured_and_a_decode_row_what_it_did() -> None:
    """A machine whose probe timed a prefill row's work beside the products and attention
    pays that a prefill row and layer, whatever kind of CPU overhead its rank pays; a
    decode row keeps the kind's calibrated sum; the figure survives the ranks' records."""
    from distributed.speed_records import machine_from_record, machine_record

    measured = replace(flat(), overhead=CPU_OVERHEAD, row_layer_ms=0.007)
    assert machine_from_record(machine_record(measured)).row_layer_ms == 0.007
    here = crowding_of([RankHost(host="here", cores=2, memory_bytes=2**34)] * 2)
    for speed, at_once in (
        (Speed((measured,), LINK), False),
        (Speed((measured,) * 2, LINK, here), True),
    ):
        table = Speed(
            (replace(measured, row_layer_ms=0.0),) * len(speed.machines), LINK, speed.crowding
        )
        kind, calibrated = speed.overhead(0, at_once), table.overhead(0, at_once)
        assert kind.ms(30, 512, decode=False) == pytest.approx(
            calibrated.ms(30, 512, decode=False) - 30 * 512 * (calibrated.row_layer_ms - 0.007)
        )
        assert kind.ms(30, 8) == pytest.approx(calibrated.ms(30, 8))
    tensor = plan_work(make_plan(SMOL, 2, None, "tensor"), 4)
    shared = Speed((measured,) * 2, LINK, here)
    unmeasured = Speed((replace(measured, row_layer_ms=0.0),) * 2, LINK, here)
    assert (
        predict(tensor, shared, 1, prefill=512).ms < predict(tensor, unmeasured, 1, prefill=512).ms
    )
    assert predict(tensor, shared, 8).ms == pytest.approx(predict(tensor, unmeasured, 8).ms)
    # 3 ranks on 2 cores measured their rows together, as their rates; predict multiplies
    # every overhead by the crowding, so the row counts once
    crowded = crowding_of([RankHost(host="here", cores=2, memory_bytes=2**34)] * 3)
    together = replace(measured, row_layer_ms=0.007 * 1.5)
    probed = Speed((together,) * 3, LINK, crowded, rates_shared=True)
    assert probed.overhead(0, at_once=True).row_layer_ms == pytest.approx(0.007)


def test_a_hosts_cores_are_those_the_process_may_run_on() -> None:
    """A rank started under `taskset -c 0` has one core to itself, whatever the machine's."""
    first = min(os.sched_getaffinity(0))
    code = "from distributed.hosts import this_host; print(this_host().cores)"
    pinned = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
        preexec_fn=lambda: os.sched_setaffinity(0, {first}),
    )  # fmt: skip
    assert pinned.stdout.strip() == "1", pinned.stderr


def test_ranks_on_one_host_share_the_median_of_their_records() -> None:
    """Ranks on one host share the median of their figures, crowded or not (a prefill's
    they time at once, every rank alike: tests/test_shared_cores.py)."""
    from distributed.speed_records import machine_record, per_host

    def record(rate: float) -> dict:
        machine = flat(rate)
        machine = replace(
            machine,
            rates=machine.rates + ((PREFILL_ROWS, rate / 10),),
            flops_per_ms=rate,
            attention_flops_per_ms=rate / 2,
            kv_bytes_per_ms=rate / 4,
        )
        return {"machine": machine_record(machine)}

    hosts = [RankHost(host=h, cores=2, memory_bytes=2**34) for h in ("a", "a", "a", "b")]
    machines = per_host([record(5e6), record(17e6), record(11e6), record(3e6)], hosts)
    assert [dict(m.rates)[1] for m in machines] == [11e6, 11e6, 11e6, 3e6]
    crowded = machines[0]
    assert dict(crowded.rates)[PREFILL_ROWS] == pytest.approx(11e5)
    assert (crowded.flops_per_ms, crowded.attention_flops_per_ms) == (11e6, 5.5e6)
    assert crowded.kv_bytes_per_ms == 11e6 / 4
    assert machines[3].flops_per_ms == 3e6  # a host of its own keeps its record
    pair = [RankHost(host="c", cores=2, memory_bytes=2**34)] * 2
    apart = per_host([record(5e6), record(17e6)], pair)[0]
    assert (dict(apart.rates)[PREFILL_ROWS], apart.flops_per_ms) == (11e5, 11e6)


def test_of_two_measures_of_the_link_the_cheaper_is_kept() -> None:
    disturbed = Link("measured", 1236.0, 1.1, "ring", "a probe the start disturbed")
    quiet = Link("measured", 72.0, 2.8, "ring", "a second later")
    assert steadier(disturbed, quiet) is quiet and steadier(quiet, disturbed) is quiet
    # a fit tilted by one slow large all_sum: cheap to start, dear by the byte
    tilted = Link("measured", 34.0, 0.07, "ring", "a probe whose largest all_sum was slow")
    assert steadier(tilted, quiet) is quiet and steadier(quiet, tilted) is quiet


def test_each_size_keeps_its_cheaper_time_before_the_link_is_fitted() -> None:
    sizes = (4096, 2304, 18432, 36864, 294912)
    clean = tuple(0.07 + n / 1e6 for n in sizes)  # 70 us + 1 GB/s
    first = LinkTimes(sizes, (clean[0] * 9, *clean[1:]))  # the step plan's all_sum disturbed
    second = LinkTimes(sizes, (*clean[:-1], clean[-1] * 6))  # the largest one disturbed
    assert first.fastest(second).times == clean
    link = first.fastest(second).fit("ring", 2)
    assert link.latency_us == pytest.approx(70.0, rel=0.01)
    assert link.all_sum_ms(2**20, 2) == pytest.approx(0.07 + 2**20 / 1e6, rel=0.01)
    for one in (first, second):  # either pass alone fits a link off by far more
        alone = one.fit("ring", 2)
        assert abs(alone.all_sum_ms(2**20, 2) - link.all_sum_ms(2**20, 2)) > 0.3 or (
            alone.latency_us > 1.5 * link.latency_us
        )


def test_a_prefill_chunks_all_sum_gets_its_own_cost_past_the_line() -> None:
    from distributed.speed_records import speed_from_record, speed_record

    sizes = (4096, 2304, 18432, 36864, 294912)
    times = tuple(0.07 + n / 1e6 for n in sizes)  # 70 us + 1 GB/s
    chunk = 1024 * 576 * 4
    slow = LinkTimes(sizes, times, (chunk, 40.0)).fit("ring", 2)  # the loopback's bulk
    assert slow.all_sum_ms(chunk, 2) == pytest.approx(40.0, rel=1e-6)
    line = LinkTimes(sizes, times).fit("ring", 2)
    for nbytes in sizes:  # a decode's sizes cost what the line says
        assert slow.all_sum_ms(nbytes, 2) == pytest.approx(line.all_sum_ms(nbytes, 2))
    assert line.all_sum_ms(chunk, 2) < 3.0 < slow.all_sum_ms(chunk // 2, 2) < 40.0
    assert "past 295 KB" in slow.describe() and "past" not in line.describe()
    on_line = LinkTimes(sizes, times, (chunk, 0.07 + chunk / 1e6)).fit("ring", 2)
    assert on_line.bulk_gb_s == 0.0  # the line holds: no second rate
    # the cheaper of two passes, the bulk's too; a status record keeps it, an old one reads
    other = LinkTimes(sizes, times, (chunk, 30.0))
    assert LinkTimes(sizes, times, (chunk, 40.0)).fastest(other).bulk == (chunk, 30.0)
    speed = Speed((flat(),), slow)
    assert speed_from_record(speed_record(speed)).link.all_sum_ms(chunk, 2) == pytest.approx(40.0)
    old = speed_record(speed) | {"link": speed_record(speed)["link"][:4]}
    assert speed_from_record(old).link.bulk_gb_s == 0.0


def test_the_probe_reads_past_the_largest_cache_a_host_reports(tmp_path: Path) -> None:
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "266240K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("unknown\n")
    assert largest_cache_bytes(tmp_path) == 260 * 2**20
    assert largest_cache_bytes(tmp_path / "none") == 0  # a machine that reports none


def test_a_rows_all_sum_costs_what_a_step_meets_where_that_is_more() -> None:
    sizes = (4096, 2304, 18432, 36864, 294912)
    times = tuple(0.07 + n / 1e6 for n in sizes)  # 70 us + 1 GB/s back to back
    row = 576 * 4
    line = LinkTimes(sizes, times).fit("ring", 2)
    dear = LinkTimes(sizes, times, in_step=(row, 1.1)).fit("ring", 2)  # through the relay
    assert dear.all_sum_ms(row, 2) == pytest.approx(1.1)
    assert dear.gb_s == line.gb_s  # the cost per byte stays the line's
    cheap = LinkTimes(sizes, times, in_step=(row, 0.01)).fit("ring", 2)
    assert cheap.latency_us == line.latency_us  # a step never meets less than back to back
    other = LinkTimes(sizes, times, in_step=(row, 0.9))
    assert LinkTimes(sizes, times, in_step=(row, 1.1)).fastest(other).in_step == (row, 0.9)


def test_a_rank_pays_the_overhead_fitted_on_its_cpu_and_the_record_keeps_the_cpu() -> None:
    """The kinds differ by CPU (the AMD EPYC host's layers cost 58% of the Xeon's); a CPU
    the table does not know takes the Xeon's; the CPU's name travels in the speed record."""
    from distributed.speed_records import machine_from_record, machine_record
    from distributed.step_overhead import EPYC, XEON

    work = plan_work(make_plan(SMOL, 1, None), 4)
    for cpu, kinds in (("AMD EPYC", EPYC), ("Intel(R) Xeon(R) Processor", XEON), ("", XEON)):
        machine = replace(flat(), overhead=CPU_OVERHEAD, cpu=cpu)
        speed = Speed((machine,), LINK)
        assert speed.overhead(0, at_once=False) is kinds.compiled
        assert speed.overhead(0, at_once=False, eager=True) is kinds.eager
        assert predict(work, speed, 8).overhead_ms == pytest.approx(kinds.compiled.ms(30, 8))
        assert machine_from_record(machine_record(machine)).cpu == cpu
    assert EPYC.compiled.ms(30, 1) < 0.7 * XEON.compiled.ms(30, 1)


def test_a_pipelines_stage_computes_at_its_alone_rate_and_a_tensor_split_at_once() -> None:
    """Ranks sharing a host probe each decode row count at once and then each alone: a
    pipeline's stages compute in turn (the alone rates), a tensor split's ranks together
    (the at-once rates); the alone rates travel in the record and merge per host."""
    from distributed.speed_records import machine_from_record, machine_record, per_host

    together = replace(flat(1e7), overhead=CPU_OVERHEAD)
    both = replace(together, alone_rates=((1, 2e7), (16, 2e7)))
    pipe = plan_work(make_plan(SMOL, 2, None, "pipeline"), 4)
    tensor = plan_work(make_plan(SMOL, 2, None, "tensor"), 4)
    for work, faster in ((pipe, True), (tensor, False)):
        slow, quick = (predict(work, Speed((m, m), LINK), 1).compute_ms for m in (together, both))
        assert (quick < 0.75 * slow) if faster else (quick == slow)
    record = machine_record(both)
    assert machine_from_record(record).alone_rates == both.alone_rates
    host = RankHost(host="here", cores=2, memory_bytes=2**34)
    other = dict(record, alone_rates=[[1, 4e7], [16, 4e7]])
    merged = per_host([{"machine": record}, {"machine": other}], [host, host])
    assert dict(merged[0].alone_rates)[1] == pytest.approx(3e7)
    assert machine_from_record({**record, "alone_rates": []}).alone_rates == ()
