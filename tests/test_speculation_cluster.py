"""Speculative decoding on 2 real ranks (tensor and pipeline): the same answers as without.

A tiny random model falls into loops of a few tokens when decoded greedily, so prompt
lookup proposes from the answer's own repetitions, and is sometimes wrong where a loop
starts or changes: rows accept different runs, and rejected positions roll back.
SPECULATIVE=always (every step where a row proposes: the per-step rule, timed on a shared
machine, would make the tests depend on its load; tests/test_speculation.py tests the rule).
Speculation off is the reference, from its own cluster (on an MoE family, experts split by
rank, too). Rows with a penalty, logprobs or a grammar speculate as the others do.
A draft model (DRAFT_MODEL, on rank 0 alone) proposes where prompt lookup has nothing: the
served model as its own draft (nearly every proposal accepted), and another random model
with the same tokenizer (few accepted); both give the reference's tokens.
"""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest

from ipc.client import RankClient
from ipc.protocol import Delta, Done, Error, OutputFormat, SamplingParams, Started, Submit
from launcher.local_cluster import Cluster
from tests.support.api_server import api_over
from tests.support.tiny_families import write_family_model
from tests.support.tiny_models import write_tiny_model

pytestmark = pytest.mark.cluster

ENV = {
    "MAX_BATCH_SIZE": "8",
    "PREFILL_CHUNK_SIZE": "64",
    "MAX_SEQUENCE_LENGTH": "512",
    "DEFAULT_MAX_TOKENS": "64",
    "SPEC_TOKENS": "4",
    "KEEP_WARM_SECONDS": "0",
}
TOKENS = 48


def submit(request_id: str, prompt: str, output: OutputFormat | None = None, **params) -> Submit:
    params = {"max_tokens": TOKENS, "temperature": 0.0, **params}
    return Submit(id=request_id, prompt=prompt, params=SamplingParams(**params), output=output)


SAYING = OutputFormat(
    type="json_schema",
    json_schema={
        "type": "object",
        "properties": {"said": {"type": "string"}},
        "required": ["said"],
    },
)
# batch 1: one greedy answer; batch 6: two greedy, one with a penalty and logprobs, one
# sampled with a seed, and two answering JSON of a schema (its grammar on rank 0 masks each
# position, and proposes the tokens it forces: `{"said": "`), greedy and sampled.
ALONE = [submit("alone", "abcabcabc abcabc")]
BATCH = [
    submit("g1", "the cat sat on the mat, the cat sat"),
    submit("g2", "0101 0101 0101"),
    submit("penalty", "xyz xyz", presence_penalty=0.5, logprobs=True),
    submit("seeded", "hello hello", temperature=0.3, top_p=0.95, seed=7),
    submit("json", "said: abc abc abc", SAYING),
    submit("json-seeded", "said: 0101 0101", SAYING, temperature=0.3, seed=4),
]


def run(client: RankClient, submits: list[Submit]) -> dict[str, tuple[list[int], Done]]:
    for message in submits:
        client.send(message)
    tokens: dict[str, list[int]] = {s.id: [] for s in submits}
    done: dict[str, Done] = {}
    while len(done) < len(submits):
        message = client.recv()
        assert message is not None, "rank 0 closed the connection"
        assert not isinstance(message, Error), message
        if isinstance(message, Delta):
            tokens[message.id] += message.token_ids
        elif isinstance(message, Done):
            done[message.id] = message
        else:
            assert isinstance(message, Started)
    return {key: (tokens[key], done[key]) for key in tokens}


def answers(cluster: Cluster) -> dict[str, tuple[list[int], Done]]:
    with cluster.client() as client:
        return run(client, ALONE) | run(client, BATCH)


def figures_through_the_api(cluster: Cluster) -> None:
    """api.py shows the figures: a response's performance, /metrics, /cluster/status."""
    with api_over(cluster, cluster.workdir / "api.log") as api:
        model = cluster.status().model_id
        body = {"model": model, "prompt": "abcabcabc abcabc", "max_tokens": TOKENS}
        reply = httpx.post(f"{api.base_url}/v1/completions", json={**body, "temperature": 0})
        assert reply.status_code == 200, reply.text
        performance = reply.json()["performance"]
        assert performance["accepted_tokens"] > 0 and performance["tokens_per_step"] > 1.0
        assert 0 < performance["acceptance_rate"] <= 1.0
        metrics = httpx.get(f"{api.base_url}/metrics").text
        assert "speculation_accepted_tokens_total" in metrics, metrics[-2000:]
        assert "speculation_draft_proposed_tokens_total" in metrics, metrics[-2000:]
        status = httpx.get(f"{api.base_url}/cluster/status").json()["speculation"]
        assert status["enabled"] and status["accepted_tokens"] >= performance["accepted_tokens"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), never_stops=True)


