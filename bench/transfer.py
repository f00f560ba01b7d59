"""Getting a model of about 1 GB onto the workers: each worker's share (MODEL_TRANSFER=share)
against the whole model (MODEL_TRANSFER=full, and `scp -r` over SSH as the seeds did), at
2 and 3 ranks, over the namespace link of tests/support/netns_hosts.py (root on Linux).

The model has Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query / 8 KV heads of 128,
MLP 3072, vocabulary 151936, tied embeddings) with random bfloat16 weights: 1.19 GB. Each
run starts from empty worker caches and runs one sender per worker at once, as the
supervisor does before a start (launcher/model_sender.py, TRANSFER_STREAMS streams each); a
second run of the share shows what the next start costs (nothing sent, the share checked).
Beside them, the link's own ceiling (plain TCP, nothing hashed or written) and 2 ranks over
the link capped at LINK_CAP, where the link and not these 2 cores bounds the rate.

    sudo .venv/bin/python -m bench.transfer [--work DIR] [--streams 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SHAPE = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def write_model(directory: Path) -> Path:
    """The random Qwen3-0.6B-shaped model in bfloat16 (written once)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3

    if (directory / "model.safetensors").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(SHAPE))
    shapes: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = [(name, (mx.random.normal(p.shape) * 0.02).astype(mx.bfloat16)) for name, p in shapes]
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())
    mx.save_safetensors(
        str(directory / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (directory / "config.json").write_text(json.dumps(SHAPE, indent=2))
    return directory


def _clear(hosts: Any) -> None:
    from tests.support.transfer_hosts import CACHE

    for worker in hosts.workers:
        hosts.run_in(worker, "sh", "-c", f"rm -rf {CACHE}/received {CACHE}/scp-copy")


def _senders(hosts: Any, model: Path, world: int, env: dict[str, str]) -> dict[str, Any]:
    from tests.support.transfer_hosts import send

    started = time.monotonic()
    runs = send(hosts, hosts.workers[: world - 1], model, world, env)
    seconds = time.monotonic() - started
    for run in runs:
        if run.returncode != 0:
            raise RuntimeError(f"a sender failed: {run.final} {run.stderr[-500:]}")
    done = [run.last("done") for run in runs]
    sent = [int(d["sent_bytes"]) for d in done]
    return {
        "seconds": round(seconds, 2),
        "bytes": sent,
        "send_seconds": [d.get("seconds", 0) for d in done],
        "checked_s": [run.last("inventory")["verified_s"] for run in runs],
        "rate": round(sum(sent) / seconds),
    }


def _scp(hosts: Any, model: Path, world: int) -> dict[str, Any]:
    """`scp -r` of the model directory to every worker at once (the seeds' way), into the
    same private disk the shares land on."""
    from tests.support.transfer_hosts import CACHE

    target = CACHE / "scp-copy"
    started = time.monotonic()
    copies = [
        subprocess.Popen(
            [str(hosts.bin / "ssh"), f"root@{w.address}", f"mkdir -p {target}"],
            stdout=subprocess.DEVNULL,
        )
        for w in hosts.workers[: world - 1]
    ]
    for copy in copies:
        copy.wait()
    copies = [
        subprocess.Popen(
            [  # -O: the SCP protocol (the test hosts' sshd runs no SFTP subsystem)
                "scp",
                "-O",
                "-q",
                "-r",
                "-S",
                str(hosts.bin / "ssh"),
                str(model),
                f"root@{w.address}:{target}/",
            ],
        )  # fmt: skip
        for w in hosts.workers[: world - 1]
    ]
    if any(copy.wait() != 0 for copy in copies):
        raise RuntimeError("scp failed")
    seconds = time.monotonic() - started
    size = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    sent = [size] * (world - 1)
    return {"seconds": round(seconds, 2), "bytes": sent, "rate": round(sum(sent) / seconds)}


# A worker's end of the link's ceiling: accepts `streams` connections and drains them.
_DRAIN = """
import socket, sys, threading
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
def drain(conn):
    buffer = bytearray(8 << 20)
    with conn:
        while conn.recv_into(buffer):
            pass
count = int(sys.argv[1])
threads = [threading.Thread(target=drain, args=(server.accept()[0],)) for _ in range(count)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print("drained", flush=True)
"""


def _link(hosts: Any, streams: int, total: int = 2 << 30) -> dict[str, Any]:
    """The link's ceiling here: `total` bytes of plain TCP from the first host to a worker
    over `streams` connections, nothing read, hashed or written (Python at both ends, as
    the sender and receiver are)."""
    worker = hosts.workers[0]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    command = ["nsenter", "-t", str(worker.sshd.pid), "-m", "-n", sys.executable, "-c"]
    with subprocess.Popen(
        [*command, _DRAIN, str(streams)], stdout=subprocess.PIPE, text=True, env=env
    ) as drain:
        assert drain.stdout is not None
        port = int(drain.stdout.readline())
        block = bytes(8 << 20)

        def push() -> None:
            with socket.create_connection((worker.address, port)) as sock:
                for _ in range(total // streams // len(block)):
                    sock.sendall(block)

        started = time.monotonic()
        pushers = [threading.Thread(target=push) for _ in range(streams)]
        for pusher in pushers:
            pusher.start()
        for pusher in pushers:
            pusher.join()
        drain.stdout.readline()
        seconds = time.monotonic() - started
    return {"seconds": round(seconds, 2), "bytes": [total], "rate": round(total / seconds)}


# A link slower than these 2 cores can fill (tc tbf on the worker's veth), as a Thunderbolt
# link is slower than a Mac's cores: there the bytes, not the sender, set the time.
LINK_CAP = "2gbit"


def _capped(hosts: Any, model: Path, streams: int, cap: str) -> dict[str, Any]:
    """2 ranks over a link capped at `cap`: its plain TCP, a tensor share, a full copy."""
    from tests.support.transfer_hosts import limit_link

    base = {"TRANSFER_STREAMS": str(streams), "RANK_WEIGHTS": "", "PARALLELISM": "tensor"}
    rows: dict[str, Any] = {}
    limit_link(hosts.workers[0], cap)
    try:
        rows[f"link at {cap}: plain TCP"] = _link(hosts, streams, total=1 << 30)
        for name, transfer in (("share, tensor", "share"), ("full copy", "full")):
            _clear(hosts)
            env = base | {"MODEL_TRANSFER": transfer}
            rows[f"link at {cap}: 2 ranks, {name}"] = _senders(hosts, model, 2, env)
    finally:
        limit_link(hosts.workers[0], None)
    return rows


def measure(work: Path, streams: int) -> dict[str, Any]:
    from tests.support.transfer_hosts import up

    model = write_model(work / "models" / "qwen3-0.6b-shape-bf16")
    os.sync()  # a model just written is still being flushed: the first run read 50 MiB/s
    hosts = up(model.parent)
    rows: dict[str, Any] = {}
    try:
        rows["link: plain TCP to one worker"] = _link(hosts, streams)
        warm = {"TRANSFER_STREAMS": str(streams), "PARALLELISM": "pipeline"}
        _senders(hosts, model, 2, warm | {"MODEL_TRANSFER": "share"})  # untimed: first SSH
        _clear(hosts)
        for world in (2, 3):
            base = {"TRANSFER_STREAMS": str(streams), "RANK_WEIGHTS": ""}
            for name, env in (
                ("share, tensor", base | {"PARALLELISM": "tensor", "MODEL_TRANSFER": "share"}),
                ("share, pipeline", base | {"PARALLELISM": "pipeline", "MODEL_TRANSFER": "share"}),
                ("full copy", base | {"PARALLELISM": "tensor", "MODEL_TRANSFER": "full"}),
            ):
                _clear(hosts)
                rows[f"{world} ranks, {name}"] = _senders(hosts, model, world, env)
                if name == "share, tensor":
                    again = _senders(hosts, model, world, env)
                    rows[f"{world} ranks, {name}, next start"] = again
            _clear(hosts)
            rows[f"{world} ranks, full copy by scp -r"] = _scp(hosts, model, world)
        _clear(hosts)
        one = {"TRANSFER_STREAMS": "1", "PARALLELISM": "tensor", "MODEL_TRANSFER": "full"}
        rows["2 ranks, full copy, 1 stream"] = _senders(hosts, model, 2, one)
        rows |= _capped(hosts, model, streams, LINK_CAP)
    finally:
        hosts.down()
    size = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    return {"model_bytes": size, "streams": streams, "rows": rows}


def table(result: dict[str, Any]) -> list[str]:
    """A row a run: the bytes, the whole command's seconds (SSH, the check, the sending)
    and the rate over them, and the rate while the blocks moved (from the senders' own
    clocks; all workers together)."""
    lines = [
        "| run | bytes to each worker | seconds | rate | rate while sending | share check |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["rows"].items():
        sent = " / ".join(f"{b / 2**20:.0f} MiB" for b in row["bytes"])
        checked = ", ".join(f"{c:.2f} s" for c in row.get("checked_s", [])) or "-"
        sending = max(row.get("send_seconds") or [0])
        moving = f"{sum(row['bytes']) / sending / 2**20:.0f} MiB/s" if sending else "-"
        lines.append(
            f"| {name} | {sent} | {row['seconds']:.2f} | {row['rate'] / 2**20:.0f} MiB/s "
            f"| {moving} | {checked} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mlx-ring-bench-transfer"))
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the model for the next run")
    args = parser.parse_args(argv)
    result = measure(args.work, args.streams)
    print(f"model: {result['model_bytes'] / 1e9:.2f} GB; streams per worker: {args.streams}")
    print("\n".join(table(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(args.work / "models", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
