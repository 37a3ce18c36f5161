"""The embedded default ledger: one SQLite database file, safe across processes.

A thin dialect adapter over :mod:`flowdecision.store`, which owns the
connection thread with group commit, opening (WAL, ``0600`` files), error
translation and migrations. What is the ledger's own:

* a mutation loads the row, applies the pure transition and writes the row
  back when it changed; a batch (group commit, on by default) applies its
  mutations in arrival order, each on the record as the previous ones left
  it, and a transition that raises (a rule failure) stores nothing and fails
  only its own caller;
* decoded records are remembered per decision id together with their stored
  text; a row whose text is byte-identical is not decoded and validated again;
* prune deletes (or turns into tombstones) in batches of short transactions;
* operator queries read indexes (``created_at_ms``, ``status``, ``run_id``,
  schema 2) in keyset order; an operator action and its audit row share one
  ``BEGIN IMMEDIATE`` transaction.

The schema migrates when the ledger opens (SQLite's policy, see
:mod:`flowdecision.store.migrations`).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..connections.closing import started
from ..core.defaults import (
    DEFAULT_STORE_PATH,
    MAX_BATCH,
    MAX_WAIT_MS,
    SQLITE_BUSY_TIMEOUT_MS,
    SQLITE_CACHE_KIB,
    SQLITE_CHECKPOINT_BACKSTOP_PAGES,
    SQLITE_CHECKPOINT_INTERVAL_MS,
    SQLITE_INLINE_MAX_MS,
    SQLITE_SYNCHRONOUS,
    default_ledger_path,
)
from ..errors import LedgerCorruptError, LedgerError
from ..store.batching import check_group_commit, copy_error
from ..store.checkpoint import Checkpointer
from ..store.joint import JointRow, StoreKey, sqlite_insert_rows, sqlite_key
from ..store.migrations import sqlite_schema_version
from ..store.sqlite import SqliteOpener
from ..store.sqlite_thread import Job, SqliteThread
from ..store.transactions import sqlite_transaction
from .base import HoldOperation, JointOperation, Operation, PruneMode, PruneProgress, RunBound
from .machine import ClaimRecord, Creation, Transition, tombstone_of
from .rows import (
    AUDIT_INSERTED,
    AUDIT_TABLE,
    I64_MAX,
    LAST_AUDIT_HASH_SQL,
    LEDGER,
    RUNS_COLUMNS,
    RUNS_TABLE,
    TABLE,
    DecodedRecords,
    audit_values,
    creation_values,
    encode_row,
    run_of,
    run_values,
)
from .sqlgen import SqlLedger
from .states import Acted, AuditEntry, Claimed, JointOutcome, RunState

__all__ = [
    "DEFAULT_SQLITE_PATH",
    "SCHEMA_VERSION",
    "SqliteLedger",
    "Synchronous",
]

T = TypeVar("T")
R = TypeVar("R")

#: The one-file layout's store (``flowdecision.core.defaults.DEFAULT_STORE_PATH``).
#: ``SqliteLedger()`` without a path resolves
#: :func:`~flowdecision.core.defaults.default_ledger_path`
#: instead: this file, unless the directory holds only the old ``ledger.db``.
DEFAULT_SQLITE_PATH = DEFAULT_STORE_PATH

#: ``synchronous`` settings accepted; FULL makes every commit durable on power loss.
Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]

_PRUNE_BATCH = 1000

_SELECT_SQL = f"SELECT record, traceparent FROM {TABLE} WHERE decision_id = ?"
#: Ids per ``IN (...)`` read (well under SQLite's bound on parameters, 999 before 3.32).
_READ_CHUNK = 500
#: Rows per multi-row write (8 parameters each: under the bound of 999 before 3.32).
_WRITE_CHUNK = 120
#: Writes the rows a batch changed, new or not, with one statement per chunk: on the
#: ledger's thread every statement releases the GIL and takes it back. Side data is
#: never erased by a later write (a record read without it keeps it); the creation
#: columns are written by the insert only (an update keeps the first claim's).
_UPSERT_SQL = (
    f"INSERT INTO {TABLE} (decision_id, status, completed_at_ms, record, traceparent, "
    "created_at_ms, run_id, causation_event_id) "
    "VALUES {rows} ON CONFLICT (decision_id) DO UPDATE SET status = excluded.status, "
    "completed_at_ms = excluded.completed_at_ms, record = excluded.record, "
    "traceparent = COALESCE(excluded.traceparent, traceparent)"
)

#: The one-row write (a lone mutation's), formatted once.
_UPSERT_ONE_SQL = _UPSERT_SQL.format(rows="(?, ?, ?, ?, ?, ?, ?, ?)")

#: An operator action's write (side data and creation columns stay as they are).
_ACT_UPDATE_SQL = (
    f"UPDATE {TABLE} SET status = ?, completed_at_ms = ?, record = ? WHERE decision_id = ?"
)

SCHEMA_VERSION = LEDGER.newest("sqlite")

_RUN_SELECT_SQL = f"SELECT {RUNS_COLUMNS} FROM {RUNS_TABLE} WHERE run_id = ?"
#: A run's row after the transition that changed it (a reserve or a close).
_RUN_UPSERT_SQL = (
    f"INSERT INTO {RUNS_TABLE} ({RUNS_COLUMNS}) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id) DO UPDATE SET terminal_decision_id = excluded.terminal_decision_id, "
    "terminal_kind = excluded.terminal_kind, "
    "terminal_claimed_at_ms = excluded.terminal_claimed_at_ms, "
    "closed_at_ms = excluded.closed_at_ms"
)


def _run_id_of(op: Any) -> str | None:
    """The run whose record a queued operation needs (run invariants), or None."""
    if isinstance(op, RunBound):
        return op.run_id
    if isinstance(op, JointOperation):
        return op.run_id
    return None


class _RunSlot:
    """One run's record while a batch is being applied."""

    __slots__ = ("dirty", "run")

    def __init__(self, run: RunState | None) -> None:
        self.run = run
        self.dirty = False


