"""The first host's sender: one worker's share (or, MODEL_TRANSFER=full, the whole model),
over the cluster's own link. The supervisor runs one per worker before each start:

    python -m launcher.model_sender --model-dir DIR --rank R --hosts JSON --dest SSH-DEST \\
        --remote-dir DIR --address WORKER-ADDRESS

It plans the split as the ranks will (the same config, hosts, RANK_WEIGHTS and
PARALLELISM), opens one SSH session to the worker's receiver (acquisition/receive.py) for
the offer and its answer, and, when blocks are missing there, sends them in
TRANSFER_STREAMS TCP streams to the worker's cluster address, each block with its SHA-256.
It prints JSON lines on stdout, which the supervisor turns into progress (launch.sh start,
supervisor.log, status, the dashboard): `progress` every second, then one `done`,
`refused` (exit 3: the worker is short of disk) or `failed` (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from acquisition.identity import ModelIdentity, identify
from acquisition.wire import (
    ACK,
    BLOCK_BYTES,
    END_OF_STREAM,
    EXIT_REFUSED,
    FRAME,
    MAGIC,
    PROTOCOL,
    WINDOW,
    block_length,
    from_ranges,
    read_json,
    recv_exactly,
    send_json,
)
from launcher.share_source import Offer, full_offer, share_offer

RETRIES = 3  # a block whose digest fails this often at the receiver ends the transfer
CONNECT_TIMEOUT_S = 10.0
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=10"]


class Failed(RuntimeError):
    """The transfer stopped; what arrived stays on the worker for the next start."""


def emit(message: dict[str, Any]) -> None:
    send_json(sys.stdout, message)


class Streams:
    """The blocks a worker needs, produced in order here and sent by `count` threads."""

    def __init__(self, offer: Offer, need: list[tuple[int, int]], token: bytes) -> None:
        self.offer = offer
        self.need = need
        self.token = token
        self.blocks: queue.Queue[tuple[int, int, bytes] | None] = queue.Queue()
        self.lock = threading.Lock()
        self.acked = 0
        self.sent = 0
        self.resent = 0
        self.error = ""

    def fail(self, why: str) -> None:
        with self.lock:
            self.error = self.error or why

    def produce(self, count: int) -> None:
        """Read each needed block (evaluating parameters in this thread: MLX's), bounded to
        two blocks in flight per stream, then one end mark per stream."""
        limit = 2 * count
        for index, block in self.need:
            while self.blocks.qsize() >= limit and not self.error:
                time.sleep(0.002)
            if self.error:
                break
            file = self.offer.files[index]
            length = block_length(file.size, block)
            self.blocks.put((index, block, file.read(block * BLOCK_BYTES, length)))
        for _ in range(count):
            self.blocks.put(None)

    def stream(self, address: str, port: int) -> None:
        try:
            with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S) as sock:
                sock.settimeout(120.0)  # a receiver that stops answering is a failure
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(MAGIC + self.token)
                self._send_all(sock)
        except (OSError, Failed) as exc:
            self.fail(f"stream to {address}:{port}: {exc}")

    def _send_all(self, sock: socket.socket) -> None:
        outstanding: deque[tuple[int, int, bytes, int]] = deque()
        while not self.error:
            item = self.blocks.get()
            if item is None:
                break
            self._frame(sock, *item)
            outstanding.append((*item, 0))
            while len(outstanding) >= WINDOW:
                self._answer(sock, outstanding)
        while outstanding and not self.error:
            self._answer(sock, outstanding)
        sock.sendall(FRAME.pack(END_OF_STREAM, 0, 0, bytes(32)))

    def _frame(self, sock: socket.socket, index: int, block: int, data: bytes) -> None:
        digest = hashlib.sha256(data).digest()
        sock.sendall(FRAME.pack(index, block, len(data), digest))
        sock.sendall(data)
        with self.lock:
            self.sent += len(data)

    def _answer(self, sock: socket.socket, outstanding: deque[tuple[int, int, bytes, int]]) -> None:
        index, block, ok = ACK.unpack(recv_exactly(sock, ACK.size))
        first = outstanding.popleft()
        if (index, block) != first[:2]:
            raise Failed(f"answer for block {index}#{block}, expected {first[0]}#{first[1]}")
        if ok:
            with self.lock:
                self.acked += len(first[2])
            return
        if first[3] + 1 >= RETRIES:
            raise Failed(f"block {index}#{block} arrived damaged {RETRIES} times")
        with self.lock:
            self.resent += len(first[2])
        self._frame(sock, index, block, first[2])
        outstanding.append((index, block, first[2], first[3] + 1))


def _receiver_argv(dest: str, remote_dir: str, mode: str) -> list[str]:
    command = f"cd {remote_dir} && exec .venv/bin/python -m acquisition.receive {mode}".strip()
    if dest == "local":  # the receiver on this host (tests, benchmarks): no SSH
        return ["/bin/sh", "-c", command]
    return ["ssh", *SSH_OPTIONS, dest, command]


def _needed(inventory: dict[str, Any]) -> list[tuple[int, int]]:
    return [(int(index), block) for index, runs in inventory["need"] for block in from_ranges(runs)]


class Progress:
    """A `progress` line every second: bytes here, rate, time left."""

    def __init__(self, rank: int, total: int, had: int, streams: Streams) -> None:
        self.rank, self.total, self.had, self.streams = rank, total, had, streams
        self.started = time.monotonic()
        self.stop = threading.Event()

    def line(self, phase: str) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        acked = self.streams.acked
        rate = acked / elapsed
        left = self.total - self.had - acked
        return {
            "event": "progress",
            "rank": self.rank,
            "phase": phase,
            "done_bytes": self.had + acked,
            "total_bytes": self.total,
            "sent_bytes": self.streams.sent,
            "rate": round(rate),
            "eta_s": round(left / rate, 1) if rate > 0 else None,
            "elapsed_s": round(elapsed, 2),
        }

    def run(self) -> None:
        while not self.stop.wait(1.0):
            emit(self.line("sending"))


def offer_message(
    offer: Offer, identity: ModelIdentity, token: bytes, address: str
) -> dict[str, Any]:
    """The offer as the receiver reads it (acquisition/wire.py)."""
    return {
        "protocol": PROTOCOL,
        "token": token.hex(),
        "model_key": identity.key,
        "share_key": offer.share_key,
        "full_copy": identity.offer(),
        "block_size": BLOCK_BYTES,
        "files": [{"name": f.name, "size": f.size} for f in offer.files],
        "address": address,
    }


def ask_inventory(
    dest: str, remote_dir: str, offer: Offer, identity: ModelIdentity, timeout: float = 120
) -> dict[str, Any] | str:
    """What the worker holds of `offer` and its free disk, changing nothing there
    (`./launch.sh plan`); a string says why it could not tell."""
    message = offer_message(offer, identity, bytes(32), "")
    try:
        done = subprocess.run(
            _receiver_argv(dest, remote_dir, "inventory"),
            input=json.dumps(message) + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            found = json.loads(line)
            return found if found.get("event") == "inventory" else str(found.get("refused"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def transfer(args: argparse.Namespace, offer: Offer, identity: ModelIdentity) -> int:
    token = secrets.token_bytes(32)
    message = offer_message(offer, identity, token, args.address)
    base = {"rank": args.rank, "share_bytes": offer.total_bytes, "weight_bytes": offer.weight_bytes}
    with subprocess.Popen(
        _receiver_argv(args.dest, args.remote_dir, ""),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as receiver:
        assert receiver.stdin is not None and receiver.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            send_json(receiver.stdin, message)
        found = read_json(receiver.stdout)
        if found is None or found.get("event") != "inventory":
            why = (found or {}).get("refused") or _stderr(receiver)
            emit(base | {"event": "failed", "reason": f"the receiver did not answer: {why}"})
            return 1
        emit(base | {"event": "inventory"} | {k: v for k, v in found.items() if k != "need"})
        if found.get("refused"):
            emit(base | {"event": "refused", "reason": found["refused"]})
            return EXIT_REFUSED
        need = _needed(found)
        if found["have"] == "full" or (found["have"] == "share" and not need):
            emit(base | {"event": "done", "have": found["have"], "sent_bytes": 0, "seconds": 0})
            return 0
        listening = read_json(receiver.stdout) if need or found["have"] != "share" else None
        if listening is None or "port" not in listening:
            emit(
                base
                | {"event": "failed", "reason": f"no port from the receiver: {_stderr(receiver)}"}
            )
            return 1
        streams = Streams(offer, need, token)
        progress = Progress(args.rank, offer.total_bytes, int(found["have_bytes"]), streams)
        threading.Thread(target=progress.run, daemon=True).start()
        count = max(1, min(args.streams, len(need)))
        threads = [
            threading.Thread(target=streams.stream, args=(args.address, listening["port"]))
            for _ in range(count)
        ]
        for thread in threads:
            thread.start()
        streams.produce(count)
        for thread in threads:
            thread.join()
        progress.stop.set()
        last = progress.line("sent")
        if streams.error:
            receiver.stdin.close()  # the receiver keeps what arrived
            emit(base | last | {"event": "failed", "reason": streams.error})
            return 1
        send_json(receiver.stdin, {"command": "end"})
        done = read_json(receiver.stdout)
        if done is None or done.get("event") != "done":
            why = (done or {}).get("reason") or _stderr(receiver)
            emit(
                base | last | {"event": "failed", "reason": f"the receiver could not finish: {why}"}
            )
            return 1
        seconds = time.monotonic() - progress.started
        emit(
            base
            | last
            | {
                "event": "done",
                "have": found["have"],
                "seconds": round(seconds, 3),
                "resent_bytes": streams.resent,
                "streams": count,
            }
        )
        return 0


def _stderr(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.kill()
    try:
        _, err = process.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        return "no answer"
    lines = [line for line in (err or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {process.returncode}"


def build_offer(args: argparse.Namespace) -> tuple[Offer, ModelIdentity]:
    from config.settings import load_settings
    from distributed.hosts import RankHost
    from distributed.plan import make_plan, resolve_weights

    settings = load_settings()
    model_dir = Path(args.model_dir)
    identity = identify(model_dir, settings.model_cache_dir)
    if settings.model_transfer == "full":
        return full_offer(model_dir, identity), identity
    hosts = [RankHost.model_validate(host) for host in json.loads(args.hosts)]
    if not 0 < args.rank < len(hosts):
        raise ValueError(f"rank {args.rank} is not a worker of a job of {len(hosts)} ranks")
    config = json.loads((model_dir / "config.json").read_text())
    weights = resolve_weights(settings.rank_weights, hosts)
    plan = make_plan(config, len(hosts), weights, settings.parallelism, hosts)
    return share_offer(model_dir, plan, args.rank, identity), identity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.model_sender")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--hosts", required=True, help="every rank's RankHost, as JSON")
    parser.add_argument("--dest", required=True, help="SSH destination, or `local`")
    parser.add_argument("--remote-dir", required=True)
    parser.add_argument("--address", required=True, help="the worker's cluster address")
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        offer, identity = build_offer(args)
    except (OSError, ValueError) as exc:
        emit({"event": "failed", "rank": args.rank, "reason": f"cannot build the share: {exc}"})
        return 1
    emit(
        {
            "event": "offer",
            "rank": args.rank,
            "share": offer.description,
            "share_bytes": offer.total_bytes,
            "weight_bytes": offer.weight_bytes,
        }
    )
    return transfer(args, offer, identity)


if __name__ == "__main__":
    sys.exit(main())
