"""The joint write: another component's row written inside the ledger's transaction.

"Joint" is the one word for this path everywhere: a :class:`JointWrite` is
offered by a ``JointSink`` (``flowdecision.sinks``), committed by
``Ledger.joint_commit`` and chosen by ``Dispatcher.joint``.

The ledger and the outbox meet here, in ``store``, and nowhere else: neither
imports the other. A store that holds both (one SQLite file, one PostgreSQL
database) can accept a decision in ONE transaction: the ledger applies the
claim rules, asks the :class:`JointWriter` to write its row on the ledger's
own connection, then applies the completion rules to the evolving record.

* :class:`StoreKey` names where a store lives, so a sink can tell whether it
  shares the ledger's store (:func:`sqlite_key`, :func:`postgres_key`).
* :class:`JointWrite` is one row to write, prepared by the sink before the
  transaction (encoding and hashing stay off the ledger's thread).
* :class:`JointWriter` writes such rows, once per dialect: alone on the SQLite
  connection thread (inside a savepoint the ledger opened), or as a whole
  batch on a PostgreSQL connection (inside the ledger's batch transaction).
  It returns what it did (a new row, or a replay of an identical one); the
  ledger hands that back to its caller with the claim's outcome.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..connections.urls import describe_dsn, parse_pg_dsn
from ..errors import InvalidArgumentError

__all__ = ["JointWrite", "JointWriter", "StoreKey", "postgres_key", "sqlite_key"]


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


class JointWriter(Protocol):
    """Writes :class:`JointWrite` rows on the ledger's connection, in its transaction.

    A writer may also define ``committed(write)``: the dispatcher calls it once
    the transaction that inserted ``write`` committed (the outbox wakes its readers);
    and ``write_sqlite_many(conn, writes)``, the SQLite twin of :meth:`write_postgres`
    (same answers), which the SQLite ledger then calls once per batch instead of
    :meth:`write_sqlite` once per row.
    """

    def write_sqlite(self, conn: sqlite3.Connection, write: JointWrite, attempt: int) -> bool:
        """Write one row on the ledger's SQLite connection (its transaction is open).

        Returns True for a new row, False when an identical row was already
        there (a replay). Raise to refuse (the ledger rolls the row back and
        stores nothing for this decision; its caller gets the error). A
        :class:`sqlite3.Error` is the database failing: the whole batch fails.
        """
        ...

    async def write_postgres(
        self, conn: Any, writes: Sequence[tuple[JointWrite, int]]
    ) -> list[bool | BaseException]:
        """Write a batch's rows on the ledger's asyncpg connection (transaction open).

        Returns one entry per write: True for a new row, False for a replay,
        or the error refusing that write (nothing written for it). Raising
        rolls the transaction back: a driver or database error fails the whole
        batch (a ledger failure); any other error fails these writes' callers
        with it, and the rest of the batch is tried again without them.
        """
        ...


@dataclass(frozen=True, slots=True, eq=False)
class JointWrite:
    """One row to write in the ledger's transaction, for ``decision_id``.

    ``payload`` is the writer's own (the encoded row). Nothing here changes
    once prepared: what the write did comes back from the writer (and from
    ``Ledger.joint_commit``, as ``JointOutcome.inserted``).
    """

    writer: JointWriter
    store: StoreKey
    decision_id: str
    payload: Any