class _Slot:
    """One decision's row while a batch is being applied."""

    __slots__ = ("created", "dirty", "error", "exists", "record", "text")

    def __init__(self, exists: bool, record: ClaimRecord | None) -> None:
        self.exists = exists
        self.record = record
        self.dirty = False
        self.text = ""
        self.error: BaseException | None = None
        self.created: Creation | None = None


class SqliteLedger(SqlLedger):
    """Claim ledger in one SQLite file (``serve``'s default: ``./.flowdecision/flowdecision.db``,
    which also holds the outbox).

    Without a ``path`` it is the ledger ``serve`` and the CLI use in the working
    directory (:func:`flowdecision.core.defaults.default_ledger_path`): that shared
    file, or the old ``.flowdecision/ledger.db`` when the directory holds only
    the old two-file layout (so it is never replaced by a new, empty file).
    Every tuning default comes from :mod:`flowdecision.core.defaults`.

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

    ``inline_max_ms``: a lone mutation (nothing else asked for in the same
    event-loop iteration, nothing queued or committing) commits on the
    caller's event loop instead of the connection thread, saving two thread
    hand-offs, while such commits take at most this long (0: never; nor with a
    ``max_wait_ms``; see :mod:`flowdecision.store.sqlite_thread` for the
    trade-off).

    ``checkpoint_interval_ms``: the WAL is copied back into the database file
    (checkpointed) on a thread of its own, at most this often while commits
    come, instead of inside the commit that fills it (0: inside the commits,
    SQLite's default; a lone mutation's inline commit still checkpoints past
    SQLite's 1,000 pages; see :mod:`flowdecision.store.checkpoint`).

    ``keep_tombstones``: what :meth:`prune_completed` does when not told.
    ``run_invariants`` (default on): claims and completions that name their
    run keep the run rules (docs/PROTOCOL.md, "Runs"), in their transaction.
    """

    _style = "?"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        synchronous: Synchronous = SQLITE_SYNCHRONOUS,
        busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
        group_commit: bool = True,
        max_batch: int = MAX_BATCH,
        max_wait_ms: float = MAX_WAIT_MS,
        cache_kib: int = SQLITE_CACHE_KIB,
        inline_max_ms: float = SQLITE_INLINE_MAX_MS,
        checkpoint_interval_ms: float = SQLITE_CHECKPOINT_INTERVAL_MS,
        create: bool = True,
        keep_tombstones: bool = False,
        run_invariants: bool = True,
    ) -> None:
        sync = str(synchronous).upper()
        if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise LedgerError(
                f"sqlite ledger synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}"
            )
        if not 0 <= checkpoint_interval_ms < float("inf"):
            raise LedgerError(
                "sqlite ledger checkpoint_interval_ms must be 0 or more (milliseconds), "
                f"got {checkpoint_interval_ms!r}"
            )
        max_batch, max_wait_ms = check_group_commit(
            "sqlite ledger", max_batch, max_wait_ms, LedgerError
        )
        self.path = default_ledger_path() if path is None else Path(path)
        self.synchronous = sync
        self.busy_timeout_ms = busy_timeout_ms
        self.group_commit = bool(group_commit)
        self.max_batch = max_batch if self.group_commit else 1
        self.max_wait_ms = max_wait_ms if self.group_commit else 0.0
        self.cache_kib = cache_kib
        self.create = bool(create)
        self.keep_tombstones = bool(keep_tombstones)
        self.run_invariants = bool(run_invariants)
        self._opener = SqliteOpener(
            LEDGER,
            self.path,
            busy_timeout_ms=busy_timeout_ms,
            synchronous=sync,
            create=self.create,
            pragmas=(f"PRAGMA cache_size = {-int(cache_kib)}",),
            shared=inline_max_ms > 0,
        )
        self.inline_max_ms = float(inline_max_ms)
        self._thread = SqliteThread(
            self._opener,
            write_batch=self._write_batch,
            max_batch=self.max_batch,
            max_wait_ms=self.max_wait_ms,
            inline_max_ms=self.inline_max_ms,
            checkpoint_interval_ms=float(checkpoint_interval_ms),
            checkpoint_backstop_pages=SQLITE_CHECKPOINT_BACKSTOP_PAGES,
        )
        self._decoded = DecodedRecords(f"sqlite ledger `{self.path}`")
        self._store_key: StoreKey | None = None
        #: Transactions committed by this ledger's mutations and the operations in them.
        self.commits = 0
        self.committed_ops = 0

    @property
    def inline_commits(self) -> int:
        """Mutations committed alone on their caller's event loop (``inline_max_ms``)."""
        return self._thread.inline_commits

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The thread that checkpoints the WAL (None until opened, or with
        ``checkpoint_interval_ms=0``); its counters are for tests and benchmarks."""
        return self._thread.checkpointer

    @property
    def version_at_open(self) -> int | None:
        """The schema version found when the database was opened (before migrating)."""
        return self._opener.version_at_open

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> SqliteLedger:
        """Open (creating and migrating if needed) the database at ``path``.

        ``options`` are the constructor's keyword arguments.
        """
        return await started(cls(path, **options))

    async def start(self) -> SqliteLedger:
        """Open, create and migrate the database now instead of at first use."""
        await self._thread.run(lambda conn: None)
        return self

    async def schema_version(self) -> int:
        """The schema version stored in the database."""
        return await self._thread.run(lambda conn: sqlite_schema_version(conn, LEDGER))

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; returns ``(version_before, version_after)``.

        Opening migrates already; this reports what opening found, so an
        up-to-date ledger answers ``(n, n)``.
        """
        await self.start()
        assert self.version_at_open is not None
        return self.version_at_open, await self.schema_version()

    async def close(self) -> None:
        """Close the connection and stop the worker thread (after queued work)."""
        await self._thread.close()

    # -- primitives ---------------------------------------------------------

    def _apply(self, decision_id: str, op: Operation[T] | RunBound[T]) -> Coroutine[Any, Any, T]:
        # The thread's own coroutine, not one awaiting it: a frame less on every resume.
        return self._thread.apply((decision_id, op))

    async def _read_run(self, run_id: str) -> RunState | None:
        def work(conn: sqlite3.Connection) -> RunState | None:
            row = conn.execute(_RUN_SELECT_SQL, (run_id,)).fetchone()
            return None if row is None else run_of(row)

        return await self._thread.run(work)

    def store_key(self) -> StoreKey:
        """The database file: an outbox in the same file joins this ledger's transactions."""
        if self._store_key is None:  # resolved once: it is checked on every joint call
            self._store_key = sqlite_key(self.path)
        return self._store_key

    def _apply_joint(
        self, decision_id: str, joint: JointOperation
    ) -> Coroutine[Any, Any, JointOutcome]:
        # Queued like any mutation: it shares its batch's BEGIN IMMEDIATE ... COMMIT.
        # (The thread's own coroutine, as for _apply: a frame less on every resume.)
        return self._thread.apply((decision_id, joint))

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        def work(conn: sqlite3.Connection) -> ClaimRecord | None:
            row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
            return None if row is None else self._decoded.decode(decision_id, row[0], row[1])

        return await self._thread.run(work)

    async def _prune(self, before_ms: int, progress: PruneProgress | None, mode: PruneMode) -> int:
        status = "tombstone" if mode is PruneMode.TOMBSTONES else "completed"
        select = (
            f"SELECT rowid, decision_id, record FROM {TABLE} "
            "WHERE status = ? AND completed_at_ms < ? LIMIT ?"
        )

        def batch(conn: sqlite3.Connection) -> int:
            # Exact for every row below the clamp; rows at the clamp are re-checked.
            with sqlite_transaction(conn):
                if mode is not PruneMode.TOMBSTONE:
                    cursor = conn.execute(
                        f"DELETE FROM {TABLE} WHERE rowid IN ("
                        f"SELECT rowid FROM {TABLE} WHERE status = ? AND completed_at_ms < ? "
                        "LIMIT ?)",
                        (status, min(before_ms, I64_MAX), _PRUNE_BATCH),
                    )
                    return cursor.rowcount
                rows = conn.execute(
                    select, (status, min(before_ms, I64_MAX), _PRUNE_BATCH)
                ).fetchall()
                self._bury(conn, [(rowid, key, text) for rowid, key, text in rows])
            return len(rows)

        def clamped(conn: sqlite3.Connection) -> int:
            with sqlite_transaction(conn):
                rows = conn.execute(
                    f"SELECT rowid, decision_id, record FROM {TABLE} "
                    "WHERE status = ? AND completed_at_ms = ?",
                    (status, I64_MAX),
                ).fetchall()
                doomed = [
                    (rowid, key, text)
                    for rowid, key, text in rows
                    if mode.selects(self._decoded.decode(key, text), before_ms)
                ]
                if mode is PruneMode.TOMBSTONE:
                    self._bury(conn, doomed)
                else:
                    conn.executemany(
                        f"DELETE FROM {TABLE} WHERE rowid = ?", [(row[0],) for row in doomed]
                    )
            return len(doomed)

        total = 0
        while True:
            done = await self._thread.run(batch)
            total += done
            if progress is not None:
                progress(total)
            if done < _PRUNE_BATCH:
                break
        if before_ms > I64_MAX:
            total += await self._thread.run(clamped)
            if progress is not None:
                progress(total)
        return total

    def _bury(self, conn: sqlite3.Connection, rows: list[tuple[int, str, str]]) -> None:
        """Replace completed records with their tombstones (in the caller's transaction)."""
        updates = []
        for rowid, key, text in rows:
            values = encode_row(key, tombstone_of(self._decoded.decode(key, text)))
            updates.append((*values[1:4], rowid))
        conn.executemany(
            f"UPDATE {TABLE} SET status = ?, completed_at_ms = ?, record = ? WHERE rowid = ?",
            updates,
        )

    # -- operator actions and queries -------------------------------------------------

    async def _act(self, decision_id: str, op: Operation[AuditEntry]) -> AuditEntry:
        def work(conn: sqlite3.Connection) -> AuditEntry:
            with sqlite_transaction(conn):
                row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
                record = None if row is None else self._decoded.decode(decision_id, *row)
                transition = op(record, self.now_ms())
                if transition.record is None:
                    conn.execute(f"DELETE FROM {TABLE} WHERE decision_id = ?", (decision_id,))
                else:
                    conn.execute(
                        _ACT_UPDATE_SQL,
                        (*encode_row(decision_id, transition.record)[1:4], decision_id),
                    )
                return _append_audit(conn, transition.result)

        return await self._thread.run(work)

    async def _act_on_hold(self, decision_id: str, op: HoldOperation) -> Acted:
        def work(conn: sqlite3.Connection) -> Acted:
            with sqlite_transaction(conn):
                row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
                record = None if row is None else self._decoded.decode(decision_id, *row)
                run = None
                if op.run_id is not None:
                    found = conn.execute(_RUN_SELECT_SQL, (op.run_id,)).fetchone()
                    run = None if found is None else run_of(found)
                applied = op.apply(record, run, self.now_ms())
                acted = applied.acted
                if op.row is not None and applied.row_attempt is not None:
                    # The joint path: the approval's claim, the row and the completion commit
                    # together (a refused row raises: the transaction rolls back).
                    (done,) = sqlite_insert_rows(conn, [(op.row, applied.row_attempt)])
                    if isinstance(done, BaseException):
                        raise done
                    acted = dataclasses.replace(acted, inserted=done)
                if applied.record is not None:
                    values = encode_row(decision_id, applied.record)
                    conn.execute(_ACT_UPDATE_SQL, (*values[1:4], decision_id))
                if applied.run is not None:
                    conn.execute(_RUN_UPSERT_SQL, run_values(applied.run))
                if acted.entry is not None:
                    acted = dataclasses.replace(acted, entry=_append_audit(conn, acted.entry))
            return acted

        return await self._thread.run(work)

    async def _select(self, sql: str, params: list[Any], convert: Callable[[Any], R]) -> list[R]:
        def work(conn: sqlite3.Connection) -> list[R]:
            return [convert(found) for found in conn.execute(sql, params).fetchall()]

        return await self._thread.run(work)

    # -- group commit (on the connection thread) -----------------------------------

    def _write_batch(self, conn: sqlite3.Connection, jobs: list[Job]) -> Callable[[], None] | None:
        """Apply ``jobs`` in arrival order and write the rows they changed."""
        if len(jobs) == 1 and not isinstance(jobs[0].payload[1], JointOperation):
            return self._write_lone(conn, jobs[0])
        slots, runs = self._transform(conn, jobs)
        for run_slot in runs.values():
            if run_slot.dirty:
                assert run_slot.run is not None
                conn.execute(_RUN_UPSERT_SQL, run_values(run_slot.run))
        now = self.now_ms()
        rows: list[Any] = []
        for decision_id, slot in slots.items():
            if not slot.dirty:
                continue
            record = slot.record
            assert record is not None
            values = _row_values(decision_id, record, slot.created, now)
            slot.text = values[3]
            rows.append(values)
        if not rows:
            return None
        if len(rows) == 1:
            conn.execute(_UPSERT_ONE_SQL, rows[0])
        else:
            for start in range(0, len(rows), _WRITE_CHUNK):
                chunk = rows[start : start + _WRITE_CHUNK]
                marks = ",".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
                conn.execute(_UPSERT_SQL.format(rows=marks), [v for row in chunk for v in row])

        def committed() -> None:
            self.commits += 1
            self.committed_ops += len(jobs)
            for decision_id, slot in slots.items():
                if slot.dirty and slot.record is not None:
                    self._decoded.remember(decision_id, slot.text, slot.record)

        return committed

    def _write_lone(self, conn: sqlite3.Connection, job: Job) -> Callable[[], None] | None:
        """One mutation alone (not a joint one): the single caller's cycle, and every
        commit of a ledger nobody else is writing to. The batch's rules, without the
        bookkeeping a batch needs to let several jobs change one row or run."""
        decision_id, op = job.payload
        # A database error here fails the transaction, as in a batch (SqliteThread
        # translates it); only a corrupt row or a rule failure answers the caller alone.
        row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
        run = None
        if isinstance(op, RunBound):
            found = conn.execute(_RUN_SELECT_SQL, (op.run_id,)).fetchone()
            run = None if found is None else run_of(found)
        now = self.now_ms()
        try:
            record = None if row is None else self._decoded.decode(decision_id, row[0], row[1])
            transition = _rule(op, record, run, now)
        except Exception as error:  # nothing stored
            job.error = error
            return None
        job.result = transition.result
        if transition.run is not None:
            conn.execute(_RUN_UPSERT_SQL, run_values(transition.run))
        changed = transition.record
        if not transition.changed or changed is None:
            return None
        values = _row_values(decision_id, changed, transition.created, now)
        conn.execute(_UPSERT_ONE_SQL, values)
        text = values[3]

        def committed() -> None:
            self.commits += 1
            self.committed_ops += 1
            self._decoded.remember(decision_id, text, changed)

        return committed

    def _transform(
        self, conn: sqlite3.Connection, jobs: list[Job]
    ) -> tuple[dict[str, _Slot], dict[str, _RunSlot]]:
        slots: dict[str, _Slot] = {}
        stored: dict[str, tuple[Any, str | None]]
        runs: dict[str, _RunSlot] = {}
        if len(jobs) == 1:
            # A lone caller (the single-caller cycle): one plain keyed read.
            decision_id, only = jobs[0].payload
            row = conn.execute(_SELECT_SQL, (decision_id,)).fetchone()
            stored = {} if row is None else {decision_id: (row[0], row[1])}
            run_id = _run_id_of(only)
            if run_id is not None:
                found = conn.execute(_RUN_SELECT_SQL, (run_id,)).fetchone()
                runs[run_id] = _RunSlot(None if found is None else run_of(found))
        else:
            stored = _read_rows(conn, {job.payload[0] for job in jobs})
            run_ids = {run_id for job in jobs if (run_id := _run_id_of(job.payload[1]))}
            if run_ids:
                runs = _read_runs(conn, run_ids)
        # Joint rows wait to be written together (store.joint: one statement), until
        # the batch ends or another job for one of their decisions comes (it must see
        # the row's outcome: a refused row leaves its decision as it was).
        deferred: list[_Deferred] = []
        deferred_ids: set[str] = set()  # decisions and runs a deferred row may restore
        for job in jobs:
            decision_id, op = job.payload
            run_id = _run_id_of(op)
            if decision_id in deferred_ids or (run_id is not None and run_id in deferred_ids):
                _write_deferred(conn, deferred)
                deferred, deferred_ids = [], set()
            slot = slots.get(decision_id)
            if slot is None:
                if decision_id not in stored:
                    slot = _Slot(False, None)
                else:
                    slot = _Slot(True, None)
                    try:
                        slot.record = self._decoded.decode(decision_id, *stored[decision_id])
                    except LedgerCorruptError as error:
                        slot.error = error
                slots[decision_id] = slot
            if slot.error is not None:
                job.error = copy_error(slot.error)
                continue
            claimed: Claimed | None = None
            run_slot = None if run_id is None else runs[run_id]
            run = None if run_slot is None else run_slot.run
            try:
                if isinstance(op, JointOperation):
                    transition, claimed = _claim_and_complete(op, slot.record, run, self.now_ms())
                else:
                    transition = _rule(op, slot.record, run, self.now_ms())
            except Exception as error:  # a rule failure: this caller only, nothing stored
                job.error = error
                continue
            if claimed is not None:
                assert isinstance(op, JointOperation)
                deferred.append(_Deferred(job, op.row, claimed, slot, run_slot))
                deferred_ids.add(decision_id)
                if transition.run is not None and run_id is not None:
                    # One set for both kinds of id: a run id equal to some decision id
                    # only writes the deferred rows a little early.
                    deferred_ids.add(run_id)
            if transition.run is not None:
                assert run_slot is not None
                run_slot.run = transition.run
                run_slot.dirty = True
            if transition.changed and transition.record is not None:
                slot.record = transition.record
                slot.dirty = True
                if transition.created is not None:
                    slot.created = transition.created
            job.result = transition.result
        _write_deferred(conn, deferred)
        return slots, runs


