"""Relay cursors: a named, durable position in an outbox, and the lease on it.

A cursor lives in the outbox's own store (table ``flow_decision_outbox_cursor``,
outbox schema version 2), one row per relay name. The rules, the same in both
dialects:

* **acquire** -- the row is created at position 0 on first use. A caller gets
  the lease when nobody holds it, when the holder's lease expired, or when it
  already holds it (a renewal). Taking the lease from anyone else (or from
  nobody) raises ``fence`` by one: the fencing token of this tenure.
* **advance** -- ``position`` only grows, and only for the caller that names
  the current owner *and* fence; each advance renews the lease. A relay that
  stalled past its lease and was replaced gets False and stops delivering:
  the cursor never moves on behalf of two relays.
* **release** -- the holder gives the lease up (a clean shutdown), so the next
  relay of that name starts at once instead of waiting for the expiry.

Lease times are milliseconds on the store's clock: the process clock for
SQLite (one host), the database clock for PostgreSQL (many hosts).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from ..core.limits import identifier_problem
from ..errors import InvalidArgumentError
from ..store.postgres import CLOCK_SQL

__all__ = [
    "CURSOR_TABLE",
    "CursorLease",
    "CursorState",
    "LeaseHeld",
    "check_cursor_name",
    "pg_acquire",
    "pg_advance",
    "pg_cursors",
    "pg_release",
    "pg_set",
    "sqlite_acquire",
    "sqlite_advance",
    "sqlite_cursors",
    "sqlite_release",
    "sqlite_set",
]

CURSOR_TABLE = "flow_decision_outbox_cursor"
_OUTBOX = "flow_decision_outbox"
_PARKED = "flow_decision_outbox_parked"
#: The longest cursor name, in characters.
CURSOR_NAME_MAX = 200


def check_cursor_name(name: object) -> str:
    """``name`` if it can name a cursor (non-empty text, no control characters)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError(f"a relay name must be non-empty text, got {name!r}")
    problem = identifier_problem(name)
    if problem is None and len(name) > CURSOR_NAME_MAX:
        problem = f"is {len(name)} characters, over the limit of {CURSOR_NAME_MAX}"
    if problem is not None:
        raise InvalidArgumentError(f"relay name {name[:40]!r} {problem}")
    return name


@dataclass(frozen=True, slots=True)
class CursorLease:
    """The lease on cursor ``name``, held by ``owner`` with fencing token ``fence``."""

    name: str
    owner: str
    fence: int
    #: the seq of the last row delivered (deliver rows after it)
    position: int
    lease_expires_at_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "owner": self.owner,
            "fence": self.fence,
            "position": self.position,
            "lease_expires_at_ms": self.lease_expires_at_ms,
        }


@dataclass(frozen=True, slots=True)
class LeaseHeld:
    """Cursor ``name`` is leased by another, live ``owner`` until ``lease_expires_at_ms``."""

    name: str
    owner: str
    lease_expires_at_ms: int
    #: the store's clock when this was read (how long to wait: expiry - now)
    now_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "owner": self.owner,
            "lease_expires_at_ms": self.lease_expires_at_ms,
            "now_ms": self.now_ms,
        }


@dataclass(frozen=True, slots=True)
class CursorState:
    """One cursor as stored, with the outbox's head: what ``lag`` is computed from."""

    name: str
    position: int
    owner: str | None
    fence: int
    lease_expires_at_ms: int
    delivered: int
    updated_at_ms: int
    #: the outbox's newest seq (0 when empty)
    head_seq: int
    #: ``accepted_at_ms`` of the oldest row not yet delivered (None: caught up)
    oldest_pending_at_ms: int | None
    #: the store's clock when this was read
    now_ms: int
    #: rows this relay parked (its sink refused them; they wait for an operator)
    parked_rows: int = 0
    #: rows held behind a parked row of their run (delivered once it is retried or skipped)
    held_rows: int = 0
    #: when the oldest parked row was parked (None: none parked)
    oldest_parked_at_ms: int | None = None

    @property
    def parked_seconds(self) -> float:
        """Age of the oldest parked row (0 when none is parked)."""
        if self.oldest_parked_at_ms is None:
            return 0.0
        return max(self.now_ms - self.oldest_parked_at_ms, 0) / 1000

    @property
    def lag_rows(self) -> int:
        """Rows behind: newest seq - position (an upper bound where seq has gaps)."""
        return max(self.head_seq - self.position, 0)

    @property
    def lag_seconds(self) -> float:
        """Age of the oldest row not yet delivered (0 when caught up)."""
        if self.oldest_pending_at_ms is None:
            return 0.0
        return max(self.now_ms - self.oldest_pending_at_ms, 0) / 1000

    @property
    def leased(self) -> bool:
        """Someone holds a live lease on it."""
        return self.owner is not None and self.lease_expires_at_ms > self.now_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "position": self.position,
            "owner": self.owner,
            "fence": self.fence,
            "lease_expires_at_ms": self.lease_expires_at_ms,
            "leased": self.leased,
            "delivered": self.delivered,
            "updated_at_ms": self.updated_at_ms,
            "head_seq": self.head_seq,
            "lag_rows": self.lag_rows,
            "lag_seconds": round(self.lag_seconds, 3),
            "parked_rows": self.parked_rows,
            "held_rows": self.held_rows,
            "parked_seconds": round(self.parked_seconds, 3),
        }


