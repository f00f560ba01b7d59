"""A long prompt beside running answers, on 2 real ranks: rank 0 sizes each prefill chunk
so the answers keep streaming (leader/prefill_budget.py).

The model is tests/support/long_context_model.py's (64K positions, SmolLM2's tokenizer)
with its end-of-sequence row zeroed, so greedy answers run until their cap. Four answers
stream; then a long prompt arrives; the answers' inter-token latency while it prefills
(from the Started of the long prompt to its first token) is compared with theirs in the
seconds before it, both measured from the stream's arrival times in this one run.
"""

from __future__ import annotations

import os
import time
from statistics import mean

import pytest

from ipc.client import RankClient
from ipc.protocol import Cancel, Delta, Done, Error, Started
from launcher.local_cluster import Cluster
from tests.support.long_context_model import write_endless_model
from tests.support.rank_requests import greedy

pytestmark = pytest.mark.cluster

STREAMS = 4
LAYERS = 4  # as in the measurement; attention over the cache in every chunk
LONG_WORDS = 6000  # about as many tokens: 5-25 s of prefill here beside 4 answers
BEFORE_S = 3.0  # the window of inter-token latency before the long prompt
ENV = {  # PREFILL_CHUNK_SIZE and PREFILL_SLOWDOWN as shipped (2048, 2)
    "MAX_BATCH_SIZE": "8",
    "MAX_SEQUENCE_LENGTH": "16384",
    "KEEP_WARM_SECONDS": "0",
}


def counts(arrivals: dict[str, list[float]], start: float, end: float) -> list[int]:
    """Each stream's tokens that arrived between two times."""
    return [sum(start <= t <= end for t in times) for times in arrivals.values()]


def rate(arrivals: dict[str, list[float]], start: float, end: float) -> float:
    """Tokens a second of one stream, on average over the streams, between two times;
    its inverse is their mean inter-token latency (the client may read a step's deltas
    late when the machine is loaded, which counts over seconds, not gap by gap)."""
    return max(1e-9, mean(counts(arrivals, start, end))) / (end - start)


def long_prompt_beside_streams(client: RankClient, words: int) -> dict[str, float]:
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
            client.send(greedy("long", " hello" * words, 4))
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
        "during_tokens": min(counts(arrivals, long_started, long_first)),
        "prefill_s": long_first - long_started,
        "before_ms": 1000 / before,
        "during_ms": 1000 / during,
        "ratio": before / during,
    }


def test_a_long_prompt_leaves_running_answers_streaming(tmp_path):
    """Always on: the answers keep getting tokens while a 3,000-token prompt prefills (with
    fixed 2,048-token chunks they would wait a whole chunk a step). The 3x bound on their
    latency is a figure, measured with PREFILL_MEASURE=1 (a 6,000-token prompt) and by
    bench/long_prefill.py (32K, against mlx_lm.server): speed is not asserted in the suite."""
    measure = os.environ.get("PREFILL_MEASURE") == "1"
    words = LONG_WORDS if measure else LONG_WORDS // 2
    model = write_endless_model(tmp_path / "endless", LAYERS)
    with Cluster(model, ranks=2, env=ENV) as cluster, cluster.client() as client:
        figures = long_prompt_beside_streams(client, words)
    print("long prefill beside 4 answers:", figures)
    assert figures["prompt_tokens"] >= words
    assert figures["during_tokens"] > 10, figures  # each answer's, while it prefilled
    if measure:
        # The budget lets steps grow to PREFILL_SLOWDOWN (2) x a decode step on average;
        # 3x leaves room for the model's misses and tokens per step that speculation varies.
        assert figures["ratio"] <= 3.0, figures