def _rule(
    op: Operation[Any] | RunBound[Any], record: ClaimRecord | None, run: RunState | None, now: int
) -> Transition[Any]:
    """``op``'s transition of ``record`` (and, under run invariants, of its ``run``)."""
    if isinstance(op, RunBound):
        return op.op(record, run, now)
    return op(record, now)


def _row_values(
    decision_id: str, record: ClaimRecord, created: Creation | None, now: int
) -> tuple[Any, ...]:
    """An upsert's values: the row (``[3]`` is the record's text), then its creation."""
    return (*encode_row(decision_id, record), *creation_values(created, now))


def _append_audit(conn: sqlite3.Connection, entry: AuditEntry) -> AuditEntry:
    """Chain ``entry`` to the audit trail and append it, in the caller's transaction
    (under the write lock: the last row is the one this entry follows)."""
    last = conn.execute(LAST_AUDIT_HASH_SQL).fetchone()
    chained = entry.chained(None if last is None else last[0])
    seq = conn.execute(
        f"INSERT INTO {AUDIT_TABLE} ({AUDIT_INSERTED}) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
        audit_values(chained),
    ).fetchone()[0]
    return dataclasses.replace(chained, seq=int(seq))


def _claim_and_complete(
    joint: JointOperation, record: ClaimRecord | None, run: RunState | None, clock: int
) -> tuple[Transition[Any], Claimed | None]:
    """The claim and, if claimed, the completion rules, before the joint row is written.

    The rules are pure: a completion rule failure raises before anything is
    written. With ``Claimed``, the transition's result is left for the row's
    write (:func:`_write_deferred`) to fill in.
    """
    claimed = joint.claim(record, run, clock)
    outcome = claimed.result
    if not isinstance(outcome, Claimed):
        # Busy / Conflict / AlreadyCompleted / RunClosed: no row, as claim() answers.
        # (A new held decision is stored, with its creation.)
        result = JointOutcome(outcome)
        return Transition(claimed.record, result, claimed.changed, claimed.created), None
    completed = joint.complete(claimed.record, claimed.run or run, clock)
    closed = completed.run or claimed.run
    return Transition(completed.record, None, True, claimed.created, closed), outcome


