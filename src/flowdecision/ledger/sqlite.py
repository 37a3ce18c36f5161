"""The embedded default ledger: one SQLite database file, safe across processes.

Design:

* Every ledger owns one worker thread with its own :mod:`sqlite3` connection;
  all database work runs there, so the event loop never blocks and the
  connection never crosses threads. Requests reach the thread through a queue
  and results come back with one ``call_soon_threadsafe`` per batch.
* The database runs in WAL mode. A mutation is one ``BEGIN IMMEDIATE``
  transaction (load the row, apply the pure transition, write it back when it
  changed, ``COMMIT``); other processes wait up to ``busy_timeout_ms``.
  Commits are durable by default (``synchronous=FULL``).
* **Group commit** (on by default): the mutations that are queued when the
  thread becomes free -- up to ``max_batch``, optionally waiting up to
  ``max_wait_ms`` for more -- share one ``BEGIN IMMEDIATE`` ... ``COMMIT``.
  They are applied in arrival order, each on the record as the previous ones
  left it; a transition that raises (a rule failure) stores nothing and fails
  only its own caller. Every caller is answered only after the ``COMMIT``
  returned, i.e. after the commit is as durable as ``synchronous`` makes it.
  A lone mutation never waits: at low load a batch is one operation.
* Decoded records are remembered per decision id together with their stored
  text; a row whose text is byte-identical is not decoded and validated again.
* The schema version is SQLite's ``user_version``; versioned migrations in
  ``sql/sqlite/NNNN_*.sql`` are applied when the ledger opens, inside one
  ``BEGIN IMMEDIATE`` transaction, so concurrent openers migrate once.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import (
    LedgerCorruptError,
    LedgerError,
    LedgerSchemaError,
    LedgerUnavailableError,
    StoreMissingError,
)
from ..migrations import load_migrations, split_statements
from ..sqlite_wal import connect_wal
from .base import Operation, PruneProgress, StoredLedger
from .batching import copy_error, settle
from .machine import ClaimRecord, is_prunable
from .rows import I64_MAX, DecodedRecords, encode_row

__all__ = [
    "DEFAULT_SQLITE_PATH",
    "SCHEMA_VERSION",
    "SqliteLedger",
    "Synchronous",
]

T = TypeVar("T")

#: Where the CLI, the demo and the service keep their ledger unless told otherwise.
DEFAULT_SQLITE_PATH = Path(".flowdecision") / "ledger.db"

#: ``synchronous`` settings accepted; FULL makes every commit durable on power loss.
Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]

_PRUNE_BATCH = 1000
_TABLE = "flowdecision_claims"

_SELECT_SQL = f"SELECT record FROM {_TABLE} WHERE decision_id = ?"
_INSERT_SQL = (
    f"INSERT INTO {_TABLE} (decision_id, status, completed_at_ms, record) VALUES (?, ?, ?, ?)"
)
_UPDATE_SQL = (
    f"UPDATE {_TABLE} SET status = ?, completed_at_ms = ?, record = ? WHERE decision_id = ?"
)


SCHEMA_VERSION = len(load_migrations("flowdecision.ledger", "sqlite"))


class _Request:
    """One unit of work queued for the worker thread, answered on its loop."""

    __slots__ = ("decision_id", "error", "future", "loop", "op", "result", "work")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        decision_id: str = "",
        op: Operation[Any] | None = None,
        work: Callable[[sqlite3.Connection], Any] | None = None,
    ) -> None:
        self.loop = loop
        self.future = future
        self.decision_id = decision_id
        self.op = op
        self.work = work
        self.result: Any = None
        self.error: BaseException | None = None


class _Slot:
    """One decision's row while a batch is being applied."""

    __slots__ = ("dirty", "error", "exists", "record", "text")

    def __init__(self, exists: bool, record: ClaimRecord | None) -> None:
        self.exists = exists
        self.record = record
        self.dirty = False
        self.text = ""
        self.error: BaseException | None = None


_STOP = object()


