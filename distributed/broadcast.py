"""Rank 0 -> every rank: bytes over all_sum, where the other ranks contribute zeros.

One fixed-size buffer (a 4-byte length, then the payload) covers the common small
step plan in a single all_sum; a larger payload needs one more all_sum for the rest.
"""

from __future__ import annotations

import struct
import time

import mlx.core as mx
import numpy as np

from distributed.watchdog import CollectiveWatchdog

FIRST_BUFFER_BYTES = 4096
_all_sum = mx.distributed.all_sum  # unwrapped, even when distributed.profile is active
_LENGTH = struct.Struct("<I")


class Broadcaster:
    """Sends bytes from rank 0 to all ranks of `group`."""

    def __init__(
        self, group: mx.distributed.Group, watchdog: CollectiveWatchdog | None = None
    ) -> None:
        self.group = group
        self.watchdog = watchdog
        self.collective_seconds = 0.0
        self._zeros = np.zeros(FIRST_BUFFER_BYTES, dtype=np.uint8)

    def _all_sum(self, buffer: np.ndarray, name: str) -> np.ndarray:
        started = time.perf_counter()
        array = mx.array(buffer)
        if self.watchdog is None:
            result = _all_sum(array, group=self.group)
            mx.eval(result)
        else:
            with self.watchdog.guard(name):
                result = _all_sum(array, group=self.group)
                mx.eval(result)
        self.collective_seconds += time.perf_counter() - started
        return np.array(result, copy=False)

    def broadcast(self, payload: bytes | None, name: str = "plan broadcast") -> bytes:
        """Rank 0 passes the payload; the others pass None. Every rank gets the bytes."""
        if self.group.size() == 1:
            assert payload is not None
            return payload
        leader = self.group.rank() == 0
        capacity = FIRST_BUFFER_BYTES - _LENGTH.size
        if leader:
            assert payload is not None
            first = np.zeros(FIRST_BUFFER_BYTES, dtype=np.uint8)
            head = _LENGTH.pack(len(payload)) + payload[:capacity]
            first[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        else:
            first = self._zeros
        received = self._all_sum(first, name).tobytes()
        (length,) = _LENGTH.unpack_from(received)
        body = received[_LENGTH.size : _LENGTH.size + min(length, capacity)]
        if length <= capacity:
            return body
        rest_size = length - capacity
        if payload is not None:  # rank 0
            rest = np.frombuffer(payload[capacity:], dtype=np.uint8)
        else:
            rest = np.zeros(rest_size, dtype=np.uint8)
        return body + self._all_sum(rest, name + " (tail)").tobytes()
