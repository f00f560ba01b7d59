"""KV_CACHE_BITS on real ranks with the default model (SmolLM2-135M, float32 weights):
greedy answers with 8-bit KV against float KV at 2 ranks (and 1), the 4-bit figure, each
rank's measured KV bytes per token against the plan's prediction, and a prefix-cache hit
served from quantized entries (the same answer).

Float KV gives the same greedy tokens at any split (tests/test_sharding_cluster.py), so
one float run at 1 rank is the reference for both rank counts. The suite compares 64
tokens (the issue's 256 took 5 minutes of the suite's 20 here); the figure of 256 is
`KV_BITS_TOKENS=256 ./test.sh -k kv_bits -s` (docs/BENCHMARKS.md).

What holds on every host, whatever its kernels sum in which order:
- 8-bit KV moves the gap between the top two tokens by a fraction of a nat (at most 0.17
  over a 256-token answer at 1 rank, 0.31 at 2; docs/BENCHMARKS.md): wherever both saw the same
  tokens, their gaps agree within NEAR_TIE, and the 8-bit answer may part from float's only
  at one of float's near ties (top two within NEAR_TIE). Wrong KV moves them by nats.
  A fixed share of equal tokens did not hold: the reference's near ties fall where its
  kernels put them (8-bit parted at token 7 on an AMD EPYC with AVX-512, at 31 on an Intel
  one, never in 64 on AVX2 hosts, with a 31-token prompt).
- The prefix cache's entries hold the very triples the answer attended to
  (tests/test_quantized_kv.py), and this prompt is longer than LAST_TOKEN_ALONE: the first
  answer and the hit both compute its last token alone over the same bytes, so the hit's
  answer is the same computation, token for token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from engine.prefill_group import LAST_TOKEN_ALONE
from ipc.protocol import Delta, Done, Error, Started
from launcher.local_cluster import Cluster
from tests.support.rank_requests import greedy

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.host_dependent(
        "where 8-bit KV's greedy answer parts from float's follows the kernels' sums: "
        "allowed only at float's near ties"
    ),
]

ENV = {
    "IMPORT_DTYPE": "float32",
    "MAX_SEQUENCE_LENGTH": "1024",
    "MAX_BATCH_SIZE": "2",
    "KEEP_WARM_SECONDS": "0",
}
TOKENS = int(os.environ.get("KV_BITS_TOKENS", "64"))
# A prompt of 37 tokens that keeps the model writing for 256 (it does not reach its end).
PROMPT = (
    "<|im_start|>user\nWrite a long story about a lighthouse keeper who finds a map on the "
    "beach one stormy night. Describe every day of his journey in detail.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
FLOAT_BYTES = 30 * 3 * 64 * 2 * 4  # layers x KV heads x head dim x (K, V) x float32
NEAR_TIE = 0.75  # nats between the top two tokens: 8-bit KV moved that gap by 0.31 at most


@dataclass
class Answer:
    tokens: list[int]
    gaps: list[float]  # each position's top-two log-probability gap
    prompt_tokens: int
    done: Done


def answer(cluster: Cluster, request_id: str, tokens: int = TOKENS) -> Answer:
    gaps: list[float] = []
    ids: list[int] = []
    prompt_tokens = 0
    with cluster.client() as client:
        client.send(greedy(request_id, PROMPT, tokens, logprobs=True, top_logprobs=2))
        while True:
            message = client.recv()
            assert message is not None and not isinstance(message, Error), message
            if isinstance(message, Started):
                prompt_tokens = message.prompt_tokens
            elif isinstance(message, Delta):
                ids += message.token_ids
                for token in message.logprobs or []:
                    first, second = token.top_logprobs[:2]
                    gaps.append(first.logprob - second.logprob)
            elif isinstance(message, Done):
                return Answer(ids, gaps, prompt_tokens, message)


def run(ranks: int, bits: str, repeat: bool = False) -> tuple[Answer, list[int], str]:
    """(the answer, each rank's KV bytes per token, the log) with KV_CACHE_BITS=bits;
    `repeat`: the prompt again, served from the prefix cache's quantized entry."""
    with Cluster("", ranks=ranks, env=ENV | {"KV_CACHE_BITS": bits}, ready_timeout=300) as c:
        first = answer(c, "first")
        if repeat:
            again = answer(c, "again")
        per_token = [r.kv_bytes_per_token for r in c.status().ranks]
        log = c.log_tail(200)
    assert len(first.tokens) == TOKENS, (len(first.tokens), first.done.finish_reason)
    assert first.prompt_tokens > LAST_TOKEN_ALONE, first.prompt_tokens
    if repeat:
        usage = again.done.usage
        assert usage.prompt_tokens_details.cached_tokens == first.prompt_tokens - 1, usage
        assert again.tokens == first.tokens, f"a prefix-cache hit changed the answer ({bits} bits)"
    return first, per_token, log


def parting(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where `tokens` leave the reference's, or None."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None)


@pytest.fixture(scope="module")
def reference() -> Answer:
    first, per_token, _ = run(1, "none")
    assert per_token == [FLOAT_BYTES]
    return first


# 2 ranks always (the split heads' own KV quantized); 1 too with KV_BITS_RANKS=1,2 (28 s
# of the suite's 20 minutes; the quantized cache itself is checked in one process).
RANKS = [int(n) for n in os.environ.get("KV_BITS_RANKS", "2").split(",")]


@pytest.mark.parametrize("ranks", RANKS)
def test_8_bit_kv_keeps_the_greedy_answer(reference: Answer, ranks: int) -> None:
    first, per_token, log = run(ranks, "8", repeat=ranks == RANKS[0])
    parted = parting(first.tokens, reference.tokens)
    ties = [i for i, gap in enumerate(reference.gaps) if gap < NEAR_TIE]
    same = parted if parted is not None else TOKENS
    moved = [abs(a - b) for a, b in zip(first.gaps[:same], reference.gaps[:same], strict=True)]
    print(
        f"8-bit KV, {ranks} rank(s): float KV's tokens kept up to {same} of {TOKENS}, the "
        f"top-two gaps moved {max(moved):.3f} at most; float's near ties at {ties[:8]}"
    )
    assert max(moved) < NEAR_TIE, moved
    assert parted is None or parted in ties, (parted, reference.gaps[parted])
    assert "KV cache: 8 bits in groups of 64 (KV_CACHE_BITS)" in log
    # 1 byte an element plus a float32 scale and bias a group of 64: 1.125 bytes, not 4
    assert sum(per_token) == FLOAT_BYTES * 1125 // 4000 and min(per_token) > 0, per_token


@pytest.mark.skipif(
    not os.environ.get("KV_BITS_TOKENS"),
    reason="a figure, not a check: KV_BITS_TOKENS=256 ./test.sh -k kv_bits -s (the 4-bit bytes "
    "are checked in tests/test_quantized_kv.py)",
)
def test_4_bit_kv_figure(reference: Answer) -> None:
    first, per_token, _ = run(2, "4")
    parted = parting(first.tokens, reference.tokens)
    print(f"4-bit KV, 2 ranks: float KV's tokens kept up to {parted or TOKENS} of {TOKENS}")
    # 0.625 bytes an element. No bound on the share: 4 bits in groups of 64 change this
    # small model's answer from the first tokens on (1.2% of 256 agreed); docs say so.
    assert sum(per_token) == FLOAT_BYTES * 625 // 4000, per_token
