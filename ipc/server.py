"""Rank 0's socket server: asyncio on a background thread, events to the step loop.

The step loop owns all request state. This thread only parses frames, answers
`status` and protocol errors itself, and puts events (ipc/events.py) on a queue; replies
come back through `send`, which is safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ValidationError

from ipc.events import Cancelled, Closed, ConnectionId, Event, ShutdownAsked, Submitted
from ipc.framing import FrameError, encode_frame, read_frame
from ipc.protocol import (
    CLIENT_MESSAGE,
    PROTOCOL_VERSION,
    Cancel,
    ClientMessage,
    Error,
    ErrorCode,
    Hello,
    Shutdown,
    StatusRequest,
    Submit,
    Welcome,
)
from ipc.status import RankState, Status

log = logging.getLogger("ring.socket")


class Reporter(Protocol):
    """Who answers status: rank 0 while booting, then its leader."""

    state: RankState

    def status(self) -> Status: ...


class SocketServer:
    """Serves SOCKET_PATH (mode 0600); many requests per connection, keyed by id."""

    def __init__(self, path: Path, events: queue.Queue[Event], reporter: Reporter) -> None:
        self.path = Path(path)
        self.events = events
        self.reporter = reporter  # replaced by the leader once the model is loaded
        self._writers: dict[ConnectionId, asyncio.StreamWriter] = {}
        self._ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="socket", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------

    def _bind(self) -> socket.socket:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the file is never visible with a wider mode
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        return sock

    def start(self) -> None:
        """Bind and start serving on the background thread."""
        sock = self._bind()
        self._sock = sock
        self._thread.start()
        self._started.wait()
        log.info("listening on %s (mode 0600)", self.path)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(
            asyncio.start_unix_server(self._serve, sock=self._sock, limit=2**16)
        )
        self._started.set()
        self._loop.run_forever()

    def close(self) -> None:
        """Close every connection and remove the socket file."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._loop.call_soon_threadsafe(self._close_all)

    def _close_all(self) -> None:
        for writer in list(self._writers.values()):
            writer.close()
        self._writers.clear()

    # ---- sending -----------------------------------------------------------------

    def send(self, items: Sequence[tuple[ConnectionId, BaseModel]]) -> None:
        """Queue (connection, message) pairs for sending; any thread."""
        if items:
            self._loop.call_soon_threadsafe(self._write, list(items))

    def _write(self, items: list[tuple[ConnectionId, BaseModel]]) -> None:
        for conn, message in items:
            writer = self._writers.get(conn)
            if writer is not None and not writer.is_closing():
                writer.write(encode_frame(message))

    # ---- one connection ----------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(self._ids)
        try:
            if await self._handshake(conn, reader, writer):
                self._writers[conn] = writer
                await self._loop_frames(conn, reader, writer)
        except (ConnectionError, OSError):
            pass
        finally:
            if self._writers.pop(conn, None) is not None:
                self.events.put(Closed(conn))
            writer.close()

    async def _reject(self, writer: asyncio.StreamWriter, code: ErrorCode, message: str) -> None:
        log.warning("closing a client connection: %s", message)
        writer.write(encode_frame(Error(code=code, message=message)))
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> ClientMessage | Literal[False] | None:
        """The next message, None at end of stream, False after a rejected frame."""
        try:
            body = await read_frame(reader)
            if body is None:
                return None
            return CLIENT_MESSAGE.validate_json(body)
        except FrameError as exc:
            await self._reject(writer, "bad_frame", f"bad frame: {exc}")
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "message"
            message = f"not a valid message: {where}: {first['msg']}"
            await self._reject(writer, "bad_frame", message)
        return False

    async def _handshake(
        self, conn: ConnectionId, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        message = await self._read(reader, writer)
        if not message:
            return False
        if not isinstance(message, Hello):
            await self._reject(writer, "bad_frame", "the first frame must be a hello message")
            return False
        if message.protocol_version != PROTOCOL_VERSION:
            text = (
                f"protocol version {message.protocol_version} is not supported; "
                f"this server speaks version {PROTOCOL_VERSION}"
            )
            await self._reject(writer, "protocol_version", text)
            return False
        status = self.reporter.status()
        welcome = Welcome(
            protocol_version=PROTOCOL_VERSION,
            model_id=status.model_id,
            model_aliases=status.model_aliases,
        )
        writer.write(encode_frame(welcome))
        await writer.drain()
        return True

    async def _loop_frames(
        self, conn: ConnectionId, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            message = await self._read(reader, writer)
            if not message:
                return
            if isinstance(message, StatusRequest):
                writer.write(encode_frame(self.reporter.status()))
            elif isinstance(message, Submit):
                refusal = _refusal(self.reporter.state, message.id)
                if refusal is not None:
                    writer.write(encode_frame(refusal))
                else:
                    self.events.put(Submitted(conn, message))
            elif isinstance(message, Cancel):
                self.events.put(Cancelled(conn, message.id))
            elif isinstance(message, Shutdown):
                self.events.put(ShutdownAsked())
            elif isinstance(message, Hello):
                await self._reject(writer, "bad_frame", "hello was already received")
                return
            await writer.drain()


def _refusal(state: RankState, request_id: str) -> Error | None:
    """The error for a submit rank 0 cannot take in `state`, or None when it can."""
    if state == RankState.READY:
        return None
    if state == RankState.LOADING:
        text = "the model is still loading; retry when status says ready"
        return Error(id=request_id, code="loading", message=text)
    if state == RankState.WARMING:
        text = "the ranks are warming up (their first forwards); retry when status says ready"
        return Error(id=request_id, code="loading", message=text)
    return Error(id=request_id, code="shutting_down", message=f"the server is {state}")
