"""Stock levels for a small warehouse, kept in SQLite, with reservations that expire."""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    sku TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    on_hand INTEGER NOT NULL DEFAULT 0,
    reorder_at INTEGER NOT NULL DEFAULT 10
);
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sku TEXT NOT NULL REFERENCES items(sku),
    quantity INTEGER NOT NULL,
    expires_at REAL NOT NULL
);
"""


class StockError(Exception):
    """A request the stock cannot honour."""


@dataclass
class Item:
    sku: str
    name: str
    on_hand: int
    reorder_at: int

    @property
    def needs_reorder(self) -> bool:
        return self.on_hand <= self.reorder_at


class Inventory:
    """Thread-safe access to the stock database."""

    def __init__(self, path: Path, reservation_seconds: float = 900.0) -> None:
        self.path = path
        self.reservation_seconds = reservation_seconds
        self._lock = threading.Lock()
        with self._connect() as db:
            db.executescript(SCHEMA)

    @contextmanager
    def _connect(self):
        db = sqlite3.connect(self.path)
        db.row_factory = sqlite3.Row
        try:
            yield db
            db.commit()
        finally:
            db.close()

    def add_item(self, sku: str, name: str, on_hand: int = 0, reorder_at: int = 10) -> Item:
        if on_hand < 0:
            raise StockError(f"on_hand must not be negative, got {on_hand}")
        with self._lock, self._connect() as db:
            db.execute(
                "INSERT INTO items (sku, name, on_hand, reorder_at) VALUES (?, ?, ?, ?)",
                (sku, name, on_hand, reorder_at),
            )
        return Item(sku, name, on_hand, reorder_at)

    def get(self, sku: str) -> Item:
        with self._connect() as db:
            row = db.execute("SELECT * FROM items WHERE sku = ?", (sku,)).fetchone()
        if row is None:
            raise StockError(f"unknown sku {sku!r}")
        return Item(row["sku"], row["name"], row["on_hand"], row["reorder_at"])

    def receive(self, sku: str, quantity: int) -> Item:
        """Goods arrived: add them to the stock on hand."""
        if quantity <= 0:
            raise StockError(f"quantity must be positive, got {quantity}")
        with self._lock, self._connect() as db:
            updated = db.execute(
                "UPDATE items SET on_hand = on_hand + ? WHERE sku = ?", (quantity, sku)
            ).rowcount
        if not updated:
            raise StockError(f"unknown sku {sku!r}")
        return self.get(sku)

    def available(self, sku: str) -> int:
        """Stock on hand less what live reservations hold."""
        now = time.time()
        with self._connect() as db:
            on_hand = db.execute("SELECT on_hand FROM items WHERE sku = ?", (sku,)).fetchone()
            if on_hand is None:
                raise StockError(f"unknown sku {sku!r}")
            held = db.execute(
                "SELECT COALESCE(SUM(quantity), 0) FROM reservations "
                "WHERE sku = ? AND expires_at > ?",
                (sku, now),
            ).fetchone()[0]
        return on_hand[0] - held

    def reserve(self, sku: str, quantity: int) -> int:
        """Hold `quantity` for a checkout; returns the reservation id."""
        if quantity <= 0:
            raise StockError(f"quantity must be positive, got {quantity}")
        with self._lock:
            if self.available(sku) < quantity:
                raise StockError(f"only {self.available(sku)} of {sku} available")
            expires = time.time() + self.reservation_seconds
            with self._connect() as db:
                cursor = db.execute(
                    "INSERT INTO reservations (sku, quantity, expires_at) VALUES (?, ?, ?)",
                    (sku, quantity, expires),
                )
                return int(cursor.lastrowid)

    def commit(self, reservation_id: int) -> None:
        """The checkout paid: take the reserved goods out of stock."""
        with self._lock, self._connect() as db:
            row = db.execute(
                "SELECT sku, quantity, expires_at FROM reservations WHERE id = ?",
                (reservation_id,),
            ).fetchone()
            if row is None:
                raise StockError(f"no reservation {reservation_id}")
            if row["expires_at"] < time.time():
                raise StockError(f"reservation {reservation_id} expired")
            db.execute(
                "UPDATE items SET on_hand = on_hand - ? WHERE sku = ?",
                (row["quantity"], row["sku"]),
            )
            db.execute("DELETE FROM reservations WHERE id = ?", (reservation_id,))

    def release(self, reservation_id: int) -> None:
        """The checkout was abandoned: free what it held."""
        with self._lock, self._connect() as db:
            db.execute("DELETE FROM reservations WHERE id = ?", (reservation_id,))

    def expire(self) -> int:
        """Drop reservations past their time; returns how many went."""
        with self._lock, self._connect() as db:
            return db.execute(
                "DELETE FROM reservations WHERE expires_at <= ?", (time.time(),)
            ).rowcount

    def reorder_report(self) -> list[Item]:
        """Items at or below their reorder level, lowest stock first."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT * FROM items WHERE on_hand <= reorder_at ORDER BY on_hand"
            ).fetchall()
        return [Item(r["sku"], r["name"], r["on_hand"], r["reorder_at"]) for r in rows]
