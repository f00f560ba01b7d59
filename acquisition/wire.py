"""The transfer's wire format, shared by the first host's sender (launcher/model_sender.py) and
a worker's receiver (acquisition/receive.py). Standard library only.

Control runs over the one SSH session the sender opens to the worker, as JSON lines: the
offer goes to the receiver's stdin, its inventory, `listening` (a port on the worker's
cluster address), and its final `done` or `refused` come back on its stdout; {"command":
"end"} on stdin asks it to finish the files. The bytes run over the cluster's own link, in
TRANSFER_STREAMS TCP connections from the sender to that port, each opened with MAGIC and
the offer's token. A frame is a block of one file: FRAME (file index, block index, length,
SHA-256 of the data) and the data; the receiver answers each with ACK (file, block, 1 when
the data matched its digest and is written, 0 when it did not: the sender sends it again).
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable
from typing import IO, Any

PROTOCOL = 1
MAGIC = b"MLXRSHR1"
TOKEN_BYTES = 32
BLOCK_BYTES = 8 << 20  # the unit of sending, checking, resuming and resending
FRAME = struct.Struct("<IIQ32s")  # file index, block index, data length, sha256
ACK = struct.Struct("<IIB")
END_OF_STREAM = 0xFFFFFFFF
WINDOW = 2  # frames a stream sends before it waits for the oldest one's answer
EXIT_REFUSED = 3  # the receiver refused (no room): starting again would not help

Ranges = list[list[int]]  # [[first block, end block), ...]


def blocks_of(size: int, block: int = BLOCK_BYTES) -> int:
    return max(1, -(-size // block)) if size else 0


def block_length(size: int, index: int, block: int = BLOCK_BYTES) -> int:
    return min(block, size - index * block)


def to_ranges(indices: Iterable[int]) -> Ranges:
    """Sorted block indices as [start, end) runs (an offer of a whole file is one run)."""
    runs: Ranges = []
    for index in sorted(indices):
        if runs and runs[-1][1] == index:
            runs[-1][1] += 1
        else:
            runs.append([index, index + 1])
    return runs


def from_ranges(runs: Ranges) -> list[int]:
    return [index for start, end in runs for index in range(start, end)]


def send_json(stream: IO[str], message: dict[str, Any]) -> None:
    stream.write(json.dumps(message, separators=(",", ":")) + "\n")
    stream.flush()


def read_json(stream: IO[str]) -> dict[str, Any] | None:
    """The next JSON line; None at the end of the stream. Lines that are not JSON (a
    login banner, a warning) are skipped."""
    while True:
        line = stream.readline()
        if not line:
            return None
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value


def recv_exactly(sock: socket.socket, count: int) -> bytes:
    """`count` bytes, or ConnectionError when the peer closes first."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:], count - got)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {count} bytes")
        got += n
    return bytes(buffer)


def recv_into_exactly(sock: socket.socket, buffer: memoryview) -> None:
    got, count = 0, len(buffer)
    while got < count:
        n = sock.recv_into(buffer[got:], count - got)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {count} bytes")
        got += n
