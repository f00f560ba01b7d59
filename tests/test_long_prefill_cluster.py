"""A long prompt beside running answers, on 2 real ranks: rank 0 sizes each prefill chunk
so the answers keep streaming (engine/prefill_budget.py).

The model is tests/support/long_context_model.py's (64K positions, SmolLM2's tokenizer)
with its end-of-sequence row zeroed, so greedy answers run until their cap. Four answers
stream; then a long prompt arrives; the answers' inter-token latency while it prefills
(from the Started of the long prompt to its first token) is compared with theirs in the
seconds before it, both measured from the stream's arrival times in this one run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from statistics import mean

import mlx.core as mx
import pytest

from ipc.client import RankClient
from ipc.protocol import Cancel, Delta, Done, Error, Started
from launcher.local_cluster import Cluster
from tests.support.long_context_model import write_long_context_model
from tests.support.rank_requests import greedy

pytestmark = pytest.mark.cluster

STREAMS = 4
SPECIAL = 17
LAYERS = 4  # as in the measurement; attention over the cache in every chunk
LONG_WORDS = 6000  # about as many tokens: 10-20 s of prefill here beside 4 answers
BEFORE_S = 3.0  # the window of inter-token latency before the long prompt
ENV = {
    "MAX_BATCH_SIZE": "8",
    "MAX_SEQUENCE_LENGTH": "16384",
    "PREFILL_CHUNK_SIZE": "1024",
    "KEEP_WARM_SECONDS": "0",
    "PREFILL_SLOWDOWN": "2",
}


def write_endless_model(directory: Path) -> Path:
    """The long-context model whose special tokens (SmolLM2's first 17, every end of
    sequence among them) never win a greedy step."""
    write_long_context_model(directory, layers=LAYERS)
    path = directory / "model.safetensors"
    weights = mx.load(str(path))
    eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    assert eos < SPECIAL, f"end of sequence {eos} is not among the first {SPECIAL} tokens"
    head = weights["lm_head.weight"]
    head[:SPECIAL] = 0.0  # the others' rows give some tokens positive logits, these 0
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return directory


def rate(arrivals: dict[str, list[float]], start: float, end: float) -> float:
    """Tokens a second of one stream, on average over the streams, between two times;
    its inverse is their mean inter-token latency (the client may read a step's deltas
    late when the machine is loaded, which counts over seconds, not gap by gap)."""
    counts = [sum(start <= t <= end for t in times) for times in arrivals.values()]
    assert min(counts) > 10, f"too few tokens arrived between {start} and {end}: {counts}"
    return mean(counts) / (end - start)


def long_prompt_beside_streams(client: RankClient) -> dict[str, float]:
    """Stream 4 answers, send the long prompt, and measure; every request is ended."""
    arrivals: dict[str, list[float]] = {f"s{i}": [] for i in range(STREAMS)}
    for i in range(STREAMS):
        client.send(greedy(f"s{i}", f"Story number {i}: once upon a time", 100000))
    long_sent = long_started = long_first = 0.0
    prompt_tokens = 0
    while not long_first:
        message = client.recv()
        now = time.monotonic()
        assert message is not None, "rank 0 closed the connection"
        assert not isinstance(message, Done | Error), f"a request ended early: {message}"
        if isinstance(message, Delta) and message.id in arrivals:
            arrivals[message.id] += [now] * max(1, len(message.token_ids))
        elif isinstance(message, Delta) and message.id == "long":
            long_first = now
        elif isinstance(message, Started) and message.id == "long":
            long_started, prompt_tokens = now, message.prompt_tokens
        if not long_sent and all(t and t[0] < now - BEFORE_S - 1.0 for t in arrivals.values()):
            long_sent = now
            client.send(greedy("long", " hello" * LONG_WORDS, 4))
    for request_id in [*arrivals, "long"]:
        client.send(Cancel(id=request_id))
    ended: set[str] = set()
    while len(ended) < STREAMS + 1:
        message = client.recv()
        assert message is not None, "rank 0 closed the connection"
        if isinstance(message, Done | Error):
            ended.add(message.id)
    before = rate(arrivals, long_sent - BEFORE_S, long_sent)
    during = rate(arrivals, long_started, long_first)
    return {
        "prompt_tokens": prompt_tokens,
        "prefill_s": long_first - long_started,
        "before_ms": 1000 / before,
        "during_ms": 1000 / during,
        "ratio": before / during,
    }


@pytest.mark.skipif(
    os.environ.get("PREFILL_MEASURE") != "1",
    reason="opt-in (PREFILL_MEASURE=1) until it holds: the 3x bound held in 3 of 6 runs on "
    "this 2-core host under a load average of 8-10 from other jobs (fixed chunks: 5.8x at "
    "256, 8.6x at 1024); issue 29 stays open for it",
)
def test_a_long_prompt_leaves_running_answers_streaming(tmp_path):
    model = write_endless_model(tmp_path / "endless")
    with Cluster(model, ranks=2, env=ENV) as cluster, cluster.client() as client:
        figures = long_prompt_beside_streams(client)
    print("long prefill beside 4 answers:", figures)
    assert figures["prompt_tokens"] >= LONG_WORDS
    # The budget lets steps grow to PREFILL_SLOWDOWN (2) x a decode step on average; 3x
    # leaves room for the model's misses and a loaded machine.
    assert figures["ratio"] <= 3.0, figures
