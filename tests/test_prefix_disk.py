"""The prefix cache's disk tier in one process: files that round-trip exactly, refusals of
anything damaged, rank 0's index across a restart, and a conversation resumed after a
restart that prefills only what is new and answers as before."""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model, load_tokenizer

from engine.batch_engine import BatchEngine
from engine.prefix_disk import DiskTier, token_key
from engine.prefix_store import PrefixStore
from engine.step_plan import StepPlan
from ipc.protocol import Delta, Done, Error, SamplingParams, Submit
from leader.prefix_cache import PrefixCache
from leader.prefix_disk_index import DiskIndex
from leader.requests import Requests
from leader.scheduler import Scheduler
from tests.support.tiny_models import write_tiny_model


def alone(failed: list[int]) -> list[int]:
    return failed  # one rank: its own vote


def _layers(dtype=mx.float32, quantized: bool = False, length: int = 5) -> list:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(3):
        k, v = (mx.array(rng.standard_normal((1, 2, length, 64)).astype(np.float32)) for _ in "kv")
        if quantized:
            out.append((mx.quantize(k, 64, 8), mx.quantize(v, 64, 8)))
        else:
            out.append((k.astype(dtype), v.astype(dtype)))
    return out


def _equal(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple | list):
            _equal(x, y)
        else:
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(
                np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
            )


def test_the_plan_carries_the_disk_operations() -> None:
    plan = StepPlan(
        step=3, fingerprint=9, saves=[(4, 2**63 + 5)], loads=[(7, 11, 1500)], drops=[12]
    )
    again = StepPlan.decode(plan.encode())
    assert (again.saves, again.loads, again.drops) == ([(4, 2**63 + 5)], [(7, 11, 1500)], [12])
    assert len(StepPlan(step=3, fingerprint=9).encode()) < len(plan.encode())


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "8 bits"])
def test_an_entry_round_trips_exactly(tmp_path, kind: str) -> None:
    tier = DiskTier.open(tmp_path, "layout", 0, alone)
    layers = _layers(mx.bfloat16 if kind == "bfloat16" else mx.float32, kind == "8 bits")
    tier.save(42, layers, 5)
    tier.flush()
    assert tier.path(42).exists() and not list(tier.directory.glob("*.partial"))
    (loaded,) = tier.load_all([(42, 5)])
    assert loaded is not None
    _equal(loaded, layers)


def test_a_stop_finishes_the_queued_saves_and_a_start_clears_a_cut_one(
    tmp_path, monkeypatch, caplog
) -> None:
    import engine.prefix_disk as prefix_disk

    written = prefix_disk.save_file

    def slow(*args, **kwargs) -> None:
        time.sleep(0.05)
        written(*args, **kwargs)

    monkeypatch.setattr(prefix_disk, "save_file", slow)
    tier = DiskTier.open(tmp_path, "layout", 0, alone)
    for key in range(8):
        tier.save(key, _layers(), 5)
    with caplog.at_level(logging.INFO, logger="ring.prefix"):
        tier.close()
    assert all(tier.path(key).exists() for key in range(8))
    assert "finishing" in caplog.text and "queued save(s)" in caplog.text
    tier.save(9, _layers(), 5)  # no save after a stop
    assert not tier.path(9).exists()

    cut = DiskTier.open(tmp_path, "layout", 0, alone)
    for key in range(10, 18):
        cut.save(key, _layers(), 5)
    with caplog.at_level(logging.WARNING, logger="ring.prefix"):
        cut.close(timeout=0.01)  # a stop that cannot wait for them all
    assert "stopping without them" in caplog.text
    cut.flush()  # (its writer goes on: let it end before the next start)
    (tmp_path / "layout" / "rank-0" / "00000000000000ff.partial").write_bytes(b"cut")
    DiskTier.open(tmp_path, "layout", 0, alone)
    assert not list((tmp_path / "layout" / "rank-0").glob("*.partial"))


def test_damaged_missing_or_foreign_entries_are_never_served(tmp_path, caplog) -> None:
    tier = DiskTier.open(tmp_path, "layout", 0, alone)
    tier.save(1, _layers(), 5)
    tier.save(2, _layers(), 5)
    tier.flush()
    data = bytearray(tier.path(1).read_bytes())
    data[-3] ^= 0xFF  # one flipped byte inside the last array
    tier.path(1).write_bytes(bytes(data))
    tier.path(2).rename(tier.path(3))  # another key's file under this name
    with caplog.at_level(logging.INFO, logger="ring.prefix"):
        assert tier.load_all([(1, 5), (3, 5), (4, 5), (2, 5)]) == [None] * 4
    text = caplog.text
    assert "fails its checksum" in text and "holds 0000000000000002" in text
    assert "is not on this rank; computing" in text
    assert not tier.path(1).exists()  # a damaged file is removed


