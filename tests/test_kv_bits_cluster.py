"""KV_CACHE_BITS on real ranks with the default model (SmolLM2-135M, float32 weights):
greedy answers with 8-bit KV against float KV at 2 ranks (and 1), the 4-bit figure, each
rank's measured KV bytes per token against the plan's prediction, and a prefix-cache hit
served from quantized entries (the same start of the answer).

Float KV gives the same greedy tokens at any split (tests/test_sharding_cluster.py), so
one float run at 1 rank is the reference for both rank counts. The suite compares 64
tokens (the issue's 256 took 5 minutes of the suite's 20 here); the figure of 256 is
`KV_BITS_TOKENS=256 ./test.sh -k kv_bits -s` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os

import pytest

from ipc.protocol import Done
from launcher.local_cluster import Cluster
from tests.support.rank_requests import greedy, run_requests

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ENV = {
    "IMPORT_DTYPE": "float32",
    "MAX_SEQUENCE_LENGTH": "1024",
    "MAX_BATCH_SIZE": "2",
    "KEEP_WARM_SECONDS": "0",
}
TOKENS = int(os.environ.get("KV_BITS_TOKENS", "64"))
# A prompt that keeps the model writing for 256 tokens (it does not reach its end token).
PROMPT = (
    "<|im_start|>user\nWrite a long story about a lighthouse keeper who finds a map. Describe "
    "every day of his journey in detail.<|im_end|>\n<|im_start|>assistant\n"
)
FLOAT_BYTES = 30 * 3 * 64 * 2 * 4  # layers x KV heads x head dim x (K, V) x float32


def answer(cluster: Cluster, request_id: str, tokens: int = TOKENS) -> tuple[list[int], Done]:
    with cluster.client() as client:
        _, answers, final = run_requests(client, [greedy(request_id, PROMPT, tokens)])
    done = final[request_id]
    assert isinstance(done, Done), done
    return answers[request_id], done


def run(ranks: int, bits: str, repeat: bool = False) -> tuple[list[int], list[int], str]:
    """(tokens, each rank's KV bytes per token, the log) with KV_CACHE_BITS=bits; `repeat`:
    the prompt again, served from the prefix cache's quantized entry."""
    with Cluster("", ranks=ranks, env=ENV | {"KV_CACHE_BITS": bits}, ready_timeout=300) as c:
        tokens, done = answer(c, "first")
        if repeat:
            again, hit = answer(c, "again", 64)
        per_token = [r.kv_bytes_per_token for r in c.status().ranks]
        log = c.log_tail(200)
    assert len(tokens) == TOKENS, (len(tokens), done.finish_reason)
    if repeat:
        assert hit.usage.prompt_tokens_details.cached_tokens > 0, hit.usage
        # The hit computes the prompt's last token alone, not in the prompt's forward: float
        # sums in another order, which a long greedy answer may amplify (at token 158 of 256
        # in one run). An entry holding wrong KV would differ at once.
        assert again == tokens[:64], f"a prefix-cache hit changed the answer ({bits} bits)"
    return tokens, per_token, log


def agreement(tokens: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(reference)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    tokens, per_token, _ = run(1, "none")
    assert per_token == [FLOAT_BYTES]
    return tokens


# 2 ranks always (the split heads' own KV quantized); 1 too with KV_BITS_RANKS=1,2 (28 s
# of the suite's 20 minutes; the quantized cache itself is checked in one process).
RANKS = [int(n) for n in os.environ.get("KV_BITS_RANKS", "2").split(",")]


@pytest.mark.parametrize("ranks", RANKS)
def test_8_bit_kv_keeps_the_greedy_answer(reference: list[int], ranks: int) -> None:
    tokens, per_token, log = run(ranks, "8", repeat=ranks == RANKS[0])
    share = agreement(tokens, reference)
    print(f"8-bit KV, {ranks} rank(s): {share:.1%} of {TOKENS} greedy tokens as float KV's")
    assert share >= 0.95, share
    assert "KV cache: 8 bits in groups of 64 (KV_CACHE_BITS)" in log
    # 1 byte an element plus a float32 scale and bias a group of 64: 1.125 bytes, not 4
    assert sum(per_token) == FLOAT_BYTES * 1125 // 4000 and min(per_token) > 0, per_token


@pytest.mark.skipif(
    not os.environ.get("KV_BITS_TOKENS"),
    reason="a figure, not a check: KV_BITS_TOKENS=256 ./test.sh -k kv_bits -s (the 4-bit bytes "
    "are checked in tests/test_quantized_kv.py)",
)
def test_4_bit_kv_figure(reference: list[int]) -> None:
    tokens, per_token, _ = run(2, "4")
    share = agreement(tokens, reference)
    print(f"4-bit KV, 2 ranks: {share:.1%} of {TOKENS} greedy tokens as float KV's")
    # 0.625 bytes an element. No bound on the share: 4 bits in groups of 64 change this
    # small model's answer from the first tokens on (1.2% of 256 agreed); docs say so.
    assert sum(per_token) == FLOAT_BYTES * 625 // 4000, per_token
