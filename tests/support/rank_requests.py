"""Requests straight to rank 0's socket for the cluster tests: the settings their clusters
share, a greedy completion, and a run of many requests collected to the end."""

from __future__ import annotations

from ipc.client import RankClient
from ipc.protocol import Cancel, Delta, Done, Error, SamplingParams, Started, Submit

CLUSTER_ENV = {
    "MAX_BATCH_SIZE": "8",
    "PREFILL_CHUNK_SIZE": "16",
    "MAX_SEQUENCE_LENGTH": "512",
    "DEFAULT_MAX_TOKENS": "64",
    # the split these clusters check (compiled decode, heads across ranks); auto picks by
    # measured speed, and on 2 cores tensor and pipeline come within a few percent
    "PARALLELISM": "tensor",
}


def run_requests(client: RankClient, submits: list[Submit], cancel_after: dict | None = None):
    """Send all submits, collect text and the final message of each."""
    cancel_after = cancel_after or {}
    for submit in submits:
        client.send(submit)
    texts = {s.id: "" for s in submits}
    tokens = {s.id: [] for s in submits}
    final: dict[str, Done | Error] = {}
    while len(final) < len(submits):
        message = client.recv()
        assert message is not None, "rank 0 closed the connection"
        if isinstance(message, Delta):
            texts[message.id] += message.text
            tokens[message.id] += message.token_ids
            limit = cancel_after.get(message.id)
            if limit is not None and len(tokens[message.id]) >= limit:
                client.send(Cancel(id=message.id))
                cancel_after.pop(message.id)
        elif isinstance(message, Done | Error):
            final[message.id] = message
        else:
            assert isinstance(message, Started)
    return texts, tokens, final


def greedy(request_id: str, prompt: str, max_tokens: int, **params) -> Submit:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Submit(id=request_id, prompt=prompt, params=sampling)