class SqliteLedger(StoredLedger):
    """Claim ledger in one SQLite file (default ``./.flowdecision/ledger.db``).

    ``SqliteLedger(path)`` does no I/O: the database is opened, created and
    migrated by the first operation, or eagerly by :meth:`start` /
    ``await SqliteLedger.open(path)``. Parent directories are created, and a
    new database file is created ``0600``.

    ``create=False`` opens an existing ledger only: nothing is created or
    migrated, a missing file (or one holding no ledger) raises
    :class:`~flowdecision.errors.StoreMissingError`, and a ledger whose schema
    is older than this code raises :class:`LedgerSchemaError` (run
    :meth:`migrate`). Operators' read commands open ledgers this way.

    ``synchronous`` picks SQLite's durability (``FULL``: a committed claim
    survives power loss; ``NORMAL``: it may roll back on power loss but never
    corrupts). ``busy_timeout_ms`` bounds how long a mutation waits for another
    process's write transaction before failing with
    :class:`LedgerUnavailableError`.

    ``group_commit`` (default on) lets mutations that are in flight together
    share one transaction: at most ``max_batch`` per commit, and the worker
    waits up to ``max_wait_ms`` (default 0: never) for more to arrive once a
    batch has started. ``group_commit=False`` commits every mutation alone.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_SQLITE_PATH,
        *,
        synchronous: Synchronous = "FULL",
        busy_timeout_ms: int = 30_000,
        group_commit: bool = True,
        max_batch: int = 64,
        max_wait_ms: float = 0.0,
        cache_kib: int = 16_384,
        create: bool = True,
    ) -> None:
        sync = str(synchronous).upper()
        if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise LedgerError(
                f"sqlite ledger synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}"
            )
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise LedgerError(
                f"sqlite ledger max_batch must be a positive integer, got {max_batch!r}"
            )
        if not max_wait_ms >= 0:
            raise LedgerError(f"sqlite ledger max_wait_ms must be >= 0, got {max_wait_ms!r}")
        self.path = Path(path)
        self.synchronous = sync
        self.busy_timeout_ms = busy_timeout_ms
        self.group_commit = bool(group_commit)
        self.max_batch = max_batch if self.group_commit else 1
        self.max_wait_ms = float(max_wait_ms) if self.group_commit else 0.0
        self.cache_kib = cache_kib
        self.create = bool(create)
        #: The schema version found when the database was opened (before migrating).
        self.version_at_open: int | None = None
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._decoded = DecodedRecords(f"sqlite ledger `{self.path}`")
        #: Transactions committed by this ledger's mutations and the operations in them.
        self.commits = 0
        self.committed_ops = 0

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str] = DEFAULT_SQLITE_PATH,
        **options: Any,
    ) -> SqliteLedger:
        """Open (creating and migrating if needed) the database at ``path``.

        ``options`` are the constructor's keyword arguments.
        """
        ledger = cls(path, **options)
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

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; returns ``(version_before, version_after)``.

        Opening migrates already; this reports what opening found, so an
        up-to-date ledger answers ``(n, n)``.
        """
        await self.start()
        assert self.version_at_open is not None
        return self.version_at_open, await self.schema_version()

    # -- primitives ---------------------------------------------------------

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(_Request(loop, future, decision_id, op))
        return await future

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        def work(conn: sqlite3.Connection) -> ClaimRecord | None:
            row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
            return None if row is None else self._decoded.decode(decision_id, row[0])

        return await self._run(work)

    async def _prune(self, before_ms: int, progress: PruneProgress | None) -> int:
        def batch(conn: sqlite3.Connection) -> int:
            # Exact for every row below the clamp; rows at the clamp are re-checked.
            conn.execute("BEGIN IMMEDIATE")
            try:
                cursor = conn.execute(
                    f"DELETE FROM {_TABLE} WHERE rowid IN ("
                    f"SELECT rowid FROM {_TABLE} WHERE completed_at_ms < ? LIMIT ?)",
                    (min(before_ms, I64_MAX), _PRUNE_BATCH),
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
                    (I64_MAX,),
                ).fetchall()
                doomed = [
                    (key,)
                    for key, text in rows
                    if is_prunable(self._decoded.decode(key, text), before_ms)
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
            if progress is not None:
                progress(total)
            if deleted < _PRUNE_BATCH:
                break
        if before_ms > I64_MAX:
            total += await self._run(clamped)
            if progress is not None:
                progress(total)
        return total

    async def close(self) -> None:
        """Close the connection and stop the worker thread (after queued work)."""
        if self._closed:
            return
        thread = self._thread
        if thread is None:
            self._closed = True
            return

        def shut(conn: sqlite3.Connection | None) -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put(_Request(loop, future, work=shut))
        self._closed = True
        self._queue.put(_STOP)
        try:
            await future
        except LedgerError:
            pass

    # -- worker thread --------------------------------------------------------

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work(connection)`` on the worker thread, in queue order."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(_Request(loop, future, work=work))
        return await future

    def _submit(self, request: _Request) -> None:
        if self._closed:
            raise LedgerError(f"sqlite ledger `{self.path}` is closed")
        if self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    thread = threading.Thread(
                        target=self._serve, name="flowdecision-sqlite", daemon=True
                    )
                    thread.start()
                    self._thread = thread
        self._queue.put(request)

    def _serve(self) -> None:
        """The worker thread: take requests in order, batching consecutive mutations."""
        take = self._queue.get
        take_now = self._queue.get_nowait
        carry: Any = None
        while True:
            request = carry if carry is not None else take()
            carry = None
            if request is _STOP:
                return
            if request.op is None:
                self._run_work(request)
                self._answer([request])
                continue
            batch = [request]
            limit = self.max_batch
            wait_s = self.max_wait_ms / 1000
            deadline = 0.0
            while len(batch) < limit:
                try:
                    following = take_now()
                except queue.Empty:
                    if wait_s <= 0:
                        break
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + wait_s
                    if now >= deadline:
                        break
                    try:
                        following = take(timeout=deadline - now)
                    except queue.Empty:
                        break
                if following is _STOP or following.op is None:
                    carry = following
                    break
                batch.append(following)
            self._commit(batch)
            self._answer(batch)

    def _answer(self, requests: list[_Request]) -> None:
        loop = requests[0].loop
        if all(request.loop is loop for request in requests):
            groups = [(loop, requests)]
        else:
            by_loop: dict[asyncio.AbstractEventLoop, list[_Request]] = {}
            for request in requests:
                by_loop.setdefault(request.loop, []).append(request)
            groups = list(by_loop.items())
        for target, group in groups:
            try:
                target.call_soon_threadsafe(settle, group)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                pass

    def _run_work(self, request: _Request) -> None:
        assert request.work is not None
        try:
            request.result = self._call(request.work)
        except BaseException as error:
            request.error = error

    def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return work(self._connection())
        except sqlite3.Error as error:
            raise self._translate(error) from error

    def _commit(self, batch: list[_Request]) -> None:
        """Apply ``batch`` in arrival order inside one ``BEGIN IMMEDIATE`` transaction."""
        try:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                slots = self._transform(conn, batch)
                written = 0
                for decision_id, slot in slots.items():
                    if not slot.dirty:
                        continue
                    record = slot.record
                    assert record is not None
                    values = encode_row(decision_id, record)
                    slot.text = values[3]
                    if slot.exists:
                        conn.execute(_UPDATE_SQL, (*values[1:], decision_id))
                    else:
                        conn.execute(_INSERT_SQL, values)
                    written += 1
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as error:
            failure: BaseException = self._translate(error)
            failure.__cause__ = error
            self._fail(batch, failure)
            return
        except Exception as error:
            self._fail(batch, error)
            return
        if written:
            self.commits += 1
            self.committed_ops += len(batch)
            for decision_id, slot in slots.items():
                if slot.dirty and slot.record is not None:
                    self._decoded.remember(decision_id, slot.text, slot.record)

    def _transform(self, conn: sqlite3.Connection, batch: list[_Request]) -> dict[str, _Slot]:
        slots: dict[str, _Slot] = {}
        for request in batch:
            if request.future.cancelled():
                # Its caller gave up before the batch started: don't apply it (a claim
                # nobody awaits would only leave a lease nobody holds). Read across
                # threads, so a cancel that races with this check still applies.
                continue
            decision_id = request.decision_id
            slot = slots.get(decision_id)
            if slot is None:
                row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
                if row is None:
                    slot = _Slot(False, None)
                else:
                    slot = _Slot(True, None)
                    try:
                        slot.record = self._decoded.decode(decision_id, row[0])
                    except LedgerCorruptError as error:
                        slot.error = error
                slots[decision_id] = slot
            if slot.error is not None:
                request.error = copy_error(slot.error)
                continue
            op = request.op
            assert op is not None
            try:
                transition = op(slot.record, self.now_ms())
            except Exception as error:  # a rule failure: this caller only, nothing stored
                request.error = error
                continue
            if transition.changed and transition.record is not None:
                slot.record = transition.record
                slot.dirty = True
            request.result = transition.result
        return slots

    def _fail(self, batch: list[_Request], error: BaseException) -> None:
        for index, request in enumerate(batch):
            request.error = error if index == 0 else copy_error(error)
            request.result = None

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

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        if self.create:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise LedgerUnavailableError(
                    f"create directory for sqlite ledger `{self.path}`: {error.strerror or error}"
                ) from error
        try:
            conn = connect_wal(
                self.path,
                busy_timeout_ms=self.busy_timeout_ms,
                synchronous=self.synchronous,
                create=self.create,
            )
        except sqlite3.OperationalError as error:
            if not self.create and not self.path.exists():
                raise StoreMissingError(
                    f"sqlite ledger `{self.path}` does not exist (nothing was created)"
                ) from error
            raise
        try:
            conn.execute(f"PRAGMA cache_size = {-int(self.cache_kib)}")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        migrations = load_migrations("flowdecision.ledger", "sqlite")
        newest = len(migrations)
        current = _user_version(conn)
        if self.version_at_open is None:
            self.version_at_open = current
        if current == newest:
            return
        if current > newest:
            raise self._newer(current, newest)
        if not self.create:
            self._refuse_unmigrated(conn, current, newest)
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = _user_version(conn)  # another process may have migrated meanwhile
            self.version_at_open = current
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

    def _refuse_unmigrated(self, conn: sqlite3.Connection, current: int, newest: int) -> None:
        """Opened with ``create=False``: report what is missing instead of migrating."""
        if current == 0:
            has_table = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (_TABLE,)
            ).fetchone()
            if has_table is None:
                raise StoreMissingError(
                    f"sqlite ledger `{self.path}` holds no flowdecision ledger "
                    "(nothing was created)"
                )
        raise LedgerSchemaError(
            f"sqlite ledger `{self.path}` has schema version {current}, older than version "
            f"{newest} this flowdecision needs: run `flowdecision migrate` against it first"
        )

    def _newer(self, found: int, newest: int) -> LedgerSchemaError:
        return LedgerSchemaError(
            f"sqlite ledger `{self.path}` has schema version {found}, newer than version "
            f"{newest} that this flowdecision supports; upgrade flowdecision to open it"
        )


def _user_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("PRAGMA user_version").fetchone()
    return int(row[0]) if row else 0