def _decide(
    name: str, owner: str, lease_ms: int, now: int, row: Any
) -> tuple[CursorLease | LeaseHeld, bool]:
    """The acquire rule on the stored ``(position, owner, fence, expires)``;
    ``(verdict, write)``: write the lease when the verdict is a :class:`CursorLease`."""
    position, holder, fence, expires = int(row[0]), row[1], int(row[2]), int(row[3])
    if holder is not None and holder != owner and expires > now:
        return LeaseHeld(name, str(holder), expires, now), False
    if holder != owner or expires <= now:
        fence += 1  # a new tenure: whatever the previous holder still does is fenced off
    return CursorLease(name, owner, fence, position, now + lease_ms), True


# ----------------------------------------------------------------------------- SQLite


def sqlite_acquire(
    conn: sqlite3.Connection, name: str, owner: str, lease_ms: int, now: int
) -> CursorLease | LeaseHeld:
    """The acquire rule in one ``BEGIN IMMEDIATE`` transaction (the caller opens it)."""
    conn.execute(
        f"INSERT INTO {CURSOR_TABLE} (name, updated_at_ms) VALUES (?, ?) "
        "ON CONFLICT (name) DO NOTHING",
        (name, now),
    )
    row = conn.execute(
        f"SELECT position, owner, fence, lease_expires_at_ms FROM {CURSOR_TABLE} WHERE name = ?",
        (name,),
    ).fetchone()
    verdict, write = _decide(name, owner, lease_ms, now, row)
    if write:
        assert isinstance(verdict, CursorLease)
        conn.execute(
            f"UPDATE {CURSOR_TABLE} SET owner = ?, fence = ?, lease_expires_at_ms = ?, "
            "updated_at_ms = ? WHERE name = ?",
            (owner, verdict.fence, verdict.lease_expires_at_ms, now, name),
        )
    return verdict


def sqlite_advance(
    conn: sqlite3.Connection, lease: CursorLease, position: int, delivered: int, lease_ms: int,
    now: int,
) -> bool:  # fmt: skip
    """Move to ``position`` (never back) and renew; False when the lease was lost."""
    cursor = conn.execute(
        f"UPDATE {CURSOR_TABLE} SET position = max(position, ?), lease_expires_at_ms = ?, "
        "delivered = delivered + ?, updated_at_ms = ? WHERE name = ? AND owner = ? AND fence = ?",
        (position, now + lease_ms, delivered, now, lease.name, lease.owner, lease.fence),
    )
    return cursor.rowcount == 1


def sqlite_release(conn: sqlite3.Connection, lease: CursorLease, now: int) -> bool:
    """Give the lease up; False when it was not ours any more."""
    cursor = conn.execute(
        f"UPDATE {CURSOR_TABLE} SET owner = NULL, lease_expires_at_ms = 0, updated_at_ms = ? "
        "WHERE name = ? AND owner = ? AND fence = ?",
        (now, lease.name, lease.owner, lease.fence),
    )
    return cursor.rowcount == 1


def sqlite_set(conn: sqlite3.Connection, name: str, position: int, now: int) -> LeaseHeld | None:
    """Move cursor ``name`` to ``position`` (either way) unless a live lease holds it;
    the held lease when refused. Raises the fence: an earlier holder is fenced off."""
    row = conn.execute(
        f"SELECT owner, lease_expires_at_ms FROM {CURSOR_TABLE} WHERE name = ?", (name,)
    ).fetchone()
    if row is not None and row[0] is not None and int(row[1]) > now:
        return LeaseHeld(name, str(row[0]), int(row[1]), now)
    conn.execute(
        f"INSERT INTO {CURSOR_TABLE} (name, position, updated_at_ms) VALUES (?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET position = excluded.position, owner = NULL, "
        "fence = fence + 1, lease_expires_at_ms = 0, updated_at_ms = excluded.updated_at_ms",
        (name, position, now),
    )
    return None


_STATE_SQL = (
    "SELECT c.name, c.position, c.owner, c.fence, c.lease_expires_at_ms, c.delivered, "
    f"c.updated_at_ms, (SELECT coalesce(max(seq), 0) FROM {_OUTBOX}), "
    f"(SELECT o.accepted_at_ms FROM {_OUTBOX} o WHERE o.seq > c.position "
    "ORDER BY o.seq LIMIT 1), "
    f"(SELECT count(*) FROM {_PARKED} p WHERE p.relay = c.name AND p.state = 'parked'), "
    f"(SELECT count(*) FROM {_PARKED} p WHERE p.relay = c.name AND p.state = 'held'), "
    f"(SELECT min(p.parked_at_ms) FROM {_PARKED} p WHERE p.relay = c.name "
    "AND p.state = 'parked') "
    f"FROM {CURSOR_TABLE} c"
)


