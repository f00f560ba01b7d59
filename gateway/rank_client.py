"""The API's one persistent connection to rank 0's Unix socket.

Requests are multiplexed by id: each submitted request gets its own queue, fed by one
reader task. A poller asks for Status every `status_interval` seconds; the answer is
cached for /health, /model/info, /cluster/status and the metrics. When the socket is
down the client reconnects with backoff; a dropped connection ends every in-flight
request with `ConnectionLost`. Under launch.sh's supervisor, its state file adds what the
supervisor is doing (restarting, gave up, degraded) to the availability.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from gateway.availability import (
    Availability,
    availability,
    from_rank_state,
    supervised,
    waits_for_restart,
)
from ipc.framing import FrameError, encode_frame, read_frame
from ipc.protocol import (
    PROTOCOL_VERSION,
    SERVER_MESSAGE,
    Cancel,
    Delta,
    Done,
    Error,
    Hello,
    ServerMessage,
    Started,
    StatusRequest,
    Submit,
    Welcome,
)
from ipc.status import RankState, Status
from ipc.supervisor_state import StateReader

log = logging.getLogger("ring.api.rank_client")

HANDSHAKE_TIMEOUT_S = 5.0
BACKOFF_MIN_S = 0.2
# At most this long between the ranks being back and the API noticing: it bounds the
# recovery time after a restart (a connect to a missing socket costs nothing).
BACKOFF_MAX_S = 1.0
RESTART_POLL_S = 0.1  # how often a request waiting for a restart looks again


@dataclass
class ConnectionLost:
    """Put on a request's queue when the connection to rank 0 ends before its Done."""

    reason: str


# What a request's queue carries: rank 0's messages for it, or the end of the connection.
RequestEvent = Started | Delta | Done | Error | ConnectionLost


