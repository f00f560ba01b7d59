"""The first host sends each worker its share of the model, over real SSH and the namespace
link, to workers whose model cache is an empty disk of their own
(tests/support/transfer_hosts.py): launcher/model_sender.py runs as the supervisor runs it.

Always on: shares of a dense model (tensor, 2 ranks), an MoE model (heads and experts,
3 ranks, weights 2,1,1) and a pipeline (3 ranks) land whole, their bytes on each worker's
disk within 5% of the plan's weights for that rank, and load back bit for bit as the
loader's own split; a second start sends nothing; a flipped byte on a worker's disk is
caught and only its block sent again; a transfer cut mid-way resumes without sending again
what arrived; a worker short of disk is refused before anything is sent, with both numbers;
a worker that holds a full copy receives nothing. The ranks serving from shares, and their
answers against workers that hold the full model: tests/test_remote_hosts.py (3 ranks,
pipeline), and here with SHARE_SPLITS=all (tensor, expert and pipeline at 2 and 3 ranks).
Needs root (skips with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from acquisition.identity import identify
from acquisition.wire import BLOCK_BYTES
from config.settings import PROJECT_DIR
from distributed.memory import predict_weight_bytes
from distributed.plan import Plan, make_plan
from distributed.rank_share import load_share, rank_parameters, share_key
from distributed.splitting import StandInGroup, parameters
from tests.support import netns_hosts
from tests.support.netns_hosts import NetnsHosts
from tests.support.tiny_families import write_family_model
from tests.support.tiny_models import write_tiny_model
from tests.support.transfer_hosts import (
    CACHE,
    fetch,
    files_on,
    follow,
    limit_link,
    send,
    sender,
    up,
)
from tests.test_launch import START_TIMEOUT, copy_project

pytestmark = [pytest.mark.cluster]

# (name, model, ranks, PARALLELISM, RANK_WEIGHTS): what each split kind sends
SPLITS = {
    "dense-tensor2": ("dense", 2, "tensor", None),
    "moe-expert3": ("moe", 3, "tensor", "2,1,1"),
    "dense-pipeline3": ("dense", 3, "pipeline", None),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Models of 20-50 MB (so headers and tokenizer weigh little), in a directory the
    workers cannot see."""
    root = tmp_path_factory.mktemp("transfer") / "models"
    dense = write_tiny_model(
        root / "dense",
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1536,
        num_hidden_layers=4,
    )
    moe = write_family_model(
        root / "moe",
        "qwen3_moe",
        overrides={
            "hidden_size": 256,
            "head_dim": 32,
            "moe_intermediate_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
        },
    )
    return {"dense": dense, "moe": moe}


@pytest.fixture(scope="module")
def hosts(models: dict[str, Path]) -> Iterator[NetnsHosts]:
    reason = netns_hosts.unavailable()
    if reason:
        pytest.skip(f"the transfer tests need network namespaces with sshd: {reason}")
    made = up(models["dense"].parent)
    try:
        yield made
    finally:
        made.down()


def _plan(model_dir: Path, ranks: int, parallelism: str, weights: str | None) -> Plan:
    config = json.loads((model_dir / "config.json").read_text())
    parsed = [float(w) for w in weights.split(",")] if weights else None
    return make_plan(config, ranks, parsed, parallelism)


def _env(parallelism: str, weights: str | None, **more: str) -> dict[str, str]:
    return {"PARALLELISM": parallelism, "RANK_WEIGHTS": weights or ""} | more