@pytest.fixture(scope="module")
def reference(model):
    with Cluster(model, ranks=2, env={**ENV, "SPECULATIVE": "off"}) as cluster:
        return answers(cluster)


@pytest.mark.parametrize("parallelism", ["tensor", "pipeline"])
def test_speculation_gives_the_same_tokens(model, reference, parallelism):
    env = {**ENV, "SPECULATIVE": "always", "PARALLELISM": parallelism}
    with Cluster(model, ranks=2, env=env) as cluster:
        got = answers(cluster)
        if parallelism == "tensor":
            figures_through_the_api(cluster)
    for key, (tokens, done) in reference.items():
        assert len(tokens) == TOKENS or done.finish_reason == "stop", key  # JSON may end
        assert done.timings.proposed_tokens == 0, key
        assert got[key][0] == tokens, f"{key} differs with speculation on ({parallelism})"
    timings = {key: done.timings for key, (_, done) in got.items()}
    assert timings["penalty"].proposed_tokens > 0  # penalties and logprobs speculate too
    for key in ("alone", "g1", "g2", "seeded", "json", "json-seeded"):
        assert timings[key].accepted_tokens > 0, (key, timings[key])
        assert timings[key].decode_steps < len(got[key][0]) - 1, (key, timings[key])
    # some proposals were rejected, and their positions rolled back
    assert sum(t.proposed_tokens - t.accepted_tokens for t in timings.values()) > 0


def test_speculation_on_an_expert_split(tmp_path_factory):
    """deepseek_v2 on 2 ranks: attention by heads, experts by rank, shared experts by
    columns; the routing of every verified position happens inside the one forward."""
    directory = write_family_model(tmp_path_factory.mktemp("dsv2") / "model", "deepseek_v2")
    path = directory / "model.safetensors"
    weights = mx.load(str(path))
    weights["lm_head.weight"][256:] = 0.0  # special tokens never win: answers run to max
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    answers = {}
    for speculative in ("off", "always"):
        env = {**ENV, "SPECULATIVE": speculative, "PARALLELISM": "tensor"}  # auto: by speed
        with Cluster(directory, ranks=2, env=env) as cluster:
            assert cluster.status().plan["split_experts"]
            with cluster.client() as client:
                answers[speculative] = run(client, [submit("a", "abcabcabc abcabc")])["a"]
    (tokens, done), (spec_tokens, spec_done) = answers["off"], answers["always"]
    assert done.timings.proposed_tokens == 0
    assert spec_done.timings.accepted_tokens > 0, spec_done.timings
    assert spec_tokens == tokens


def test_a_draft_model_gives_the_same_tokens(model, reference):
    """The served model as its own draft, on 2 ranks (a poor draft, another random model,
    is tests/test_draft_model.py's, in one process). The draft's figures count its
    proposals alone; a greedy row's (in its `performance`) count prompt lookup's too. The
    seeded row samples at temperature 0.3, so even the served model's greedy proposals are
    often not what it draws."""
    env = {**ENV, "SPECULATIVE": "always", "DRAFT_MODEL": str(model)}
    with Cluster(model, ranks=2, env=env) as cluster:
        got = answers(cluster)
        figures = cluster.status().speculation
    for key, (tokens, _) in reference.items():
        assert got[key][0] == tokens, f"{key} differs with the served model as draft"
    assert figures.draft_model == str(model), figures
    timings = {key: done.timings for key, (_, done) in got.items()}
    proposed, accepted = figures.draft_proposed_tokens, figures.draft_accepted_tokens
    assert proposed > 0, figures
    greedy = [timings[key] for key in ("alone", "g1", "g2")]
    assert accepted >= 0.6 * proposed, figures  # its own greedy continuation: it agrees
    assert sum(t.accepted_tokens for t in greedy) >= 0.85 * sum(
        t.proposed_tokens for t in greedy
    ), timings
