"""What rank 0's socket thread hands its step loop: one type per event, dispatched by type
(leader/loop.py matches on them). The socket thread parses and answers the rest itself
(status, protocol errors, submits while loading); see ipc/server.py."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.protocol import Submit

# One client connection to rank 0's socket, numbered by the socket thread from 1; rank 0's
# own keep-warm requests use KEEP_WARM (nothing is ever sent to it).
ConnectionId = int
KEEP_WARM: ConnectionId = -1


@dataclass(frozen=True)
class Submitted:
    """A request arrived on `conn`."""

    conn: ConnectionId
    submit: Submit


@dataclass(frozen=True)
class Cancelled:
    """The client of `conn` cancelled its request `request_id`."""

    conn: ConnectionId
    request_id: str


@dataclass(frozen=True)
class Closed:
    """`conn` went away: its requests end."""

    conn: ConnectionId


@dataclass(frozen=True)
class ShutdownAsked:
    """A client or a signal asked every rank to stop."""


Event = Submitted | Cancelled | Closed | ShutdownAsked
