"""The prefix cache on disk across a restart, on 2 real ranks: a conversation's next turn
after the ranks were stopped and started again reuses the saved turn (every rank loads its
part) and answers as a cluster that never cached it; a damaged part on one rank, or a
changed split, is never used.

Each cluster here is a fresh job over the same PREFIX_CACHE_DIR, as `./launch.sh restart`
gives (memory empty, the disk as it was). The time to first token before and after a
restart is a benchmark figure (bench/prefix_restart.py), not asserted here.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ipc.protocol import Done
from launcher.local_cluster import Cluster
from tests.support.rank_requests import greedy, run_requests
from tests.support.tiny_models import write_tiny_model

pytestmark = pytest.mark.cluster

ENV = {
    "MAX_BATCH_SIZE": "4",
    "PREFILL_CHUNK_SIZE": "256",
    "MAX_SEQUENCE_LENGTH": "2048",
    "KEEP_WARM_SECONDS": "0",
    "PARALLELISM": "tensor",
}
TURN = "the keeper counted the boats in the harbour and wrote each name in his book. " * 19


def ask(cluster: Cluster, request_id: str, prompt: str) -> tuple[list[int], Done]:
    with cluster.client() as client:
        _, answers, final = run_requests(client, [greedy(request_id, prompt, 16)])
    done = final[request_id]
    assert isinstance(done, Done), done
    return answers[request_id], done


def cached(done: Done) -> int:
    return done.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), never_stops=True)


@pytest.fixture(scope="module")
def conversation(model, tmp_path_factory) -> tuple[Path, str, list[int]]:
    """The first turn served (and saved) by a cluster that is then stopped; the second
    turn's prompt, and its answer from a cluster that never cached anything."""
    workdir = tmp_path_factory.mktemp("restart")
    with Cluster(model, ranks=2, env=ENV, workdir=workdir) as cluster:
        answer, done = ask(cluster, "turn-1", TURN)
    assert done.usage.prompt_tokens > 1400
    text = bytes(t for t in answer if t < 256).decode(errors="replace")
    follow = TURN + text + " What did he write next?"
    fresh = tmp_path_factory.mktemp("fresh")
    with Cluster(model, ranks=2, env=ENV | {"PREFIX_CACHE_DISK_BYTES": "0"}, workdir=fresh) as c:
        reference, done = ask(c, "reference", follow)
    assert cached(done) == 0
    return workdir, follow, reference


def log_with(cluster: Cluster, text: str, seconds: float = 10.0) -> str:
    """The log's tail once it holds `text`, or after `seconds`: a rank's lines reach
    server.log through mlx.launch a moment after the answer they came with (one CI run read
    the tail before rank 1's "fails its checksum" and rank 0's request line had arrived)."""
    deadline = time.monotonic() + seconds
    while True:
        log = cluster.log_tail(80)
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_the_next_turn_after_a_restart_prefills_only_what_is_new(model, conversation) -> None:
    workdir, follow, reference = conversation
    parts = sorted(p.parent.name for p in (workdir / "prefix-cache").glob("*/rank-*/*.safetensors"))
    assert parts == ["rank-0", "rank-1"], parts  # each rank saved its own part
    with Cluster(model, ranks=2, env=ENV, workdir=workdir) as cluster:
        tokens, done = ask(cluster, "turn-2", follow)
        log = log_with(cluster, "prefix cache on disk: 1 entries")
        stats = cluster.status().prefix_cache
    assert tokens == reference
    assert cached(done) >= len(TURN), (cached(done), done.usage.prompt_tokens)
    assert stats.disk_loads == 1 and stats.disk_entries >= 1, stats
    assert "prefix cache on disk: 1 entries" in log, log


def test_a_damaged_part_on_one_rank_is_computed_instead(model, conversation) -> None:
    workdir, follow, reference = conversation
    for part in (workdir / "prefix-cache").glob("*/rank-1/*.safetensors"):
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    with Cluster(model, ranks=2, env=ENV, workdir=workdir) as cluster:
        tokens, done = ask(cluster, "turn-2", follow)
        log = log_with(cluster, "fails its checksum")
        stats = cluster.status().prefix_cache
    assert tokens == reference
    assert cached(done) == 0  # rank 1 refused its part: no rank used the entry
    assert stats.disk_load_failures >= 1 and stats.disk_loads == 0, stats
    assert "fails its checksum" in log, log


def test_another_split_never_reads_these_entries(model, conversation) -> None:
    workdir, follow, reference = conversation
    env = ENV | {"PARALLELISM": "pipeline"}
    with Cluster(model, ranks=2, env=env, workdir=workdir) as cluster:
        tokens, done = ask(cluster, "turn-2", follow)
    assert tokens == reference and cached(done) == 0
    layouts = {p.name for p in (workdir / "prefix-cache").iterdir()}
    assert len(layouts) == 2, layouts  # tensor's and pipeline's directories