def _share_dir(model_dir: Path, plan: Plan, rank: int) -> Path:
    key = identify(model_dir, CACHE).key
    return CACHE / "received" / key / share_key(key, plan, rank)


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_each_worker_receives_exactly_its_share(
    split: str, hosts: NetnsHosts, models: dict[str, Path], tmp_path: Path
) -> None:
    name, ranks, parallelism, weights = SPLITS[split]
    model_dir = models[name]
    plan = _plan(model_dir, ranks, parallelism, weights)
    workers = hosts.workers[: ranks - 1]
    runs = send(hosts, workers, model_dir, ranks, _env(parallelism, weights))
    for worker, run in zip(workers, runs, strict=True):
        assert run.returncode == 0, (run.events, run.stderr)
        done = run.last("done")
        assert done["have"] == "none" and done["sent_bytes"] == done["share_bytes"], done
        assert run.last("inventory")["need_bytes"] == done["share_bytes"]
        files = files_on(hosts, worker, _share_dir(model_dir, plan, worker.index))
        assert files, (run.events, files_on(hosts, worker, CACHE))
        assert "share.json" in files and not [f for f in files if f.endswith(".part")]
        on_disk = sum(files.values())
        planned = predict_weight_bytes(model_dir, plan, [worker.index])[0]
        assert abs(on_disk - planned) <= 0.05 * planned, (on_disk, planned)
        assert on_disk - files["share.json"] == done["share_bytes"]
    # what the worker holds loads back as the loader's own split of the whole model
    worker = workers[-1]
    copy = fetch(hosts, worker, _share_dir(model_dir, plan, worker.index), tmp_path)
    key = identify(model_dir, CACHE).key
    group = StandInGroup(worker.index, ranks)
    loaded = dict(parameters(load_share(copy, plan, group, key)))
    expected = dict(rank_parameters(model_dir, plan, worker.index))
    assert loaded.keys() == expected.keys()
    assert all(mx.array_equal(loaded[k], v).item() for k, v in expected.items())


def test_a_second_start_sends_nothing(hosts: NetnsHosts, models: dict[str, Path]) -> None:
    name, ranks, parallelism, weights = SPLITS["moe-expert3"]
    runs = send(hosts, hosts.workers, models[name], ranks, _env(parallelism, weights))
    for run in runs:
        assert run.returncode == 0, (run.events, run.stderr)
        inventory, done = run.last("inventory"), run.last("done")
        assert inventory["have"] == "share" and inventory["need_bytes"] == 0, inventory
        assert done["sent_bytes"] == 0 and not run.last("offer").get("sent_bytes"), done
        assert not [e for e in run.events if e["event"] == "progress"]


def test_a_flipped_byte_is_caught_and_only_its_block_sent_again(
    hosts: NetnsHosts, models: dict[str, Path]
) -> None:
    name, ranks, parallelism, weights = SPLITS["dense-tensor2"]
    model_dir = models[name]
    worker = hosts.workers[0]
    share = _share_dir(model_dir, _plan(model_dir, ranks, parallelism, weights), worker.index)
    tensors = share / "share-00001.safetensors"
    offset = BLOCK_BYTES + 12345  # in the second block
    # one byte inverted in place, its time of change kept: only its content tells
    flip = (
        "import os, sys\n"
        "path, at = sys.argv[1], int(sys.argv[2]); stat = os.stat(path)\n"
        "with open(path, 'r+b') as f:\n"
        "    f.seek(at); b = f.read(1); f.seek(at); f.write(bytes([b[0] ^ 0xFF]))\n"
        "os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))\n"
    )
    done = hosts.run_in(worker, "python3", "-c", flip, str(tensors), str(offset))
    assert done.returncode == 0, done.stderr
    (run,) = send(hosts, [worker], model_dir, ranks, _env(parallelism, weights))
    assert run.returncode == 0, (run.events, run.stderr)
    inventory = run.last("inventory")
    assert inventory["damaged"] == ["share-00001.safetensors#1"], inventory
    assert inventory["need_bytes"] == BLOCK_BYTES
    assert run.last("done")["sent_bytes"] == BLOCK_BYTES
    (again,) = send(hosts, [worker], model_dir, ranks, _env(parallelism, weights))
    assert again.last("inventory")["have"] == "share" and again.last("done")["sent_bytes"] == 0


def test_a_transfer_cut_midway_resumes_without_sending_again_what_arrived(
    hosts: NetnsHosts, models: dict[str, Path]
) -> None:
    model_dir = models["dense"]
    worker = hosts.workers[1]
    env = _env("pipeline", None, TRANSFER_STREAMS="2")  # a 2-rank pipeline: not sent yet
    limit_link(worker, "60mbit")  # about 7 MB/s: the cut lands mid-way
    try:
        cut = follow(
            sender(hosts, worker, model_dir, 2, env, rank=1),
            lambda e: e["event"] == "progress" and e["done_bytes"] > 0.3 * e["total_bytes"],
        )
    finally:
        limit_link(worker, None)
    arrived = cut.last("progress")["done_bytes"]
    total = cut.last("progress")["total_bytes"]
    assert cut.returncode != 0 and 0.3 * total < arrived < total, cut.events
    (run,) = send(hosts, [worker], model_dir, 2, env, rank=1)
    assert run.returncode == 0, (run.events, run.stderr)
    inventory, done = run.last("inventory"), run.last("done")
    assert inventory["have"] == "partial" and inventory["have_bytes"] >= arrived, inventory
    assert done["sent_bytes"] == total - inventory["have_bytes"], (inventory, done)