class _Deferred:
    """A claimed and completed joint decision whose row is not written yet."""

    __slots__ = ("before", "claimed", "job", "row", "run_before", "run_slot", "slot")

    def __init__(
        self, job: Job, row: JointRow, claimed: Claimed, slot: _Slot, run_slot: _RunSlot | None
    ) -> None:
        self.job = job
        self.row = row
        self.claimed = claimed
        self.slot = slot
        #: The slots as they were before this decision's transition (restored if refused).
        self.before = (slot.record, slot.dirty, slot.created)
        self.run_slot = run_slot
        self.run_before = None if run_slot is None else (run_slot.run, run_slot.dirty)


def _write_deferred(conn: sqlite3.Connection, deferred: list[_Deferred]) -> None:
    """Write the deferred joint rows: the store's one insert-if-absent for them all.

    A refused row answers its caller with the refusal (nothing was written for
    it) and restores its decision and run as they were before its transition.
    A :class:`sqlite3.Error` (the database failing) fails the whole batch.
    """
    if not deferred:
        return
    done = sqlite_insert_rows(conn, [(entry.row, entry.claimed.attempt) for entry in deferred])
    for entry, did in zip(deferred, done, strict=True):
        if isinstance(did, BaseException):
            entry.job.error = did
            entry.job.result = None
            entry.slot.record, entry.slot.dirty, entry.slot.created = entry.before
            if entry.run_slot is not None and entry.run_before is not None:
                entry.run_slot.run, entry.run_slot.dirty = entry.run_before
        else:
            entry.job.result = JointOutcome(entry.claimed, did)


