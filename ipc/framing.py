"""Length-prefixed frames over a stream socket, for asyncio streams and blocking sockets."""

from __future__ import annotations

import asyncio
import socket
import struct

from pydantic import BaseModel

from ipc.protocol import HEADER_BYTES, MAX_FRAME_BYTES

_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent a frame we cannot accept (too large or truncated)."""


def encode_frame(message: BaseModel) -> bytes:
    """Serialize one message as a length-prefixed JSON frame."""
    body = message.model_dump_json(exclude_none=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def _check_length(length: int) -> None:
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds the limit of {MAX_FRAME_BYTES}")


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """Read one frame body; None at a clean end of stream."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("connection closed inside a frame header") from None
    (length,) = _HEADER.unpack(header)
    _check_length(length)
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError("connection closed inside a frame body") from None


def _recv_exactly(sock: socket.socket, count: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            if not chunks:
                return None
            raise FrameError("connection closed inside a frame")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket) -> bytes | None:
    """Blocking read of one frame body; None at a clean end of stream."""
    header = _recv_exactly(sock, HEADER_BYTES)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    _check_length(length)
    body = _recv_exactly(sock, length)
    if body is None:
        raise FrameError("connection closed before the frame body")
    return body
