"""The prefix cache on real ranks (mlx.launch, ring, 127.0.0.1): a resent conversation
reuses its cached KV, the answers equal those of a cluster with the cache off (alone and
in a batch, at 1 and 2 ranks), a small budget evicts, and a cancelled request leaves the
entry it reused intact.

Equality is token ids plus their log-probabilities within 1e-4 (float32 tiny model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ipc.client import RankClient
from ipc.protocol import ChatMessage, Delta, Done, SamplingParams, Started, Submit
from launcher.local_cluster import Cluster
from tests.support.api_server import running_api

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SYSTEM = "You are the support assistant of a small bakery. Answer in one short line. " * 3
ENV = {"MAX_SEQUENCE_LENGTH": "1024", "PREFILL_CHUNK_SIZE": "128", "LOG_LEVEL": "DEBUG"}
TOLERANCE = 1e-4


def chat(*turns: str) -> list[dict[str, str]]:
    """System prompt, then alternating user / assistant turns."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": SYSTEM}] + [
        {"role": roles[i % 2], "content": text} for i, text in enumerate(turns)
    ]


def ask(client: RankClient, rid: str, messages: list[dict[str, str]], max_tokens: int = 12):
    """Greedy answer over rank 0's socket: (token ids, logprobs, Done)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True)
    chat_messages = [ChatMessage(**m) for m in messages]  # type: ignore[arg-type]
    client.send(Submit(id=rid, messages=chat_messages, params=params))
    ids: list[int] = []
    logprobs: list[float] = []
    while True:
        message = client.recv()
        if isinstance(message, Delta):
            ids += message.token_ids
            logprobs += [item.logprob for item in message.logprobs or []]
        elif isinstance(message, Done):
            return ids, logprobs, message
        elif not isinstance(message, Started):
            raise AssertionError(f"unexpected {message}")


def same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    assert max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0) <= TOLERANCE


def cluster(model: Path, ranks: int, **env: str) -> Iterator[Cluster]:
    with Cluster(model, ranks=ranks, env=ENV | env) as started:
        yield started


@pytest.fixture(scope="module")
def uncached(tiny_llama: Path) -> Iterator[Cluster]:
    yield from cluster(tiny_llama, 2, PREFIX_CACHE_BYTES="0")


@pytest.fixture(scope="module")
def cached(tiny_llama: Path) -> Iterator[Cluster]:
    yield from cluster(tiny_llama, 2)


@pytest.fixture(scope="module")
def api(cached: Cluster, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("api") / "api.log"
    with running_api({"SOCKET_PATH": str(cached.socket_path)}, log) as process:
        yield process


@pytest.fixture(scope="module")
def sdk(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)


def test_a_resent_conversation_reuses_the_cached_turns(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(
        model="default", messages=chat("Do you sell rye bread?"), max_tokens=12, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = first.choices[0].message.content or ""
    again = sdk.chat.completions.create(
        model="default",
        messages=chat("Do you sell rye bread?", answer, "And on Sundays?"),
        max_tokens=12,
        temperature=0,
    )
    cached = again.usage.prompt_tokens_details.cached_tokens
    # turn one's prompt and answer are reused: all of the first prompt at least
    assert first.usage.prompt_tokens <= cached < again.usage.prompt_tokens


def test_another_question_reuses_the_shared_system_prompt(sdk: openai.OpenAI, api) -> None:
    other = sdk.chat.completions.create(
        model="default", messages=chat("Where are you?"), max_tokens=4, temperature=0
    )
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert len(SYSTEM) < cached < other.usage.prompt_tokens  # byte tokens: 1 per character
    status = httpx.get(f"{api.base_url}/cluster/status", timeout=10).json()["prefix_cache"]
    assert status["enabled"] and status["hits"] >= 2 and status["hit_tokens"] >= cached
    metrics = httpx.get(f"{api.base_url}/metrics", timeout=10).text
    assert "prefix_cache_hits_total" in metrics and "prefix_cache_bytes" in metrics


def test_answers_equal_the_uncached_cluster_alone(cached: Cluster, uncached: Cluster) -> None:
    conversation = chat("Do you bake croissants?")
    with cached.client() as a, uncached.client() as b:
        first = ask(a, "c1", conversation)
        same(first, ask(b, "u1", conversation))
        turn = chat("Do you bake croissants?", "Yes, every day.", "How much are they?")
        hit = ask(a, "c2", turn)
        assert hit[2].usage.prompt_tokens_details.cached_tokens > len(SYSTEM)
        same(hit, ask(b, "u2", turn))


def _batch(client: RankClient, prefix: str, questions: list[str]) -> dict[str, tuple]:
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)
    for i, question in enumerate(questions):
        messages = [ChatMessage(**m) for m in chat(question)]  # type: ignore[arg-type]
        client.send(Submit(id=f"{prefix}{i}", messages=messages, params=params))
    out: dict[str, tuple] = {}
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while len(out) < len(questions):
        message = client.recv()
        if isinstance(message, Delta):
            tokens.setdefault(message.id, []).extend(message.token_ids)
            logprobs.setdefault(message.id, []).extend(lp.logprob for lp in message.logprobs or [])
        elif isinstance(message, Done):
            out[message.id] = (tokens.get(message.id, []), logprobs.get(message.id, []), message)
    return out


def test_answers_equal_the_uncached_cluster_in_a_batch(cached: Cluster, uncached: Cluster):
    questions = ["Is there parking?", "Do you deliver?", "Any vegan cakes?", "Open at 7?"]
    with cached.client() as a, uncached.client() as b:
        hot = _batch(a, "hot", questions)
        cold = _batch(b, "cold", questions)
    for i in range(len(questions)):
        same(hot[f"hot{i}"], cold[f"cold{i}"])
    # the shared system prompt was stored once and reused by the others in the batch
    assert sum(r[2].usage.prompt_tokens_details.cached_tokens > 0 for r in hot.values()) >= 3


def test_one_rank_with_the_cache_answers_like_two_without(tiny_llama, uncached: Cluster):
    turn = chat("Do you bake croissants?", "Yes, every day.", "How much are they?")
    with Cluster(tiny_llama, ranks=1, env=ENV) as single, single.client() as a:
        ask(a, "warm", chat("Do you bake croissants?"))
        hit = ask(a, "one", turn)
        assert hit[2].usage.prompt_tokens_details.cached_tokens > len(SYSTEM)
    with uncached.client() as b:
        same(hit, ask(b, "two", turn))


def test_a_cancelled_request_leaves_the_entry_it_reused(cached: Cluster, uncached: Cluster):
    conversation = chat("Tell me about your sourdough, at length.")
    with cached.client() as a, uncached.client() as b:
        ask(a, "seed", conversation, max_tokens=2)  # stores the conversation's prompt
        params = SamplingParams(max_tokens=400, temperature=0.0)
        messages = [ChatMessage(**m) for m in conversation]  # type: ignore[arg-type]
        a.send(Submit(id="long", messages=messages, params=params))
        seen = 0
        while seen < 5:  # it is decoding from the reused entry: cancel it mid-answer
            seen += isinstance(a.recv(), Delta)
        a.close()
    with cached.client() as a:
        after = ask(a, "after", conversation)
    assert after[2].usage.prompt_tokens_details.cached_tokens >= len(SYSTEM)
    with uncached.client() as b:
        same(after, ask(b, "cold", conversation))


def test_a_small_budget_evicts_and_never_exceeds_it(tiny_llama: Path) -> None:
    # The tiny model keeps 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 bytes
    # per token on each rank of 2 (its half of the heads: 256): 100 KB ~ 400 tokens.
    with Cluster(tiny_llama, ranks=2, env=ENV | {"PREFIX_CACHE_BYTES": "100KiB"}) as small:
        with small.client() as client:
            for i in range(4):
                ask(client, f"q{i}", chat(f"Question number {i}: " + "why? " * 20), max_tokens=4)
        stats = small.status().prefix_cache
    assert stats.enabled and 0 < stats.budget_tokens < 1000
    assert stats.evictions >= 1
    assert stats.cached_tokens <= stats.budget_tokens


def test_concurrent_requests_share_one_prefill_of_a_long_common_prefix(tiny_llama: Path):
    with Cluster(tiny_llama, ranks=2, env=ENV) as fresh, fresh.client() as client:
        results = _batch(client, "c", ["A?", "B?", "C?"])
    hits = sorted(r[2].usage.prompt_tokens_details.cached_tokens for r in results.values())
    # the first prefills the shared prompt and stores it; the other two wait and reuse it
    assert hits[0] == 0 and hits[1] == hits[2] > len(SYSTEM)


def test_pipeline_ranks_keep_their_own_layers_of_each_entry(tiny_llama: Path, uncached):
    turn = chat("Do you bake croissants?", "Yes, every day.", "How much are they?")
    with Cluster(tiny_llama, ranks=2, env=ENV | {"PARALLELISM": "pipeline"}) as piped:
        with piped.client() as a:
            ask(a, "warm", chat("Do you bake croissants?"))
            hit = ask(a, "hit", turn)
        status = piped.status()
    assert status.plan["strategy"] == "pipeline"
    assert hit[2].usage.prompt_tokens_details.cached_tokens > len(SYSTEM)
    # one layer of two each, all KV heads: each rank keeps half of the one-rank KV per token
    assert [r.kv_bytes_per_token for r in status.ranks] == [256, 256]
    with uncached.client() as b:
        same(hit, ask(b, "cold", turn))
