"""A small blocking client for rank 0's socket, for tests and launch.sh.

python -m ipc.client status [--socket PATH]        print the Status JSON (exit 1: down)
python -m ipc.client wait-ready --timeout S         exit 0 once state is ready
python -m ipc.client shutdown                       ask every rank to stop
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from ipc.framing import encode_frame, recv_frame
from ipc.protocol import (
    PROTOCOL_VERSION,
    SERVER_MESSAGE,
    Error,
    Hello,
    ServerMessage,
    Shutdown,
    StatusRequest,
    Welcome,
)
from ipc.status import Status


class ClientError(Exception):
    """Rank 0 cannot be reached or answered with something unexpected."""


class RankClient:
    """One connection to rank 0 (hello done on open)."""

    def __init__(self, path: str | Path, timeout: float | None = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise ClientError(
                f"cannot connect to rank 0 at {path}: {exc.strerror or exc}"
            ) from None
        self.send(Hello(protocol_version=PROTOCOL_VERSION, client="ipc.client"))
        welcome = self.recv()
        if not isinstance(welcome, Welcome):
            self.close()
            raise ClientError(f"rank 0 refused the connection: {welcome}")
        self.welcome = welcome

    def send(self, message: BaseModel) -> None:
        self.sock.sendall(encode_frame(message))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> ServerMessage | None:
        """The next server message; None when rank 0 closed the connection."""
        body = recv_frame(self.sock)
        return None if body is None else SERVER_MESSAGE.validate_json(body)

    def status(self) -> Status:
        self.send(StatusRequest())
        while True:
            reply = self.recv()
            if isinstance(reply, Status):
                return reply
            if reply is None or isinstance(reply, Error):
                raise ClientError(f"no status from rank 0: {reply}")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RankClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_status(path: str | Path, timeout: float = 5.0) -> Status:
    with RankClient(path, timeout) as client:
        return client.status()


def wait_ready(path: str | Path, timeout: float) -> Status:
    """Poll until state is ready; ClientError with the last problem at the deadline."""
    deadline = time.monotonic() + timeout
    problem = "no answer yet"
    while time.monotonic() < deadline:
        try:
            status = get_status(path)
            if status.state == "ready":
                return status
            problem = f"state is {status.state}"
        except (ClientError, OSError, ValueError) as exc:
            problem = str(exc)
        time.sleep(0.2)
    raise ClientError(f"rank 0 not ready after {timeout:.0f} s: {problem}")


def main(argv: list[str] | None = None) -> int:
    description = "Talk to rank 0 over its Unix socket."
    parser = argparse.ArgumentParser(prog="python -m ipc.client", description=description)
    parser.add_argument("command", choices=["status", "wait-ready", "shutdown"])
    parser.add_argument("--socket", type=Path, default=None, help="default: SOCKET_PATH")
    parser.add_argument("--timeout", type=float, default=60.0, help="wait-ready deadline (s)")
    args = parser.parse_args(argv)
    if args.socket is None:
        from config.settings import SettingsError, load_settings

        try:
            args.socket = load_settings().socket_path
        except SettingsError as exc:
            print(exc, file=sys.stderr)
            return 2
    path = args.socket
    try:
        if args.command == "status":
            print(get_status(path).model_dump_json(indent=2))
        elif args.command == "wait-ready":
            status = wait_ready(path, args.timeout)
            print(f"ready: {status.model_id} on {status.world_size} rank(s)")
        else:
            with RankClient(path) as client:
                client.send(Shutdown())
                client.recv()  # returns when rank 0 closes the connection
            print("shutdown requested")
    except (ClientError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