def test_a_worker_short_of_disk_is_refused_before_anything_is_sent(
    hosts: NetnsHosts, models: dict[str, Path]
) -> None:
    worker = hosts.workers[1]
    small = hosts.run_in(worker, "mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(CACHE))
    assert small.returncode == 0, small.stderr
    try:
        (run,) = send(hosts, [worker], models["moe"], 2, _env("pipeline", None), rank=1)
        assert run.returncode == 3, (run.events, run.stderr)
        refused = run.last("refused")["reason"]
        share = run.last("offer")["share_bytes"]
        need = f"{share / 2**20:.1f} MiB"
        assert re.fullmatch(
            rf"{re.escape(str(CACHE))} has 16\.0 MiB free; the share needs {re.escape(need)} "
            r"more and 1\.00 GiB stays free: free \S+ \S+ there, or point MODEL_CACHE_DIR at a "
            r"larger disk",
            refused,
        ), refused
        assert not [e for e in run.events if e["event"] == "progress"]
        assert not [f for f in files_on(hosts, worker, CACHE) if f.endswith(".part")]
    finally:
        hosts.run_in(worker, "umount", str(CACHE))


def test_a_worker_holding_a_full_copy_receives_nothing(
    hosts: NetnsHosts, models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = models["moe"]
    worker = hosts.workers[0]
    staged = shutil.copytree(model_dir, hosts.workdir / "staged" / model_dir.name)
    done = hosts.run_in(worker, "cp", "-a", str(staged), str(model_dir))  # its own disk
    assert done.returncode == 0, done.stderr
    (run,) = send(hosts, [worker], model_dir, 2, _env("tensor", None))
    assert run.returncode == 0, (run.events, run.stderr)
    assert run.last("inventory")["have"] == "full", run.events
    assert run.last("inventory")["directory"] == str(model_dir)
    assert run.last("done")["sent_bytes"] == 0
    key = identify(model_dir, CACHE).key
    pointer = hosts.run_in(worker, "cat", str(CACHE / "received" / key / "full.json"))
    assert json.loads(pointer.stdout) == {"path": str(model_dir)}


# ---- the ranks serving from shares (opt-in: two starts per split) -----------------------

ALL_SPLITS = pytest.mark.skipif(
    os.environ.get("SHARE_SPLITS") != "all",
    reason="opt-in (SHARE_SPLITS=all ./test.sh -k model_transfer): two starts per split; "
    "always on: 3 ranks of a pipeline in tests/test_remote_hosts.py",
)
# (model, ranks, PARALLELISM, RANK_WEIGHTS)
SERVED = {
    "dense-tensor2": ("dense", 2, "tensor", None),
    "dense-tensor3": ("dense", 3, "tensor", "2,1,1"),
    "moe-expert2": ("moe", 2, "tensor", None),
    "moe-expert3": ("moe", 3, "tensor", "2,1,1"),
    "dense-pipeline2": ("dense", 2, "pipeline", None),
    "dense-pipeline3": ("dense", 3, "pipeline", None),
}


def _answer(url: str) -> str:
    reply = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@ALL_SPLITS
@pytest.mark.parametrize("split", list(SERVED), ids=list(SERVED))
def test_ranks_serve_from_their_shares_as_from_full_copies(
    split: str, hosts: NetnsHosts, models: dict[str, Path], tmp_path: Path
) -> None:
    name, ranks, parallelism, weights = SERVED[split]
    model_dir = models[name]
    workers = hosts.workers[: ranks - 1]
    env = (
        f"MODEL={model_dir}\nPARALLELISM={parallelism}\nRANK_WEIGHTS={weights or ''}\n"
        f"MAX_SEQUENCE_LENGTH=512\nDEFAULT_MAX_TOKENS=16\nKEEP_WARM_SECONDS=0\n"
        f"WORKER_HOSTS={','.join(w.address for w in workers)}\n"
        f"WORKER_SSH={','.join('root@' + w.address for w in workers)}\n"
        f"REMOTE_DIR={','.join(str(w.remote_dir) for w in workers)}\n"
    )
    project = copy_project(tmp_path / "project", env)
    path = {"PATH": f"{hosts.bin}:{os.environ['PATH']}", "OPENBLAS_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{project.port}"
    staged = shutil.copytree(model_dir, hosts.workdir / "staged" / model_dir.name)
    try:
        shares = project.launch("start", env=path, timeout=START_TIMEOUT)
        assert shares.returncode == 0, shares.stdout + shares.stderr
        for worker in workers:
            assert re.search(
                rf"rank {worker.index} \(root@\S+\): holds its model \(.*\); sent ", shares.stdout
            ), shares.stdout
        from_shares = _answer(url)
        assert project.launch("stop", env=path).returncode == 0
        for worker in workers:  # now every host holds the full model
            done = hosts.run_in(worker, "cp", "-a", str(staged), str(model_dir))
            assert done.returncode == 0, done.stderr
        full = project.launch("start", env=path, timeout=START_TIMEOUT)
        assert full.returncode == 0, full.stdout + full.stderr
        assert full.stdout.count("holds a full copy of the model") == len(workers), full.stdout
        assert _answer(url) == from_shares
    finally:
        project.launch("stop", env=path)
        shutil.rmtree(staged, ignore_errors=True)
        for worker in workers:
            hosts.run_in(worker, "rm", "-rf", str(model_dir))


@pytest.mark.skipif(
    os.environ.get("WORKER_WHEELS") != "1",
    reason="opt-in (WORKER_WHEELS=1 ./test.sh -k wheels): a worker's venv installed from "
    "wheels, some minutes",
)
def test_a_worker_without_the_package_index_gets_its_venv_from_this_hosts_wheels(
    hosts: NetnsHosts, models: dict[str, Path], tmp_path: Path
) -> None:
    worker = hosts.workers[1]
    venv = worker.remote_dir / ".venv"
    shutil.rmtree(venv)  # hardlinks: the project's own venv is untouched
    # PyPI is off the namespace's network; this machine's local mirrors go out of its sight
    mirrors = [p for p in ("/opt/pypi", "/opt/pypi-more", "/opt/wheels") if Path(p).is_dir()]
    for mirror in mirrors:
        assert hosts.run_in(worker, "mount", "-t", "tmpfs", "tmpfs", mirror).returncode == 0
    env = (
        f"MODEL={models['dense']}\nPARALLELISM=tensor\nMAX_SEQUENCE_LENGTH=512\n"
        f"DEFAULT_MAX_TOKENS=16\nKEEP_WARM_SECONDS=0\nWORKER_HOSTS={worker.address}\n"
        f"WORKER_SSH=root@{worker.address}\nREMOTE_DIR={worker.remote_dir}\n"
    )
    project = copy_project(tmp_path / "project", env)
    path = {"PATH": f"{hosts.bin}:{os.environ['PATH']}", "OPENBLAS_NUM_THREADS": "1"}
    try:
        done = project.launch("start", env=path, timeout=START_TIMEOUT)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"rank 1 (root@{worker.address}) cannot reach the package index" in done.stdout
        assert "it installs the wheels this host downloads" in done.stdout
        assert "installing from the wheels in run/wheels only (no package index)" in done.stdout
        here = re.search(r"this host: Python \S+, mlx (\S+), mlx-lm (\S+),", done.stdout)
        assert here, done.stdout
        there = rf"mlx {re.escape(here[1])}, mlx-lm {re.escape(here[2])} \(venv\)"
        assert re.search(rf"root@{re.escape(worker.address)} .*{there}", done.stdout)
        assert _answer(f"http://127.0.0.1:{project.port}")
    finally:
        project.launch("stop", env=path)
        for mirror in mirrors:
            hosts.run_in(worker, "umount", mirror)
        shutil.rmtree(venv, ignore_errors=True)
        link = ["cp", "-al", str((PROJECT_DIR / ".venv").resolve()), str(venv)]
        subprocess.run(link, check=True, timeout=120)
