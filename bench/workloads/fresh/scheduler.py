"""Bookings for the climbing gym's walls: slots, capacity, waiting lists and reminders."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

SLOT_MINUTES = 90
DEFAULT_CAPACITY = 12


@dataclass
class Member:
    name: str
    email: str
    belayer: bool = False


@dataclass
class Slot:
    wall: str
    starts: datetime
    capacity: int = DEFAULT_CAPACITY
    booked: list[Member] = field(default_factory=list)
    waiting: list[Member] = field(default_factory=list)

    @property
    def ends(self) -> datetime:
        return self.starts + timedelta(minutes=SLOT_MINUTES)

    def free(self) -> int:
        return self.capacity - len(self.booked)

    def has_belayer(self) -> bool:
        return any(member.belayer for member in self.booked)


class BookingError(Exception):
    pass


def book(slot: Slot, member: Member) -> str:
    """Books `member` into `slot`, or onto its waiting list when it is full."""
    if member in slot.booked:
        raise BookingError(f"{member.name} is already booked at {slot.starts:%H:%M}")
    if slot.free() > 0:
        slot.booked.append(member)
        return "booked"
    if member not in slot.waiting:
        slot.waiting.append(member)
    return "waiting"


def cancel(slot: Slot, member: Member) -> Member | None:
    """Cancels a booking; the first member waiting takes the place and is returned."""
    if member in slot.waiting:
        slot.waiting.remove(member)
        return None
    if member not in slot.booked:
        raise BookingError(f"{member.name} has no booking at {slot.starts:%H:%M}")
    slot.booked.remove(member)
    if slot.waiting:
        promoted = slot.waiting.pop(0)
        slot.booked.append(promoted)
        return promoted
    return None


def day_slots(wall: str, day: datetime, opens: int = 10, closes: int = 22) -> list[Slot]:
    """The day's slots on one wall, back to back from opening to closing time."""
    slots = []
    start = day.replace(hour=opens, minute=0, second=0, microsecond=0)
    end = day.replace(hour=closes, minute=0, second=0, microsecond=0)
    while start + timedelta(minutes=SLOT_MINUTES) <= end:
        slots.append(Slot(wall, start))
        start += timedelta(minutes=SLOT_MINUTES)
    return slots


def reminders(slots: list[Slot], now: datetime) -> list[tuple[str, str]]:
    """(email, text) for every member booked into a slot starting within two hours."""
    out = []
    for slot in slots:
        if now <= slot.starts <= now + timedelta(hours=2):
            for member in slot.booked:
                text = f"Hi {member.name}, your {slot.wall} session starts at {slot.starts:%H:%M}."
                out.append((member.email, text))
    return out


def without_belayer(slots: list[Slot]) -> list[Slot]:
    """Slots with climbers booked but nobody able to belay them."""
    return [slot for slot in slots if slot.booked and not slot.has_belayer()]
