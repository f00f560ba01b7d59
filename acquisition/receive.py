"""A worker's receiver, run by the first host's sender over SSH in the worker's REMOTE_DIR:

    python -m acquisition.receive              # one transfer (acquisition/wire.py)
    python -m acquisition.receive inventory    # `./launch.sh plan`: only say what is here

It reads the offer from stdin, answers with its inventory (acquisition/inventory.py: a full
copy found, or which blocks of the share it still needs, checked against the disk), then
listens on the worker's cluster address for the sender's streams. Each block is hashed
before it is written (os.pwrite at its offset in NAME.part) and recorded in the file's
journal only then, so a transfer cut at any point resumes with the blocks that arrived.
On the sender's `end` every file is synced and renamed into place and the record
(share.json: every block's SHA-256) written last. One receiver at a time per model: a
lock file in its directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from acquisition import received
from acquisition.inventory import JOURNAL, Inventory, inventory
from acquisition.wire import (
    ACK,
    END_OF_STREAM,
    EXIT_REFUSED,
    FRAME,
    MAGIC,
    PROTOCOL,
    TOKEN_BYTES,
    block_length,
    read_json,
    recv_exactly,
    recv_into_exactly,
    send_json,
)

ACCEPT_TIMEOUT_S = 60.0  # the sender connects at once; a stream that never comes is a failure


class Session:
    """One offer's files on this host: open partial files, their journals, what arrived."""

    def __init__(self, offer: dict[str, Any], found: Inventory) -> None:
        self.offer = offer
        self.found = found
        self.directory = found.directory
        self.block = int(offer["block_size"])
        self.token = bytes.fromhex(offer["token"])
        self.wanted = {
            (index, block) for index, state in enumerate(found.files) for block in state.missing()
        }
        self.lock = threading.Lock()
        self.fds: dict[int, int] = {}
        self.journals: dict[int, Any] = {}
        self.received = 0
        self.errors: list[str] = []

    def _fd(self, index: int) -> int:
        if index not in self.fds:
            name = self.found.files[index].name
            path = self.directory / f"{name}.part"
            self.fds[index] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(self.fds[index], self.found.files[index].size)
            self.journals[index] = open(self.directory / f"{name}.part{JOURNAL}", "a")  # noqa: SIM115
        return self.fds[index]

    def _length(self, index: int, block: int) -> int:
        return block_length(self.found.files[index].size, block, self.block)

    def close(self) -> None:
        """Leave what arrived for the next start (a cut-off transfer)."""
        for journal in self.journals.values():
            journal.close()
        for fd in self.fds.values():
            os.close(fd)
        self.journals, self.fds = {}, {}

    def write(self, index: int, block: int, data: memoryview, digest: str) -> None:
        with self.lock:
            fd = self._fd(index)
        os.pwrite(fd, data, block * self.block)
        with self.lock:
            journal = self.journals[index]
            journal.write(f"{block} {digest}\n")
            journal.flush()
            self.found.files[index].good[block] = digest
            self.wanted.discard((index, block))
            self.received += len(data)

    def serve(self, conn: socket.socket) -> None:
        """One stream: check its token, then write every frame whose data matches."""
        try:
            hello = recv_exactly(conn, len(MAGIC) + TOKEN_BYTES)
            if hello[: len(MAGIC)] != MAGIC or not hmac.compare_digest(
                hello[len(MAGIC) :], self.token
            ):
                return  # not our sender
            buffer = bytearray(self.block)
            while True:
                index, block, length, digest = FRAME.unpack(recv_exactly(conn, FRAME.size))
                if index == END_OF_STREAM:
                    return
                if (index, block) not in self.wanted or length != self._length(index, block):
                    raise ConnectionError(f"frame {index}#{block} ({length} B) was not asked for")
                view = memoryview(buffer)[:length]
                recv_into_exactly(conn, view)
                ok = hashlib.sha256(view).digest() == digest
                if ok:
                    self.write(index, block, view, digest.hex())
                conn.sendall(ACK.pack(index, block, 1 if ok else 0))
        except (ConnectionError, OSError) as exc:
            with self.lock:
                self.errors.append(str(exc))
        finally:
            conn.close()

    def finish(self) -> dict[str, Any]:
        """Sync every file, move it into place and write the record; the `done` message."""
        for journal in self.journals.values():
            journal.close()
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        missing = [f"{self.found.files[i].name}#{b}" for i, b in sorted(self.wanted)]
        if missing:
            return {"event": "failed", "reason": f"blocks never arrived: {', '.join(missing[:5])}"}
        files = {}
        for state in self.found.files:
            part, final = self.directory / f"{state.name}.part", self.directory / state.name
            if part.is_file():
                os.replace(part, final)
            files[state.name] = {
                "size": state.size,
                "blocks": [d for _, d in sorted(state.good.items())],
            }
        record = {"share_key": self.offer["share_key"], "model_key": self.offer["model_key"]}
        received.write_json(self.directory / received.RECORD, record | {"files": files})
        for state in self.found.files:
            (self.directory / f"{state.name}.part{JOURNAL}").unlink(missing_ok=True)
        if self.offer["share_key"] == received.FULL_DIR:
            pointer = self.directory.parent / received.FULL_POINTER
            received.write_json(pointer, {"path": str(self.directory)})
        _sync_dir(self.directory)
        return {"event": "done", "received_bytes": self.received, "directory": str(self.directory)}


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listen(address: str, session: Session) -> tuple[socket.socket, list[threading.Thread]]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.bind((address, 0))
    server.listen(64)
    threads: list[threading.Thread] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the session ends
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=session.serve, args=(conn,), daemon=True)
            threads.append(thread)
            thread.start()

    threading.Thread(target=accept, daemon=True).start()
    return server, threads


def receive(offer: dict[str, Any], cache_dir: Path) -> int:
    """One transfer; the exit status (0 done, 1 cut off or failed, 3 refused)."""
    model = received.model_dir(cache_dir, offer["model_key"])
    model.mkdir(parents=True, exist_ok=True)
    with open(model / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = inventory(offer, cache_dir, change=True)
        send_json(sys.stdout, found.message())
        if found.refused:
            return EXIT_REFUSED
        if found.have == "full" or (found.have == "share" and not found.need_bytes):
            return 0
        found.directory.mkdir(parents=True, exist_ok=True)
        session = Session(offer, found)
        server, threads = _listen(offer["address"], session)
        send_json(sys.stdout, {"event": "listening", "port": server.getsockname()[1]})
        command = read_json(sys.stdin)  # {"command": "end"}, or None when the sender is gone
        server.close()
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        for thread in list(threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        if command is None or command.get("command") != "end":
            session.close()
            return 1  # cut off: what arrived stays for the next start
        done = session.finish()
        send_json(sys.stdout, done)
        return 0 if done["event"] == "done" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from config.settings import SettingsError, load_settings

    try:
        cache_dir = load_settings().model_cache_dir.expanduser()
    except SettingsError as exc:
        send_json(sys.stdout, {"event": "refused", "refused": f"bad settings here: {exc}"})
        return 2
    offer = read_json(sys.stdin)
    if offer is None or offer.get("protocol") != PROTOCOL:
        version = None if offer is None else offer.get("protocol")
        reason = f"offer of protocol {version}, this receiver speaks {PROTOCOL}: sync the code"
        send_json(sys.stdout, {"event": "refused", "refused": reason})
        return 2
    if argv[:1] == ["inventory"]:
        send_json(sys.stdout, inventory(offer, cache_dir, change=False).message())
        return 0
    return receive(offer, cache_dir)


if __name__ == "__main__":
    sys.exit(main())
