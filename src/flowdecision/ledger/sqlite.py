"""The embedded default ledger: one SQLite database file, safe across processes.

Design:

* Every ledger owns one worker thread with its own :mod:`sqlite3` connection;
  all database work runs there, so the event loop never blocks and the
  connection never crosses threads. One hop per operation, no pool.
* The database runs in WAL mode. A mutation is one ``BEGIN IMMEDIATE``
  transaction (load the row, apply the pure transition, write it back when it
  changed, ``COMMIT``); other processes wait up to ``busy_timeout_ms``.
  Commits are durable by default (``synchronous=FULL``).
* The schema version is SQLite's ``user_version``; versioned migrations in
  ``sql/sqlite/NNNN_*.sql`` are applied when the ledger opens, inside one
  ``BEGIN IMMEDIATE`` transaction, so concurrent openers migrate once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sqlite3
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import LedgerCorruptError, LedgerError, LedgerSchemaError, LedgerUnavailableError
from ..jsonwire import encode_json_text
from .base import Ledger, Operation
from .machine import ClaimRecord, ClaimStatus, is_prunable

__all__ = [
    "DEFAULT_SQLITE_PATH",
    "SCHEMA_VERSION",
    "SqliteLedger",
    "Synchronous",
    "encode_row",
    "load_migrations",
]

T = TypeVar("T")

#: Where the CLI, the demo and the service keep their ledger unless told otherwise.
DEFAULT_SQLITE_PATH = Path(".flowdecision") / "ledger.db"

#: ``synchronous`` settings accepted; FULL makes every commit durable on power loss.
Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]

_I64_MAX = (1 << 63) - 1
_PRUNE_BATCH = 1000
_TABLE = "flowdecision_claims"


def load_migrations(dialect: str) -> list[tuple[int, str, str]]:
    """The ``(version, name, sql)`` migrations shipped for ``dialect``, in order."""
    folder = resources.files("flowdecision.ledger").joinpath("sql", dialect)
    found: list[tuple[int, str, str]] = []
    for entry in folder.iterdir():
        name = entry.name
        if not name.endswith(".sql"):
            continue
        prefix = name.split("_", 1)[0]
        if not prefix.isdigit():
            continue
        found.append((int(prefix), name, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [version for version, _, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise LedgerSchemaError(f"{dialect} migrations are not numbered 1..n: {versions}")
    return found


SCHEMA_VERSION = len(load_migrations("sqlite"))


def split_statements(script: str) -> list[str]:
    """Split a migration script into complete SQL statements."""
    statements: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            if pending.strip():
                statements.append(pending.strip())
            pending = ""
    if pending.strip() and not all(
        not part.strip() or part.strip().startswith("--") for part in pending.splitlines()
    ):
        raise LedgerSchemaError(f"incomplete SQL statement in migration: {pending.strip()!r}")
    return statements


def encode_row(decision_id: str, record: ClaimRecord) -> tuple[str, str, int | None, str]:
    """``(decision_id, status, completed_at_ms, record)`` for one claim record."""
    completed_at: int | None = None
    if record.status is ClaimStatus.COMPLETED and record.completed_at_ms is not None:
        completed_at = min(record.completed_at_ms, _I64_MAX)
    return (
        decision_id,
        record.status.value,
        completed_at,
        encode_json_text(record.to_dict()),
    )


class SqliteLedger(Ledger):
    """Claim ledger in one SQLite file (default ``./.flowdecision/ledger.db``).

    ``SqliteLedger(path)`` does no I/O: the database is opened, created and
    migrated by the first operation, or eagerly by :meth:`start` /
    ``await SqliteLedger.open(path)``. Parent directories are created.

    ``synchronous`` picks SQLite's durability (``FULL``: a committed claim
    survives power loss; ``NORMAL``: it may roll back on power loss but never
    corrupts). ``busy_timeout_ms`` bounds how long a mutation waits for another
    process's write transaction before failing with
    :class:`LedgerUnavailableError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_SQLITE_PATH,
        *,
        synchronous: Synchronous = "FULL",
        busy_timeout_ms: int = 30_000,
    ) -> None:
        sync = str(synchronous).upper()
        if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise LedgerError(
                f"sqlite ledger synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}"
            )
        self.path = Path(path)
        self.synchronous = sync
        self.busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flowdecision-sqlite"
        )

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str] = DEFAULT_SQLITE_PATH,
        *,
        synchronous: Synchronous = "FULL",
        busy_timeout_ms: int = 30_000,
    ) -> SqliteLedger:
        """Open (creating and migrating if needed) the database at ``path``."""
        ledger = cls(path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
        try:
            await ledger.start()
        except BaseException:
            await ledger.close()
            raise
        return ledger

    async def start(self) -> SqliteLedger:
        """Open, create and migrate the database now instead of at first use."""
        await self._run(lambda conn: None)
        return self

    async def schema_version(self) -> int:
        """The schema version stored in the database."""
        return await self._run(_user_version)

    # -- primitives ---------------------------------------------------------

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        def work(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute(
                    f"SELECT record FROM {_TABLE} WHERE decision_id = ?", (decision_id,)
                ).fetchone()
                record = None if row is None else self._decode(decision_id, row[0])
                transition = op(record, self.now_ms())
                if transition.changed and transition.record is not None:
                    values = encode_row(decision_id, transition.record)
                    if row is None:
                        conn.execute(
                            f"INSERT INTO {_TABLE} (decision_id, status, completed_at_ms, record) "
                            "VALUES (?, ?, ?, ?)",
                            values,
                        )
                    else:
                        conn.execute(
                            f"UPDATE {_TABLE} SET status = ?, completed_at_ms = ?, record = ? "
                            "WHERE decision_id = ?",
                            (*values[1:], decision_id),
                        )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return transition.result

        return await self._run(work)

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        def work(conn: sqlite3.Connection) -> ClaimRecord | None:
            row = conn.execute(
                f"SELECT record FROM {_TABLE} WHERE decision_id = ?", (decision_id,)
            ).fetchone()
            return None if row is None else self._decode(decision_id, row[0])

        return await self._run(work)

    async def _prune(self, before_ms: int) -> int:
        def batch(conn: sqlite3.Connection) -> int:
            # Exact for every row below the clamp; rows at the clamp are re-checked.
            conn.execute("BEGIN IMMEDIATE")
            try:
                cursor = conn.execute(
                    f"DELETE FROM {_TABLE} WHERE decision_id IN ("
                    f"SELECT decision_id FROM {_TABLE} WHERE completed_at_ms < ? LIMIT ?)",
                    (min(before_ms, _I64_MAX), _PRUNE_BATCH),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return cursor.rowcount

        def clamped(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            try:
                rows = conn.execute(
                    f"SELECT decision_id, record FROM {_TABLE} WHERE completed_at_ms = ?",
                    (_I64_MAX,),
                ).fetchall()
                doomed = [
                    (key,) for key, text in rows if is_prunable(self._decode(key, text), before_ms)
                ]
                conn.executemany(f"DELETE FROM {_TABLE} WHERE decision_id = ?", doomed)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return len(doomed)

        total = 0
        while True:
            deleted = await self._run(batch)
            total += deleted
            if deleted < _PRUNE_BATCH:
                break
        if before_ms > _I64_MAX:
            total += await self._run(clamped)
        return total

    async def close(self) -> None:
        """Close the connection and stop the worker thread."""
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        finally:
            self._executor.shutdown(wait=False)

    # -- worker-thread helpers ----------------------------------------------

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise LedgerError(f"sqlite ledger `{self.path}` is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, work)

    def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return work(self._connection())
        except sqlite3.Error as error:
            raise self._translate(error) from error

    def _translate(self, error: sqlite3.Error) -> LedgerError:
        text = str(error)
        if isinstance(error, sqlite3.OperationalError):
            if "locked" in text or "busy" in text:
                return LedgerUnavailableError(
                    f"sqlite ledger `{self.path}` stayed locked by another writer for more "
                    f"than {self.busy_timeout_ms} ms: {text}"
                )
            if "no such table" in text:
                return LedgerSchemaError(f"sqlite ledger `{self.path}` has no ledger table: {text}")
            return LedgerUnavailableError(f"sqlite ledger `{self.path}`: {text}")
        if isinstance(error, sqlite3.DatabaseError) and (
            "not a database" in text or "malformed" in text
        ):
            return LedgerCorruptError(f"sqlite ledger `{self.path}` is corrupt: {text}")
        return LedgerUnavailableError(f"sqlite ledger `{self.path}`: {text}")

    def _decode(self, decision_id: str, text: Any) -> ClaimRecord:
        try:
            obj = json.loads(text)
        except (TypeError, ValueError) as error:
            raise LedgerCorruptError(
                f"decode decision `{decision_id}` in sqlite ledger `{self.path}`: {error}"
            ) from error
        try:
            return ClaimRecord.from_dict(decision_id, obj)
        except LedgerCorruptError as error:
            raise LedgerCorruptError(f"{error} (sqlite ledger `{self.path}`)") from error

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise LedgerUnavailableError(
                f"create directory for sqlite ledger `{self.path}`: {error.strerror or error}"
            ) from error
        conn = sqlite3.connect(
            self.path,
            timeout=self.busy_timeout_ms / 1000,
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves
            check_same_thread=True,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            # Switching to WAL (once per database; it persists) takes an exclusive
            # lock and does not wait on the busy handler, so retry it ourselves.
            deadline = time.monotonic() + self.busy_timeout_ms / 1000
            while True:
                try:
                    mode = conn.execute("PRAGMA journal_mode").fetchone()
                    if mode is None or str(mode[0]).lower() != "wal":
                        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
                    break
                except sqlite3.OperationalError as error:
                    if "locked" not in str(error) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            if mode is None or str(mode[0]).lower() != "wal":
                raise LedgerUnavailableError(
                    f"sqlite ledger `{self.path}`: cannot enable WAL mode (got {mode!r})"
                )
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        migrations = load_migrations("sqlite")
        newest = len(migrations)
        current = _user_version(conn)
        if current == newest:
            return
        if current > newest:
            raise self._newer(current, newest)
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = _user_version(conn)  # another process may have migrated meanwhile
            if current > newest:
                raise self._newer(current, newest)
            if current == 0:
                tables = conn.execute(
                    "SELECT name FROM sqlite_master "
                    "WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                ).fetchall()
                if tables and not any(name == _TABLE for (name,) in tables):
                    raise LedgerSchemaError(
                        f"sqlite ledger `{self.path}` is a database of something else "
                        f"(tables: {', '.join(name for (name,) in tables)}); "
                        "point the ledger at a new file"
                    )
            for version, _name, script in migrations:
                if version <= current:
                    continue
                for statement in split_statements(script):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _newer(self, found: int, newest: int) -> LedgerSchemaError:
        return LedgerSchemaError(
            f"sqlite ledger `{self.path}` has schema version {found}, newer than version "
            f"{newest} that this flowdecision supports; upgrade flowdecision to open it"
        )


def _user_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("PRAGMA user_version").fetchone()
    return int(row[0]) if row else 0
