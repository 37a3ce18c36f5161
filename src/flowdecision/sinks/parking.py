"""Parked rows: what a relay does with a row its sink refuses for good.

A relay delivers a run's rows in ``seq`` order. When the sink refuses one for
good (it raised a :class:`~flowdecision.errors.SinkRefusedError`), retrying is
pointless and waiting would stop every run behind it. The row is **parked**:
recorded in ``flow_decision_outbox_parked`` (outbox schema 4) with its error,
attempts and time, and the relay's cursor moves past it. The run's later rows
are recorded behind it as **held**, so that run's order is kept while every
other run goes on. A run with rows in this table is delivered from the table,
in ``seq`` order, until it has none left:

* the run's first row is ``parked``: the run waits for an operator;
* the run's first row is ``held``: the relay delivers it, then deletes it.

An operator **retries** a parked row (it becomes ``held``: the relay delivers
it next) or **skips** it (it is deleted: the run goes on with its next row).
Both are refused unless the row is parked, and are written to
``flow_decision_outbox_audit`` in the same transaction.

The relay's own writes here are **fenced** like its cursor: each names the
cursor lease (owner and fence) it holds and changes nothing once another relay
of that name took the cursor over.

Times are milliseconds on the store's clock, as for cursors.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.limits import identifier_problem
from ..errors import ActionRefusedError, InvalidArgumentError, UnknownDecisionError
from ..store.chain import OUTBOX_AUDIT_LOCK, chained, pg_audit_lock_sql
from ..store.postgres import CLOCK_SQL
from .cursor import CURSOR_TABLE, CursorLease

__all__ = [
    "AUDIT_TABLE",
    "PARKED_TABLE",
    "OutboxAuditEntry",
    "ParkedRow",
    "check_action",
    "pg_act",
    "pg_audit",
    "pg_park",
    "pg_parked",
    "pg_ready_runs",
    "pg_run_rows",
    "pg_unpark",
    "sqlite_act",
    "sqlite_audit",
    "sqlite_park",
    "sqlite_parked",
    "sqlite_ready_runs",
    "sqlite_run_rows",
    "sqlite_unpark",
]

PARKED_TABLE = "flow_decision_outbox_parked"
AUDIT_TABLE = "flow_decision_outbox_audit"
_OUTBOX = "flow_decision_outbox"
#: An operator's reason, at most this many characters (as the ledger's actions).
REASON_MAX = 2000
ACTIONS = ("retry", "skip")
_PARKED_COLUMNS = (
    "relay, seq, decision_id, run_id, state, error, attempts, parked_at_ms, updated_at_ms"
)
_AUDIT_COLUMNS = (
    "seq, at_ms, relay, action, decision_id, actor, reason, state_before, attempts, "
    "prev_hash, row_hash"
)
_AUDIT_INSERT = (
    f"INSERT INTO {AUDIT_TABLE} (at_ms, relay, action, decision_id, actor, reason, "
    "state_before, attempts, prev_hash, row_hash) VALUES ({})"
)
_LAST_HASH_SQL = f"SELECT row_hash FROM {AUDIT_TABLE} ORDER BY seq DESC LIMIT 1"
#: The outbox row's columns, as :func:`flowdecision.sinks.outbox._entry` reads them.
_ROW_COLUMNS = (
    "o.seq, o.decision_id, o.request_json, o.request_hash, o.first_attempt, "
    "o.highest_attempt, o.accepted_at_ms, o.traceparent"
)


@dataclass(frozen=True, slots=True)
class ParkedRow:
    """One row a relay parked (its sink refused it) or holds behind a parked row."""

    relay: str
    seq: int
    decision_id: str
    run_id: str
    #: ``parked`` (waits for an operator) or ``held`` (delivered when it is its run's first)
    state: str
    #: the sink's refusal (None for a row held behind another)
    error: str | None
    #: deliveries tried
    attempts: int
    parked_at_ms: int
    updated_at_ms: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (``GET /v1/outbox/parked``, ``flowdecision outbox parked --json``)."""
        return {
            "relay": self.relay,
            "seq": self.seq,
            "decision_id": self.decision_id,
            "run_id": self.run_id,
            "state": self.state,
            "error": self.error,
            "attempts": self.attempts,
            "parked_at_ms": self.parked_at_ms,
            "updated_at_ms": self.updated_at_ms,
        }

    @classmethod
    def from_dict(cls, obj: Any) -> ParkedRow:
        """Read back :meth:`to_dict`'s shape (the clients)."""
        return cls(
            relay=str(obj["relay"]),
            seq=int(obj["seq"]),
            decision_id=str(obj["decision_id"]),
            run_id=str(obj["run_id"]),
            state=str(obj["state"]),
            error=None if obj["error"] is None else str(obj["error"]),
            attempts=int(obj["attempts"]),
            parked_at_ms=int(obj["parked_at_ms"]),
            updated_at_ms=int(obj["updated_at_ms"]),
        )