def test_a_failed_vote_drops_the_load_on_every_rank(tmp_path) -> None:
    tier = DiskTier.open(tmp_path, "layout", 0, lambda failed: [1] * len(failed))
    tier.save(5, _layers(), 5)
    tier.flush()
    assert tier.load_all([(5, 5)]) == [None]  # loaded here, failed on another rank


def test_a_step_without_loads_holds_no_vote(tmp_path) -> None:
    votes: list[list[int]] = []
    tier = DiskTier.open(tmp_path, "layout", 0, lambda failed: votes.append(failed) or failed)
    assert tier.load_all([]) == [] and votes == []  # every step's plan: no collective
    assert tier.load_all([(6, 5)]) == [None] and votes == [[1]]


def test_a_read_only_directory_turns_saves_off(tmp_path, caplog) -> None:
    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "rank-0").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="ring.prefix"):
        tier = DiskTier.open(tmp_path, "layout", 0, alone)
    assert tier.broken and "is not writable" in caplog.text
    tier.save(1, _layers(), 5)  # no error: saves are off
    assert tier.load_all([(1, 5)]) == [None]


def test_the_index_survives_a_restart_and_keeps_its_budget(tmp_path) -> None:
    tier = DiskTier.open(tmp_path, "layout", 0, alone)
    index = DiskIndex(tier.directory, budget_tokens=100)
    first, second, third = list(range(10, 50)), list(range(60, 110)), list(range(200, 240))
    for tokens in (first, second):
        tier.save(token_key(tokens), _layers(length=1), 1)
        assert index.record(token_key(tokens), tokens, set()) == []
    tier.flush()
    assert index.match(first + [7, 8]) == (token_key(first), 40)
    assert index.match(second[:30] + [1]) == (token_key(second), 30)
    assert index.record(token_key(third), third, set()) == [token_key(first)]  # least recent
    tier.save(token_key(third), _layers(length=1), 1)
    tier.flush()
    again = DiskIndex(tier.directory, budget_tokens=100)  # a restart
    assert set(again.entries) == {token_key(second), token_key(third)}
    tier.drop(token_key(second))  # gone from rank 0's disk: left out at the next start
    assert set(DiskIndex(tier.directory, budget_tokens=100).entries) == {token_key(third)}


# ---- a conversation across a restart, in one process --------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny"), never_stops=True)
    return load_model(directory)[0], load_tokenizer(directory)


def serve(tiny, directory, submits: list[Submit]) -> dict[str, tuple[list[int], Done]]:
    """A fresh 'cluster' (scheduler, engine and their disk tier over `directory`) that runs
    `submits` one after another."""
    model, tokenizer = tiny
    tier = DiskTier.open(directory, "layout", 0, alone)
    prefix = PrefixCache(10_000, disk=DiskIndex(tier.directory, 10_000))
    scheduler = Scheduler(Requests(tokenizer, 1024, prefix), 4)
    engine = BatchEngine(model, 64, prefix=PrefixStore(None, tier))
    out = {}
    for submit in submits:
        scheduler.requests.submit("conn", submit)
        tokens: list[int] = []
        while scheduler.has_work(engine):
            plan = StepPlan.decode(scheduler.build_plan(engine).encode())
            engine.apply(plan)
            scheduler.on_result(engine.run(scheduler.sampling_rows))
            scheduler.prefix.loaded(engine.prefix.loaded)
            scheduler.stream_pending()
            for _, message in scheduler.requests.outbox:
                assert not isinstance(message, Error), message
                if isinstance(message, Delta):
                    tokens += message.token_ids
                elif isinstance(message, Done):
                    out[message.id] = (tokens, message)
            scheduler.requests.outbox = []
        tier.flush()
    return out


def test_a_conversation_resumes_after_a_restart(tiny, tmp_path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    turn = "the lighthouse keeper walked along the shore and counted the boats " * 6
    first = Submit(id="turn-1", prompt=turn, params=params)
    before = serve(tiny, tmp_path, [first])
    answer = bytes(t for t in before["turn-1"][0] if t < 256).decode(errors="replace")
    follow = Submit(id="turn-2", prompt=turn + answer + " and then?", params=params)
    reference = serve(tiny, tmp_path / "fresh", [follow])["turn-2"]  # never cached
    resumed = serve(tiny, tmp_path, [follow])["turn-2"]  # a restart: memory is empty
    assert resumed[0] == reference[0]
    cached = resumed[1].usage.prompt_tokens_details.cached_tokens
    assert cached >= len(turn) - 1, (cached, len(turn))
    assert reference[1].usage.prompt_tokens_details.cached_tokens == 0