def _read_rows(
    conn: sqlite3.Connection, decision_ids: set[str]
) -> dict[str, tuple[Any, str | None]]:
    """The stored ``(record, traceparent)`` of each of ``decision_ids`` that has a row.

    One statement per :data:`_READ_CHUNK` ids instead of one per decision: on
    the ledger's thread every statement releases the GIL and takes it back,
    and taking it back waits for the event loop's thread when it is busy.
    """
    found: dict[str, tuple[Any, str | None]] = {}
    ids = list(decision_ids)
    for start in range(0, len(ids), _READ_CHUNK):
        chunk = ids[start : start + _READ_CHUNK]
        marks = ",".join("?" * len(chunk))
        for decision_id, record, traceparent in conn.execute(
            f"SELECT decision_id, record, traceparent FROM {TABLE} WHERE decision_id IN ({marks})",
            chunk,
        ):
            found[decision_id] = (record, traceparent)
    return found


def _read_runs(conn: sqlite3.Connection, run_ids: set[str]) -> dict[str, _RunSlot]:
    """A slot for each of ``run_ids``: its stored record, or None (an open run)."""
    runs = {run_id: _RunSlot(None) for run_id in run_ids}
    ids = list(run_ids)
    for start in range(0, len(ids), _READ_CHUNK):
        chunk = ids[start : start + _READ_CHUNK]
        marks = ",".join("?" * len(chunk))
        for row in conn.execute(
            f"SELECT {RUNS_COLUMNS} FROM {RUNS_TABLE} WHERE run_id IN ({marks})", chunk
        ):
            runs[row[0]] = _RunSlot(run_of(row))
    return runs
