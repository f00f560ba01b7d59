"""Real multi-rank runs: 2 ranks of server.py over the ring backend on 127.0.0.1.

One cluster per model for the whole module (a tiny random model, and the default
SmolLM2 model when it can be resolved). Clusters that end (SIGTERM, a dead worker, the
collective watchdog) are tests/test_cluster_ends.py's.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from ipc.framing import encode_frame
from ipc.processes import cpu_seconds
from ipc.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Delta,
    Done,
    Error,
    Hello,
    SamplingParams,
    Started,
    Submit,
)
from launcher.local_cluster import Cluster
from tests.support.rank_requests import CLUSTER_ENV, greedy, run_requests
from tests.support.tiny_models import SPECIAL_TOKENS, write_tiny_model

pytestmark = pytest.mark.cluster


def write_model_without_eos(directory: Path) -> Path:
    """A tiny model whose special tokens score 0, so greedy decoding never ends early."""
    write_tiny_model(directory)
    path = directory / "model.safetensors"
    weights = mx.load(str(path))
    head = weights["lm_head.weight"]
    first = 256  # special tokens follow the 256 byte tokens
    head[first : first + len(SPECIAL_TOKENS)] = 0.0
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = write_model_without_eos(tmp_path_factory.mktemp("tiny"))
    with Cluster(model, ranks=2, env=CLUSTER_ENV) as running:
        yield running


# ---- helpers -------------------------------------------------------------------------


def mixed_batch(prefix: str = "", greedy_tokens: int = 24, step: int = 3) -> list[Submit]:
    """Eight requests of different lengths and parameters (the first one greedy)."""
    submits = [greedy(f"{prefix}g", "The quick brown fox", greedy_tokens)]
    for i in range(1, 8):
        sampling = SamplingParams(
            max_tokens=2 * step + step * i,
            temperature=0.5 + 0.1 * i,
            top_p=0.9,
            top_k=i * 10,
            min_p=0.01 * i,
            seed=i,
            presence_penalty=0.1 * i,
            frequency_penalty=0.05 * i,
            repetition_penalty=1.0 + 0.05 * i,
            logprobs=i % 2 == 0,
            top_logprobs=i % 3,
        )
        if i % 2:
            submits.append(Submit(id=f"{prefix}{i}", prompt="x" * (7 * i), params=sampling))
        else:
            messages = [{"role": "user", "content": "Tell me about rings " * i}]
            submits.append(Submit(id=f"{prefix}{i}", messages=messages, params=sampling))
    return submits


# ---- tests on the shared cluster ----------------------------------------------------


def test_status_reports_two_ready_ranks(cluster):
    status = cluster.status()
    assert status.state == "ready"
    assert status.world_size == 2
    assert [r.rank for r in status.ranks] == [0, 1]
    assert status.max_batch_size == 8
    assert oct(os.stat(cluster.socket_path).st_mode & 0o777) == "0o600"


def check_finished(submits: list[Submit], tokens: dict, final: dict) -> None:
    """Every request ended with Done, consistent usage and a finish reason that fits."""
    for submit in submits:
        done = final[submit.id]
        assert isinstance(done, Done), done
        max_tokens = submit.params.max_tokens
        assert done.usage.completion_tokens == len(tokens[submit.id]) <= max_tokens
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
        # "stop" may also come on the last allowed token (an EOS there)
        assert done.finish_reason == "stop" or len(tokens[submit.id]) == max_tokens
        assert done.timings.time_to_first_token_s > 0


def test_eight_concurrent_requests_finish(cluster):
    submits = mixed_batch()
    with cluster.client() as client:
        _, tokens, final = run_requests(client, submits)
    check_finished(submits, tokens, final)
    assert final["g"].finish_reason == "length" and len(tokens["g"]) == 24


def test_greedy_output_same_alone_and_in_a_batch(cluster):
    with cluster.client() as client:
        _, alone, _ = run_requests(client, [greedy("alone", "The quick brown fox", 24)])
        _, batched, _ = run_requests(client, mixed_batch("b"))
    assert alone["alone"] == batched["bg"]


def test_compiled_and_eager_decode_give_the_same_tokens(cluster):
    # The shared cluster decodes compiled (COMPILED_DECODE=auto); the same model again, eager.
    def batch() -> list[Submit]:
        return [
            greedy(f"c{i}", "The quick brown fox " * i + "x" * i, 12 + 3 * i) for i in range(1, 9)
        ]

    with cluster.client(timeout=120) as client:
        _, compiled, _ = run_requests(client, batch())
    env = CLUSTER_ENV | {"COMPILED_DECODE": "off"}
    with Cluster(cluster.model, ranks=2, env=env) as eager_cluster:
        with eager_cluster.client(timeout=120) as client:
            _, eager, _ = run_requests(client, batch())
        log = eager_cluster.log_path.read_text()
    assert compiled == eager
    assert all(len(compiled[f"c{i}"]) == 12 + 3 * i for i in range(1, 9))
    assert "r1 INFO decode: compiled" in cluster.log_path.read_text()
    assert "r1 INFO decode: eager (COMPILED_DECODE=off)" in log


def test_logprobs_come_with_each_token(cluster):
    submit = greedy("lp", "abc", 5, logprobs=True, top_logprobs=2)
    with cluster.client() as client:
        client.send(submit)
        deltas = []
        while not isinstance(message := client.recv(), Done):
            if isinstance(message, Delta):
                deltas.append(message)
    logprobs = [lp for d in deltas for lp in d.logprobs or []]
    assert len(logprobs) == 5
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    # greedy: the chosen token is the most likely one
    assert all(lp.logprob == pytest.approx(lp.top_logprobs[0].logprob) for lp in logprobs)


def test_cancel_frees_the_slot_while_others_finish(cluster):
    submits = [greedy("long", "cancel me", 400)] + mixed_batch("c")[1:4]
    with cluster.client() as client:
        _, tokens, final = run_requests(client, submits, cancel_after={"long": 5})
    assert final["long"].finish_reason == "cancelled"
    assert len(tokens["long"]) < 400
    assert all(isinstance(final[s.id], Done) for s in submits[1:])
    assert all(final[s.id].finish_reason != "cancelled" for s in submits[1:])
    assert _eventually_idle(cluster)


def test_closed_connection_cancels_its_requests(cluster):
    client = cluster.client()
    client.send(greedy("gone", "bye", 400))
    assert isinstance(client.recv(), Started)
    while not isinstance(client.recv(), Delta):
        pass
    client.close()
    assert _eventually_idle(cluster)


def test_stop_sequences_and_max_tokens_hold(cluster):
    with cluster.client() as client:
        texts, tokens, final = run_requests(client, [greedy("free", "stop here", 32)])
        full = texts["free"]
        assert final["free"].finish_reason == "length" and len(tokens["free"]) == 32
        clean = [i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
        assert clean, f"no usable stop string in {full!r}"
        stop = full[clean[0] : clean[0] + 2]
        texts, _, final = run_requests(client, [greedy("stopped", "stop here", 32, stop=[stop])])
    assert final["stopped"].finish_reason == "stop"
    assert texts["stopped"] == full[: full.index(stop)]


def test_prompt_too_long_is_refused_at_rank_0(cluster):
    with cluster.client() as client:
        _, _, final = run_requests(client, [greedy("big", "y" * 600, 8)])
    assert isinstance(final["big"], Error) and final["big"].code == "prompt_too_long"
    assert "MAX_SEQUENCE_LENGTH=512" in final["big"].message


def _raw_connection(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(encode_frame(Hello(protocol_version=PROTOCOL_VERSION)))
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack(">I", 9) + b"not json!",
        struct.pack(">I", 2**31) + b"x" * 16,
        encode_frame(Cancel(id="x")).replace(b"cancel", b"cancek"),
        struct.pack(">I", 100) + b"short",
    ],
    ids=["garbage", "oversized", "unknown-type", "cut-short"],
)
def test_malformed_frames_are_rejected_and_next_request_served(cluster, frame):
    with cluster.client() as bystander:
        bystander.send(greedy("bystander", "still here", 16))
        sock = _raw_connection(cluster.socket_path)
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        reply = _read_until_closed(sock)
        sock.close()
        assert b'"bad_frame"' in reply
        done = None
        while not isinstance(done, Done):
            done = bystander.recv()
        assert done.id == "bystander" and done.usage.completion_tokens == 16
    with cluster.client() as client:
        _, tokens, final = run_requests(client, [greedy("after", "next", 4)])
    assert final["after"].finish_reason == "length" and len(tokens["after"]) == 4


def test_wrong_protocol_version_is_refused(cluster):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(cluster.socket_path))
    sock.sendall(encode_frame(Hello(protocol_version=PROTOCOL_VERSION + 1)))
    reply = _read_until_closed(sock)
    sock.close()
    assert b'"protocol_version"' in reply


def _cpu_seconds(pid: int) -> float:
    used = cpu_seconds(pid)
    assert used is not None, f"process {pid} is gone"
    return used


def _eventually_idle(cluster: Cluster, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = cluster.status()
        if status.active_requests == 0 and status.queued_requests == 0:
            return True
        time.sleep(0.05)
    return False


def test_idle_ranks_do_not_spin(cluster):
    assert _eventually_idle(cluster)
    pids = cluster.rank_pids() | {"launcher": cluster.process.pid}
    before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(3.0)
    used = {name: (_cpu_seconds(pid) - before[name]) / 3.0 for name, pid in pids.items()}
    # The target is 2% of a core per idle rank; mlx.launch wakes ~10 times a second to
    # relay output, which costs more on a loaded machine.
    limits = {name: 0.05 if name == "launcher" else 0.02 for name in used}
    assert all(used[name] < limits[name] for name in used), used


# ---- the default model (SmolLM2-135M, imported as float32) ----------------------------


@pytest.fixture(scope="module")
def default_cluster():
    env = CLUSTER_ENV | {"IMPORT_DTYPE": "float32", "PREFILL_CHUNK_SIZE": "64"}
    with Cluster("", ranks=2, env=env, ready_timeout=300) as running:
        yield running


def test_default_model_serves_a_batch_of_eight_like_one(default_cluster):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    alone = Submit(id="alone", messages=chat, params=SamplingParams(max_tokens=8, temperature=0))
    submits = mixed_batch("b", greedy_tokens=8, step=1)
    submits[0] = alone.model_copy(update={"id": "bg"})
    with default_cluster.client(timeout=300) as client:
        texts_alone, tokens_alone, _ = run_requests(client, [alone])
        texts, tokens, final = run_requests(client, submits)
    check_finished(submits, tokens, final)
    assert tokens["bg"] == tokens_alone["alone"]
    assert texts["bg"] == texts_alone["alone"]
    assert "Paris" in texts["bg"]


def test_status_sets_the_step_models_prediction_beside_the_measured_steps(default_cluster):
    # after the batch above: decode steps of 1 and of 8 rows, each predicted with its context
    model = default_cluster.status().step_model
    assert len(model.machines) == 2 and model.link.startswith("link measured (ring, 2 ranks)")
    assert {1, 8} <= set(model.predicted_decode_ms) and model.measured_decode_ms
    for rows, measured in model.measured_decode_ms.items():
        assert measured > 0 and model.predicted_decode_ms[rows] > 0
        assert model.decode_steps[rows] >= 1
    assert model.predicted_decode_ms[8] > model.predicted_decode_ms[1]
    assert model.speed["activation_bytes"] == 4 and len(model.speed["machines"]) == 2
    summary = subprocess.run(
        [sys.executable, "scripts/status_summary.py"],
        input=default_cluster.status().model_dump_json(),
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert re.search(r"decode step, predicted / measured: 1 row\(s\) [\d.]+ / ", summary.stdout)
    assert "measured at start: link measured (ring, 2 ranks)" in summary.stdout


# ---- a step of several forwards, each rank holding a different share -----------------

# The default model's 9 heads split 6 and 3 at 2 ranks, so the ranks' graphs differ in
# shape; a prompt's last chunk of more than LAST_TOKEN_ALONE tokens runs two forwards in
# one evaluation, and a prompt arriving beside an answer a third. The clusters above take
# 16-token chunks, where neither happens.
LONG_PROMPT = "Here are the harbour's notes for the week.\n" + "".join(
    f"Day {day}: the ferry left at {6 + day % 5}:{15 * (day % 4):02d}, carried {40 + 7 * day} "
    f"passengers and {day % 6} cars, and came back {day % 3 * 5} minutes late.\n"
    for day in range(1, 15)
)


def _answers(cluster: Cluster) -> dict[str, list[int]]:
    """A long prompt's greedy answer alone, then another's sent while a story decodes."""
    long, story = greedy("long", LONG_PROMPT, 12), greedy("story", "Once upon a time", 40)
    with cluster.client(timeout=300) as client:
        _, tokens, _ = run_requests(client, [long])
        client.send(story)
        final: dict[str, Done | Error] = {}
        while len(final) < 2:
            message = client.recv()
            assert message is not None, "rank 0 closed the connection"
            if isinstance(message, Delta):
                if message.id == "story" and "story" not in tokens:  # a prompt joins it
                    client.send(greedy("beside", "Read these again.\n" + LONG_PROMPT, 12))
                tokens.setdefault(message.id, []).extend(message.token_ids)
            elif isinstance(message, Done | Error):
                final[message.id] = message
    beside = final["beside"]
    assert isinstance(beside, Done) and beside.usage.prompt_tokens > 400, beside
    return tokens


def test_steps_of_several_forwards_answer_as_one_rank():
    env = CLUSTER_ENV | {
        "IMPORT_DTYPE": "float32",
        "PREFILL_CHUNK_SIZE": "2048",
        "MAX_SEQUENCE_LENGTH": "2048",
    }
    with Cluster("", ranks=1, env=env, ready_timeout=300) as one:
        expected = _answers(one)
    with Cluster("", ranks=2, env=env, ready_timeout=300) as two:
        shares = [rank.share for rank in two.status().ranks]
        assert "q heads 0-5 (6)" in shares[0] and "q heads 6-8 (3)" in shares[1]
        assert _answers(two) == expected
    # As a pipeline, rank 0 takes the answer's logits back only after its layers of the
    # prompt's chunk (distributed/pipeline.py `results_later`): the same tokens.
    with Cluster("", ranks=2, env=env | {"PARALLELISM": "pipeline"}, ready_timeout=300) as two:
        assert "layers 0-" in two.status().ranks[0].share
        assert _answers(two) == expected