class RanksUnavailable(Exception):
    """The ranks cannot take a request now; `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class RankClient:
    """Asyncio client of rank 0. Call `start()` inside the event loop, `close()` at the end."""

    def __init__(
        self,
        socket_path: Path,
        *,
        status_interval: float = 1.0,
        stale_after: float = 10.0,
        supervisor: StateReader | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.supervisor = supervisor
        self.status_interval = status_interval
        self.stale_after = stale_after
        self._writer: asyncio.StreamWriter | None = None
        self._write_lock = asyncio.Lock()
        self._streams: dict[str, asyncio.Queue[RequestEvent]] = {}
        self._status_waiters: list[asyncio.Future[Status]] = []
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.status: Status | None = None
        self.status_at = 0.0
        self.model_id: str | None = None
        self.model_aliases: list[str] = []
        self.down_reason = "not connected to rank 0 yet"
        self.on_status: Callable[[Status], None] | None = None  # every status rank 0 sends

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the connect/reconnect loop in the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rank-client")

    async def close(self) -> None:
        """Stop reconnecting, close the connection and end every in-flight request."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._drop_connection("the API is shutting down")

    @property
    def connected(self) -> bool:
        return self._writer is not None

    def availability(self) -> Availability:
        """The cluster's state as the API sees it (gateway.availability's table)."""
        now = self._ranks_availability()
        return supervised(now, self.supervisor.read() if self.supervisor else None)

    async def wait_for_restart(self, timeout: float) -> None:
        """While the supervisor restarts the ranks, wait up to `timeout` s for them."""
        deadline = time.monotonic() + timeout
        while waits_for_restart(self.availability()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            await asyncio.sleep(min(RESTART_POLL_S, remaining))

    def _ranks_availability(self) -> Availability:
        if not self.connected:
            return availability("down", self.down_reason)
        status = self.status
        if status is None:
            return availability("connecting", "connected to rank 0; waiting for its first status")
        if status.state == RankState.LOADING:
            model = status.model_id or "the default model"
            return availability("loading", f"the ranks are loading the model {model}")
        if status.state != RankState.READY:
            why = f": {status.reason}" if status.reason else ""
            return from_rank_state(status.state, f"the ranks are {status.state}{why}")
        age = time.monotonic() - self.status_at
        if age > self.stale_after:
            reason = f"rank 0 has not answered a status request for {age:.0f} s"
            return availability("stale", reason)
        return availability("ready", "the ranks are serving")

    # ---- requests --------------------------------------------------------------------

    async def submit(self, request: Submit) -> asyncio.Queue[RequestEvent]:
        """Send a request to rank 0; its Started/Delta/Done/Error arrive on the queue."""
        now = self.availability()
        if not now.takes_requests:
            raise RanksUnavailable(now.reason, now.retry_after or 2)
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._streams[request.id] = queue
        try:
            await self._send(request)
        except (OSError, RuntimeError) as exc:
            self._streams.pop(request.id, None)
            raise RanksUnavailable(f"could not send the request to rank 0 ({exc})") from None
        return queue

    def release(self, request_id: str, *, cancel: bool) -> None:
        """Forget a request; with `cancel`, tell rank 0 to drop it (never blocks)."""
        self._streams.pop(request_id, None)
        if cancel and self.connected:
            task = asyncio.get_running_loop().create_task(self._send_quietly(Cancel(id=request_id)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def fetch_status(self, timeout: float = 2.0) -> Status | None:
        """A fresh Status from rank 0, or the cached one if rank 0 does not answer in time."""
        if not self.connected:
            return self.status
        waiter: asyncio.Future[Status] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        try:
            await self._send(StatusRequest())
            return await asyncio.wait_for(waiter, timeout)
        except (TimeoutError, OSError, RuntimeError):
            return self.status
        finally:
            if waiter in self._status_waiters:
                self._status_waiters.remove(waiter)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # ---- connection ------------------------------------------------------------------

    async def _send(self, message: BaseModel) -> None:
        writer = self._writer
        if writer is None:
            raise RuntimeError("not connected to rank 0")
        async with self._write_lock:
            writer.write(encode_frame(message))
            await writer.drain()

    async def _send_quietly(self, message: BaseModel) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            await self._send(message)

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        was_up = True  # log the first failure
        while True:
            try:
                await self._session()
                backoff = BACKOFF_MIN_S
                was_up = True
            except (OSError, FrameError, TimeoutError, ValueError) as exc:
                reason = self._describe_failure(exc)
                if was_up or reason != self.down_reason:
                    log.warning("rank 0 unreachable: %s; retrying", reason)
                was_up = False
                self.down_reason = reason
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _describe_failure(self, exc: BaseException) -> str:
        path = self.socket_path
        if isinstance(exc, FileNotFoundError):
            return f"rank 0's socket {path} does not exist: the ranks are not running"
        if isinstance(exc, ConnectionRefusedError):
            return f"nothing listens on {path}: the ranks are not running"
        if isinstance(exc, TimeoutError):
            return f"rank 0 did not answer the handshake on {path} in {HANDSHAKE_TIMEOUT_S:.0f} s"
        return f"cannot talk to rank 0 on {path} ({exc})"

    async def _session(self) -> None:
        reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        try:
            writer.write(encode_frame(Hello(protocol_version=PROTOCOL_VERSION)))
            await writer.drain()
            welcome = await asyncio.wait_for(self._read(reader), HANDSHAKE_TIMEOUT_S)
            if isinstance(welcome, Error):
                raise ValueError(f"rank 0 refused the connection: {welcome.message}")
            if welcome is None:
                raise ValueError("rank 0 closed the connection during the handshake")
            if not isinstance(welcome, Welcome):
                raise ValueError(f"rank 0 answered the handshake with {type(welcome).__name__}")
            self.model_id = welcome.model_id
            self.model_aliases = welcome.model_aliases
            # A status from before the reconnect may say ready while rank 0 (restarted)
            # still loads: none until rank 0 answers ("connecting" meanwhile).
            self.status = None
            self._writer = writer
            log.info("connected to rank 0 on %s (model %s)", self.socket_path, welcome.model_id)
            poller = asyncio.create_task(self._poll_status())
            try:
                reason = await self._read_loop(reader)
            finally:
                poller.cancel()
            self.down_reason = f"lost the connection to rank 0: {reason}"
            log.warning("%s", self.down_reason)
        finally:
            self._drop_connection(self.down_reason, writer)

    async def _read(self, reader: asyncio.StreamReader) -> ServerMessage | None:
        body = await read_frame(reader)
        if body is None:
            return None
        return SERVER_MESSAGE.validate_json(body)

    async def _read_loop(self, reader: asyncio.StreamReader) -> str:
        """Dispatch frames until the connection ends; returns why it ended."""
        while True:
            try:
                message = await self._read(reader)
            except (FrameError, OSError) as exc:
                return str(exc)
            except ValidationError as exc:
                count = exc.error_count()
                return f"rank 0 sent a message this API does not understand ({count} errors)"
            if message is None:
                return "rank 0 closed the socket (the ranks stopped)"
            self._dispatch(message)

    def _dispatch(self, message: ServerMessage) -> None:
        if isinstance(message, Status):
            self.status = message
            self.status_at = time.monotonic()
            self.model_id = message.model_id
            self.model_aliases = message.model_aliases
            if self.on_status is not None:
                self.on_status(message)
            for waiter in self._status_waiters:
                if not waiter.done():
                    waiter.set_result(message)
            self._status_waiters.clear()
            return
        if isinstance(message, Welcome):
            return
        if message.id is None:
            assert isinstance(message, Error)
            log.warning("rank 0 connection error %s: %s", message.code, message.message)
            return
        queue = self._streams.get(message.id)
        if queue is None:
            return  # a request we already gave up on
        queue.put_nowait(message)
        if message.type in ("done", "error"):
            self._streams.pop(message.id, None)

    async def _poll_status(self) -> None:
        while True:
            with contextlib.suppress(OSError, RuntimeError):
                await self._send(StatusRequest())
            await asyncio.sleep(self.status_interval)

    def _drop_connection(self, reason: str, writer: asyncio.StreamWriter | None = None) -> None:
        writer = writer or self._writer
        self._writer = None
        if writer is not None:
            writer.close()
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(ConnectionLost(reason))
        for waiter in self._status_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionError(reason))
        self._status_waiters.clear()