@dataclass(frozen=True, slots=True)
class OutboxAuditEntry:
    """One operator action on a parked row, as the append-only outbox audit keeps it.

    The ledger's :class:`~flowdecision.ledger.AuditEntry` plus the relay the row
    was parked by; ``state_before`` is ``parked`` and ``attempts`` the deliveries tried.
    """

    seq: int
    at_ms: int
    relay: str
    action: str
    decision_id: str
    actor: str
    reason: str
    state_before: str
    attempts: int
    #: The hash chain (:mod:`flowdecision.store.chain`): the previous row's
    #: ``row_hash`` and this row's; None on rows from before schema 5.
    prev_hash: str | None = None
    row_hash: str | None = None

    def content(self) -> tuple[int, str, str, str, str, str, str, int]:
        """What the chain hashes of the row: its columns but ``seq`` and the hashes."""
        return (
            self.at_ms,
            self.relay,
            self.action,
            self.decision_id,
            self.actor,
            self.reason,
            self.state_before,
            self.attempts,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (the admin routes, ``flowdecision outbox retry/skip --json``)."""
        return {
            "seq": self.seq,
            "at_ms": self.at_ms,
            "relay": self.relay,
            "action": self.action,
            "decision_id": self.decision_id,
            "actor": self.actor,
            "reason": self.reason,
            "state_before": self.state_before,
            "attempts": self.attempts,
            "prev_hash": self.prev_hash,
            "row_hash": self.row_hash,
        }

    @classmethod
    def from_dict(cls, obj: Any) -> OutboxAuditEntry:
        """Read back :meth:`to_dict`'s shape (the clients)."""
        return cls(
            seq=int(obj["seq"]),
            at_ms=int(obj["at_ms"]),
            relay=str(obj["relay"]),
            action=str(obj["action"]),
            decision_id=str(obj["decision_id"]),
            actor=str(obj["actor"]),
            reason=str(obj["reason"]),
            state_before=str(obj["state_before"]),
            attempts=int(obj["attempts"]),
            prev_hash=obj.get("prev_hash"),
            row_hash=obj.get("row_hash"),
        )


def check_action(action: str, decision_id: str, actor: str, reason: str) -> None:
    """Refuse an operator action's bad arguments, naming the one at fault."""
    if action not in ACTIONS:
        raise InvalidArgumentError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    for field, value in (("decision_id", decision_id), ("actor", actor)):
        if not isinstance(value, str) or not value.strip():
            raise InvalidArgumentError(f"`{field}` must be non-empty text")
        problem = identifier_problem(value)
        if problem is not None:
            raise InvalidArgumentError(f"`{field}` {problem}")
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidArgumentError("`reason` must be non-empty text")
    if len(reason) > REASON_MAX:
        raise InvalidArgumentError(f"`reason` is longer than {REASON_MAX} characters")


def _parked(row: Any) -> ParkedRow:
    return ParkedRow(
        relay=str(row[0]),
        seq=int(row[1]),
        decision_id=str(row[2]),
        run_id=str(row[3]),
        state=str(row[4]),
        error=None if row[5] is None else str(row[5]),
        attempts=int(row[6]),
        parked_at_ms=int(row[7]),
        updated_at_ms=int(row[8]),
    )


def _audit(row: Any) -> OutboxAuditEntry:
    return OutboxAuditEntry(
        seq=int(row[0]),
        at_ms=int(row[1]),
        relay=str(row[2]),
        action=str(row[3]),
        decision_id=str(row[4]),
        actor=str(row[5]),
        reason=str(row[6]),
        state_before=str(row[7]),
        attempts=int(row[8]),
        prev_hash=row[9],
        row_hash=row[10],
    )


def _refusal(relay: str, decision_id: str, found: Any) -> ActionRefusedError:
    """Why an action on ``decision_id`` is refused: ``found`` is its parked row (or None)."""
    if found is None:
        return UnknownDecisionError(f"decision `{decision_id}` is not parked by relay `{relay}`")
    return ActionRefusedError(
        f"decision `{decision_id}` is held behind an earlier parked row of run "
        f"`{found[0]}` (relay `{relay}`), not parked itself: act on that row"
    )


def _on_conflict(state: str) -> str:
    """A row parked again (a retry refused) takes the new error and attempts; a row held
    again (read twice, around a crash) keeps what it has: never un-park a parked row."""
    if state == "held":
        return "ON CONFLICT (relay, seq) DO NOTHING"
    if state != "parked":
        raise InvalidArgumentError(f"state must be parked or held, got {state!r}")
    return (
        "ON CONFLICT (relay, seq) DO UPDATE SET state = excluded.state, error = excluded.error, "
        "attempts = excluded.attempts, updated_at_ms = excluded.updated_at_ms"
    )


# ----------------------------------------------------------------------------- SQLite

_FENCED = f"EXISTS (SELECT 1 FROM {CURSOR_TABLE} WHERE name = ? AND owner = ? AND fence = ?)"


def sqlite_park(
    conn: sqlite3.Connection,
    lease: CursorLease,
    rows: Sequence[tuple[int, str, str]],
    state: str,
    error: str | None,
    attempts: int,
    now: int,
) -> bool:
    """Record ``(seq, decision_id, run_id)`` rows as ``state`` (transaction open);
    False, writing nothing, once the lease is lost."""
    if conn.execute(f"SELECT {_FENCED}", (lease.name, lease.owner, lease.fence)).fetchone()[0] != 1:
        return False
    conn.executemany(
        f"INSERT INTO {PARKED_TABLE} ({_PARKED_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
        + _on_conflict(state),
        [(lease.name, seq, did, run, state, error, attempts, now, now) for seq, did, run in rows],
    )
    return True


def sqlite_unpark(conn: sqlite3.Connection, lease: CursorLease, seq: int) -> bool:
    """Delete a held row the sink accepted; False once the lease is lost."""
    cursor = conn.execute(
        f"DELETE FROM {PARKED_TABLE} WHERE relay = ? AND seq = ? AND state = 'held' AND {_FENCED}",
        (lease.name, seq, lease.name, lease.owner, lease.fence),
    )
    return cursor.rowcount == 1


def sqlite_parked(conn: sqlite3.Connection, relay: str | None) -> list[ParkedRow]:
    """Every parked or held row (of one relay), by relay and seq."""
    sql = f"SELECT {_PARKED_COLUMNS} FROM {PARKED_TABLE}"
    if relay is None:
        rows = conn.execute(f"{sql} ORDER BY relay, seq").fetchall()
    else:
        rows = conn.execute(f"{sql} WHERE relay = ? ORDER BY seq", (relay,)).fetchall()
    return [_parked(row) for row in rows]


_READY = (
    f"SELECT p.run_id FROM {PARKED_TABLE} p WHERE p.relay = {{0}} AND p.state = 'held' "
    f"AND p.seq = (SELECT min(q.seq) FROM {PARKED_TABLE} q "
    "WHERE q.relay = p.relay AND q.run_id = p.run_id) ORDER BY p.seq"
)


def sqlite_ready_runs(conn: sqlite3.Connection, relay: str) -> tuple[set[str], list[str]]:
    """``(runs with rows here, runs whose first row is held: deliverable now)``."""
    blocked = {
        str(row[0])
        for row in conn.execute(
            f"SELECT DISTINCT run_id FROM {PARKED_TABLE} WHERE relay = ?", (relay,)
        )
    }
    ready = [str(row[0]) for row in conn.execute(_READY.format("?"), (relay,))]
    return blocked, ready


_RUN_ROWS = (
    f"SELECT p.state, p.attempts, {_ROW_COLUMNS} FROM {PARKED_TABLE} p "
    f"JOIN {_OUTBOX} o ON o.seq = p.seq WHERE p.relay = {{0}} AND p.run_id = {{1}} "
    "ORDER BY p.seq LIMIT 100"
)


def sqlite_run_rows(conn: sqlite3.Connection, relay: str, run_id: str) -> list[tuple[Any, ...]]:
    """A run's rows here, in seq order: ``(state, attempts, *outbox row)`` each."""
    return [tuple(row) for row in conn.execute(_RUN_ROWS.format("?", "?"), (relay, run_id))]


def sqlite_act(
    conn: sqlite3.Connection, relay: str, action: str, decision_id: str, actor: str, reason: str,
    now: int,
) -> OutboxAuditEntry:  # fmt: skip
    """Retry or skip a parked row and audit it (transaction open); refused unless parked."""
    found = conn.execute(
        f"SELECT run_id, state, attempts, seq FROM {PARKED_TABLE} "
        "WHERE relay = ? AND decision_id = ?",
        (relay, decision_id),
    ).fetchone()
    if found is None or found[1] != "parked":
        raise _refusal(relay, decision_id, found)
    if action == "retry":
        conn.execute(
            f"UPDATE {PARKED_TABLE} SET state = 'held', updated_at_ms = ? "
            "WHERE relay = ? AND seq = ?",
            (now, relay, found[3]),
        )
    else:
        conn.execute(f"DELETE FROM {PARKED_TABLE} WHERE relay = ? AND seq = ?", (relay, found[3]))
    last = conn.execute(_LAST_HASH_SQL).fetchone()  # under the write lock: the last row
    entry = chained(
        OutboxAuditEntry(0, now, relay, action, decision_id, actor, reason, "parked",
                         int(found[2])),
        None if last is None else last[0],
    )  # fmt: skip
    cursor = conn.execute(
        _AUDIT_INSERT.format(", ".join("?" * 10)),
        (*entry.content(), entry.prev_hash, entry.row_hash),
    )
    seq = cursor.lastrowid
    assert seq is not None
    return dataclasses.replace(entry, seq=seq)


def sqlite_audit(conn: sqlite3.Connection, relay: str | None) -> list[OutboxAuditEntry]:
    """The outbox's audit trail (of one relay), oldest first."""
    sql = f"SELECT {_AUDIT_COLUMNS} FROM {AUDIT_TABLE}"
    if relay is None:
        rows = conn.execute(f"{sql} ORDER BY seq").fetchall()
    else:
        rows = conn.execute(f"{sql} WHERE relay = ? ORDER BY seq", (relay,)).fetchall()
    return [_audit(row) for row in rows]


# ------------------------------------------------------------------------- PostgreSQL

_PG_FENCED = f"EXISTS (SELECT 1 FROM {CURSOR_TABLE} WHERE name = $1 AND owner = $2 AND fence = $3)"


async def pg_park(
    conn: Any,
    lease: CursorLease,
    rows: Sequence[tuple[int, str, str]],
    state: str,
    error: str | None,
    attempts: int,
) -> bool:
    """:func:`sqlite_park` on PostgreSQL, in one transaction, on the database clock."""
    async with conn.transaction():
        if not await conn.fetchval(f"SELECT {_PG_FENCED}", lease.name, lease.owner, lease.fence):
            return False
        await conn.execute(
            f"INSERT INTO {PARKED_TABLE} ({_PARKED_COLUMNS}) "
            f"SELECT $1, s, d, r, $5, $6, $7, {CLOCK_SQL}, {CLOCK_SQL} "
            "FROM unnest($2::bigint[], $3::text[], $4::text[]) AS t(s, d, r) "
            + _on_conflict(state),
            lease.name,
            [row[0] for row in rows],
            [row[1] for row in rows],
            [row[2] for row in rows],
            state,
            error,
            attempts,
        )
        return True


async def pg_unpark(conn: Any, lease: CursorLease, seq: int) -> bool:
    """:func:`sqlite_unpark` on PostgreSQL."""
    status = await conn.execute(
        f"DELETE FROM {PARKED_TABLE} WHERE relay = $1 AND seq = $4 AND state = 'held' "
        f"AND {_PG_FENCED}",
        lease.name,
        lease.owner,
        lease.fence,
        seq,
    )
    return bool(status == "DELETE 1")


async def pg_parked(conn: Any, relay: str | None) -> list[ParkedRow]:
    """:func:`sqlite_parked` on PostgreSQL."""
    sql = f"SELECT {_PARKED_COLUMNS} FROM {PARKED_TABLE}"
    if relay is None:
        rows = await conn.fetch(f"{sql} ORDER BY relay, seq")
    else:
        rows = await conn.fetch(f"{sql} WHERE relay = $1 ORDER BY seq", relay)
    return [_parked(tuple(row)) for row in rows]


async def pg_ready_runs(conn: Any, relay: str) -> tuple[set[str], list[str]]:
    """:func:`sqlite_ready_runs` on PostgreSQL."""
    blocked = {
        str(row[0])
        for row in await conn.fetch(
            f"SELECT DISTINCT run_id FROM {PARKED_TABLE} WHERE relay = $1", relay
        )
    }
    ready = [str(row[0]) for row in await conn.fetch(_READY.format("$1"), relay)]
    return blocked, ready


async def pg_run_rows(conn: Any, relay: str, run_id: str) -> list[tuple[Any, ...]]:
    """:func:`sqlite_run_rows` on PostgreSQL."""
    return [tuple(row) for row in await conn.fetch(_RUN_ROWS.format("$1", "$2"), relay, run_id)]


async def pg_act(
    conn: Any, relay: str, action: str, decision_id: str, actor: str, reason: str
) -> OutboxAuditEntry:
    """:func:`sqlite_act` on PostgreSQL, in one transaction, on the database clock."""
    async with conn.transaction():
        now = int(await conn.fetchval(f"SELECT {CLOCK_SQL}"))
        found = await conn.fetchrow(
            f"SELECT run_id, state, attempts, seq FROM {PARKED_TABLE} "
            "WHERE relay = $1 AND decision_id = $2 FOR UPDATE",
            relay,
            decision_id,
        )
        if found is None or found[1] != "parked":
            raise _refusal(relay, decision_id, found)
        if action == "retry":
            await conn.execute(
                f"UPDATE {PARKED_TABLE} SET state = 'held', updated_at_ms = $3 "
                "WHERE relay = $1 AND seq = $2",
                relay,
                found[3],
                now,
            )
        else:
            await conn.execute(
                f"DELETE FROM {PARKED_TABLE} WHERE relay = $1 AND seq = $2", relay, found[3]
            )
        await conn.execute(pg_audit_lock_sql(OUTBOX_AUDIT_LOCK))  # appends chain in turn
        entry = chained(
            OutboxAuditEntry(0, now, relay, action, decision_id, actor, reason, "parked",
                             int(found[2])),
            await conn.fetchval(_LAST_HASH_SQL),
        )  # fmt: skip
        marks = ", ".join(f"${n}" for n in range(1, 11))
        seq = await conn.fetchval(
            _AUDIT_INSERT.format(marks) + " RETURNING seq",
            *entry.content(),
            entry.prev_hash,
            entry.row_hash,
        )
        return dataclasses.replace(entry, seq=int(seq))


async def pg_audit(conn: Any, relay: str | None) -> list[OutboxAuditEntry]:
    """:func:`sqlite_audit` on PostgreSQL."""
    sql = f"SELECT {_AUDIT_COLUMNS} FROM {AUDIT_TABLE}"
    if relay is None:
        rows = await conn.fetch(f"{sql} ORDER BY seq")
    else:
        rows = await conn.fetch(f"{sql} WHERE relay = $1 ORDER BY seq", relay)
    return [_audit(tuple(row)) for row in rows]