def _state(row: Any, now: int) -> CursorState:
    return CursorState(
        name=str(row[0]),
        position=int(row[1]),
        owner=None if row[2] is None else str(row[2]),
        fence=int(row[3]),
        lease_expires_at_ms=int(row[4]),
        delivered=int(row[5]),
        updated_at_ms=int(row[6]),
        head_seq=int(row[7]),
        oldest_pending_at_ms=None if row[8] is None else int(row[8]),
        now_ms=now,
        parked_rows=int(row[9]),
        held_rows=int(row[10]),
        oldest_parked_at_ms=None if row[11] is None else int(row[11]),
    )


def sqlite_cursors(conn: sqlite3.Connection, name: str | None, now: int) -> list[CursorState]:
    """Every cursor (or the one named), by name, with the outbox's head."""
    if name is None:
        rows = conn.execute(f"{_STATE_SQL} ORDER BY c.name").fetchall()
    else:
        rows = conn.execute(f"{_STATE_SQL} WHERE c.name = ?", (name,)).fetchall()
    return [_state(row, now) for row in rows]


# ------------------------------------------------------------------------- PostgreSQL


async def pg_acquire(conn: Any, name: str, owner: str, lease_ms: int) -> CursorLease | LeaseHeld:
    """The acquire rule in one transaction, on the database clock."""
    async with conn.transaction():
        now = int(await conn.fetchval(f"SELECT {CLOCK_SQL}"))
        await conn.execute(
            f"INSERT INTO {CURSOR_TABLE} (name, updated_at_ms) VALUES ($1, $2) "
            "ON CONFLICT (name) DO NOTHING",
            name,
            now,
        )
        row = await conn.fetchrow(
            f"SELECT position, owner, fence, lease_expires_at_ms FROM {CURSOR_TABLE} "
            "WHERE name = $1 FOR UPDATE",
            name,
        )
        verdict, write = _decide(name, owner, lease_ms, now, tuple(row))
        if write:
            assert isinstance(verdict, CursorLease)
            await conn.execute(
                f"UPDATE {CURSOR_TABLE} SET owner = $2, fence = $3, lease_expires_at_ms = $4, "
                "updated_at_ms = $5 WHERE name = $1",
                name,
                owner,
                verdict.fence,
                verdict.lease_expires_at_ms,
                now,
            )
        return verdict


async def pg_advance(
    conn: Any, lease: CursorLease, position: int, delivered: int, lease_ms: int
) -> bool:
    """Move to ``position`` (never back) and renew; False when the lease was lost."""
    status = await conn.execute(
        f"UPDATE {CURSOR_TABLE} SET position = greatest(position, $4), "
        f"lease_expires_at_ms = {CLOCK_SQL} + $5, delivered = delivered + $6, "
        f"updated_at_ms = {CLOCK_SQL} WHERE name = $1 AND owner = $2 AND fence = $3",
        lease.name,
        lease.owner,
        lease.fence,
        position,
        lease_ms,
        delivered,
    )
    return bool(status == "UPDATE 1")


async def pg_release(conn: Any, lease: CursorLease) -> bool:
    """Give the lease up; False when it was not ours any more."""
    status = await conn.execute(
        f"UPDATE {CURSOR_TABLE} SET owner = NULL, lease_expires_at_ms = 0, "
        f"updated_at_ms = {CLOCK_SQL} WHERE name = $1 AND owner = $2 AND fence = $3",
        lease.name,
        lease.owner,
        lease.fence,
    )
    return bool(status == "UPDATE 1")


async def pg_set(conn: Any, name: str, position: int) -> LeaseHeld | None:
    """:func:`sqlite_set` on PostgreSQL, on the database clock."""
    async with conn.transaction():
        now = int(await conn.fetchval(f"SELECT {CLOCK_SQL}"))
        row = await conn.fetchrow(
            f"SELECT owner, lease_expires_at_ms FROM {CURSOR_TABLE} WHERE name = $1 FOR UPDATE",
            name,
        )
        if row is not None and row[0] is not None and int(row[1]) > now:
            return LeaseHeld(name, str(row[0]), int(row[1]), now)
        await conn.execute(
            f"INSERT INTO {CURSOR_TABLE} (name, position, updated_at_ms) VALUES ($1, $2, $3) "
            "ON CONFLICT (name) DO UPDATE SET position = excluded.position, owner = NULL, "
            f"fence = {CURSOR_TABLE}.fence + 1, lease_expires_at_ms = 0, "
            "updated_at_ms = excluded.updated_at_ms",
            name,
            position,
            now,
        )
        return None


async def pg_cursors(conn: Any, name: str | None) -> list[CursorState]:
    """Every cursor (or the one named), by name, with the outbox's head."""
    now = int(await conn.fetchval(f"SELECT {CLOCK_SQL}"))
    if name is None:
        rows = await conn.fetch(f"{_STATE_SQL} ORDER BY c.name")
    else:
        rows = await conn.fetch(f"{_STATE_SQL} WHERE c.name = $1", name)
    return [_state(tuple(row), now) for row in rows]
