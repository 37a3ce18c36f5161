"""The joint write: another component's rows written inside the ledger's transaction.

"Joint" is the one word for this path everywhere: a :class:`JointRow` is
offered by a ``JointSink`` (``flowdecision.sinks``), committed by
``Ledger.joint_commit`` and chosen by ``Dispatcher.joint``.

The ledger and the outbox meet here, in ``store``, and nowhere else: neither
imports the other, and neither calls the other. A store that holds both (one
SQLite file, one PostgreSQL database) can accept a decision in ONE
transaction: the ledger applies the claim and completion rules, runs the
joint rows' statements through this module, then writes its own rows. All of
it is data:

* :class:`StoreKey` names where a store lives, so a sink can tell whether it
  shares the ledger's store (:func:`sqlite_key`, :func:`postgres_key`).
* :class:`JointTable` is a table's insert-if-absent statements per dialect,
  written by the table's owner (the outbox's ``OUTBOX_ROWS``).
* :class:`JointRow` is one row for such a table, prepared by the sink before
  the transaction (encoding and hashing stay off the ledger's thread).
* :func:`sqlite_insert_rows` and :func:`pg_insert_rows`, one per dialect,
  insert a batch of rows on the ledger's connection in its open transaction
  and say per row what happened (:data:`JointResult`: inserted, a replay, or
  refused); the ledger hands that back to its caller with the claim's outcome.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..connections.urls import describe_dsn, parse_pg_dsn
from ..errors import InvalidArgumentError, SinkContentConflictError

__all__ = [
    "JointResult",
    "JointRow",
    "JointTable",
    "StoreKey",
    "pg_insert_rows",
    "postgres_key",
    "sqlite_insert_rows",
    "sqlite_key",
]


@dataclass(frozen=True, slots=True)
class StoreKey:
    """Where a store lives: ``kind`` (``sqlite`` or ``postgresql``) and a
    canonical location (the resolved file path; host, port, database and user)."""

    kind: str
    where: str


def sqlite_key(path: str | os.PathLike[str]) -> StoreKey:
    """The key of a SQLite file: two paths to one file (symlinks, ``..``) compare equal."""
    return StoreKey("sqlite", os.path.realpath(Path(path)))


def postgres_key(dsn: str) -> StoreKey:
    """The key of a PostgreSQL database: every host and port, the database and
    the user (no password); two DSNs are one store only when they name the same
    database on the same hosts, in any order (a multi-host DSN included).

    The user is part of it because the ledger's connection writes the joined
    rows: a store reached as another role is not treated as the same store. A
    DSN that cannot be read is keyed by a digest of its own text (messages show
    the key; the text may hold a password): it joins no other store.
    """
    try:
        return StoreKey("postgresql", parse_pg_dsn(dsn).identity())
    except (InvalidArgumentError, ValueError):
        digest = hashlib.sha256(dsn.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return StoreKey("postgresql", f"{describe_dsn(dsn)} #{digest}")


@dataclass(frozen=True, slots=True)
class JointTable:
    """A table that takes rows in the ledger's transaction: its statements, per dialect.

    Written by the table's owner (the outbox: ``sinks/outbox.py``'s
    ``OUTBOX_ROWS``) and run by :func:`sqlite_insert_rows` and
    :func:`pg_insert_rows`. Every such table is insert-if-absent keyed by
    decision id: a new row keeps its attempt as first and highest attempt, a
    row already there with the same content hash is a replay (its highest
    attempt rises), one with another hash refuses the row (``conflict``).

    Statement parameters:

    * ``sqlite_insert``: ``{rows}`` becomes one ``sqlite_row`` per row, each
      bound to ``(decision_id, content_hash, attempt, attempt, clock_ms,
      *values)``; ``... ON CONFLICT (decision_id) DO NOTHING``.
    * ``sqlite_newest``: ``{marks}`` the ids, then a limit: the ids of the
      newest rows among them (the ones an insert just added).
    * ``sqlite_stored`` (``{marks}`` the ids) and ``pg_stored`` (``$1`` the
      ids, locking them): ``(decision_id, content_hash)`` of the rows there.
    * ``sqlite_raise`` (``?1`` an id, ``?2`` an attempt) and ``pg_raise``
      (``$1`` ids, ``$2`` attempts): raise the highest attempt.
    * ``pg_insert``: ``$1`` ids, ``$2`` hashes, ``$3`` attempts, then one
      array per value column, in the rows' order; ``RETURNING decision_id``.
    * ``pg_lock``: run before inserting and held to the commit (seq order is
      then commit order), or None.
    """

    conflict: type[SinkContentConflictError]
    sqlite_insert: str
    sqlite_row: str
    sqlite_newest: str
    sqlite_stored: str
    sqlite_raise: str
    pg_insert: str
    pg_stored: str
    pg_raise: str
    pg_lock: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class JointRow:
    """One row for ``table``, to write in a ledger's transaction for ``decision_id``.

    Plain data, prepared by the sink before the transaction (encoding and
    hashing stay off the ledger's thread): the store it must share with the
    ledger, the content hash that tells a replay from a conflict, and the
    table's own column ``values``. What the write did comes back from
    :func:`sqlite_insert_rows` / :func:`pg_insert_rows` (and from
    ``Ledger.joint_commit``, as ``JointOutcome.inserted``).
    """

    table: JointTable
    store: StoreKey
    decision_id: str
    content_hash: str
    values: tuple[Any, ...]


#: What writing a row did: True, inserted; False, a replay (an identical row was
#: there: its highest attempt rose); an error, refused (other content; nothing written).
JointResult = bool | SinkContentConflictError

#: Rows per SQLite multi-row statement: under the bound of 999 parameters before 3.32.
_SQLITE_PARAMETERS = 999


def _by_table(
    rows: Sequence[tuple[JointRow, int]],
) -> list[tuple[JointTable, list[int]]]:
    """The rows' indexes per table, tables in first-seen order (one, in practice)."""
    first = rows[0][0].table
    if len(rows) == 1 or all(row.table is first for row, _ in rows):
        return [(first, list(range(len(rows))))]
    groups: dict[int, tuple[JointTable, list[int]]] = {}
    for index, (row, _) in enumerate(rows):
        groups.setdefault(id(row.table), (row.table, []))[1].append(index)
    return list(groups.values())


def sqlite_insert_rows(
    conn: sqlite3.Connection, rows: Sequence[tuple[JointRow, int]]
) -> list[JointResult]:
    """Insert-if-absent ``(row, attempt)`` pairs (distinct decision ids) inside the
    open transaction of ``conn``; one :data:`JointResult` per pair, in order.

    The new rows (the common case) go in with one multi-row statement per
    table, so ``seq`` follows the rows' order, and nothing is read back when
    all of them were new: on the ledger's thread every statement is a GIL
    hand-off with the event loop. A :class:`sqlite3.Error` is the database
    failing: it propagates (the caller's transaction fails as a whole).
    """
    done: list[JointResult] = [True] * len(rows)
    if not rows:
        return done
    now_ms = time.time_ns() // 1_000_000
    for table, indexes in _by_table(rows):
        width = 5 + len(rows[indexes[0]][0].values)
        chunk_size = _SQLITE_PARAMETERS // width
        for start in range(0, len(indexes), chunk_size):
            chunk = indexes[start : start + chunk_size]
            params: list[Any] = []
            for index in chunk:
                row, attempt = rows[index]
                params += (row.decision_id, row.content_hash, attempt, attempt, now_ms, *row.values)
            cursor = conn.execute(
                table.sqlite_insert.format(rows=",".join([table.sqlite_row] * len(chunk))), params
            )
            if cursor.rowcount != len(chunk):
                _sqlite_settle(conn, table, rows, chunk, cursor.rowcount, done)
    return done


def _sqlite_settle(
    conn: sqlite3.Connection,
    table: JointTable,
    rows: Sequence[tuple[JointRow, int]],
    chunk: list[int],
    inserted: int,
    done: list[JointResult],
) -> None:
    """Some rows of ``chunk`` were there already: tell replays from refusals."""
    ids = [rows[index][0].decision_id for index in chunk]
    marks = ",".join(["?"] * len(ids))
    new: set[str] = set()
    if inserted > 0:
        # The rows this statement inserted are the chunk's ``inserted`` newest (seq grows).
        found = conn.execute(table.sqlite_newest.format(marks=marks), [*ids, inserted])
        new = {found_id for (found_id,) in found}
    old = [index for index in chunk if rows[index][0].decision_id not in new]
    stored = dict(
        conn.execute(
            table.sqlite_stored.format(marks=",".join(["?"] * len(old))),
            [rows[index][0].decision_id for index in old],
        ).fetchall()
    )
    replays: list[tuple[str, int]] = []
    for index in old:
        row, attempt = rows[index]
        done[index] = _replay_or_refusal(table, row, stored.get(row.decision_id))
        if done[index] is False:
            replays.append((row.decision_id, attempt))
    if replays:
        conn.executemany(table.sqlite_raise, replays)


def _replay_or_refusal(table: JointTable, row: JointRow, stored: Any) -> JointResult:
    if stored == row.content_hash:
        return False
    return table.conflict(row.decision_id, str(stored), row.content_hash)


async def pg_insert_rows(conn: Any, rows: Sequence[tuple[JointRow, int]]) -> list[JointResult]:
    """Insert-if-absent ``(row, attempt)`` pairs (distinct decision ids) inside the
    open transaction of the asyncpg connection ``conn``; one :data:`JointResult` per
    pair, in order.

    Per table: its ``pg_lock`` (held to the commit, so batches that add rows
    commit one after the other and ``seq`` order stays commit order), one
    insert of every row in order, and only when some were there already, one
    locking read of those and one update raising the replays' highest attempt.
    A driver or database error propagates (the caller's transaction fails).
    """
    done: list[JointResult] = [True] * len(rows)
    if not rows:
        return done
    for table, indexes in _by_table(rows):
        if table.pg_lock is not None:
            await conn.execute(table.pg_lock)
        picked = [rows[index] for index in indexes]
        columns: list[list[Any]] = [[] for _ in picked[0][0].values]
        for row, _ in picked:
            for column, value in zip(columns, row.values, strict=True):
                column.append(value)
        inserted = {
            found[0]
            for found in await conn.fetch(
                table.pg_insert,
                [row.decision_id for row, _ in picked],
                [row.content_hash for row, _ in picked],
                [attempt for _, attempt in picked],
                *columns,
            )
        }
        old = [index for index in indexes if rows[index][0].decision_id not in inserted]
        if not old:
            continue
        stored = {
            found[0]: found[1]
            for found in await conn.fetch(
                table.pg_stored, [rows[index][0].decision_id for index in old]
            )
        }
        raise_ids: list[str] = []
        raise_to: list[int] = []
        for index in old:
            row, attempt = rows[index]
            done[index] = _replay_or_refusal(table, row, stored.get(row.decision_id))
            if done[index] is False:
                raise_ids.append(row.decision_id)
                raise_to.append(attempt)
        if raise_ids:
            await conn.execute(table.pg_raise, raise_ids, raise_to)
    return done
