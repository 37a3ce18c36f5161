"""The multi-host ledger: PostgreSQL through an asyncpg connection pool.

Design:

* A mutation is an optimistic read-modify-write in two round trips and one
  (autocommit) write transaction: one statement reads the row together with
  the database clock, the pure transition runs in Python, and, only if the
  record changed, one statement writes it back **conditionally**: ``UPDATE ...
  WHERE decision_id = $1 AND record = <the text that was read>``, or
  ``INSERT ... ON CONFLICT DO NOTHING`` for a new id. If another writer got
  there first (the condition matched no row) nothing was written and the
  operation starts over on the new record; after a few such losses it falls
  back to a locking transaction (``SELECT ... FOR UPDATE``, apply, write,
  ``COMMIT``), so it always makes progress. Either way a transition is applied
  to exactly the record it replaces -- the same serial history as locking --
  and a transition that changes nothing (a busy claim, a refused renewal)
  costs one read and no commit.
* With ``now_ms=None`` the transition's clock is the **database's**
  ``clock_timestamp()``, read in the same statement as the record (or after
  the row lock in the locking path), so a host whose clock runs ahead cannot
  steal a live lease and a host whose clock runs behind cannot complete after
  expiry.
* **Group commit** (on by default): the mutations that are in flight together
  in one process are applied in one read and one write statement (``unnest``
  arrays), at most ``max_batch`` per batch and ``batch_concurrency`` batches
  at a time, optionally waiting ``max_wait_ms`` for a batch to fill. Each
  caller gets its own outcome only after the write committed (or, if its
  transition changed nothing, after the read). Operations on one id apply in
  arrival order on the evolving record; a transition that raises fails only
  its own caller. A lost condition retries only that id's operations.
* The schema version lives in ``flowdecision_schema_version``. Migrations in
  ``sql/postgres/NNNN_*.sql`` run only through :meth:`PostgresLedger.migrate`
  (``flowdecision migrate``), under an advisory lock; opening a database whose
  schema is older or newer than this code fails with :class:`LedgerSchemaError`
  (PostgreSQL's policy, see :mod:`flowdecision.store.migrations`).
* Prune deletes (or turns into tombstones) in batches, each its own short
  transaction. Operator queries read the schema-2 indexes in keyset order;
  an operator action locks its row and writes its audit row in one
  transaction, on the database clock.
* **Joint commits** (``joint_commit``, the transactional outbox) queue
  with the rest; a batch's joint ones share one locking transaction: existing
  records locked in id order, one clock read, claim and completion rules per
  decision, the joint rows through ``store.joint``'s ``pg_insert_rows`` (one
  insert; the outbox's advisory lock, held to the commit, keeps its ``seq``
  order = commit order), the ledger rows in one statement, ``COMMIT``. A new
  id another host created meanwhile rolls the batch back and retries it.

Pool setup, error translation, the clock SQL and the migration runner live in
:mod:`flowdecision.store`; this module is the ledger's dialect adapter.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from ..connections.closing import started
from ..connections.urls import describe_dsn
from ..core.defaults import (
    BATCH_CONCURRENCY,
    MAX_BATCH,
    MAX_WAIT_MS,
    PG_COMMAND_TIMEOUT_S,
    PG_CONNECT_TIMEOUT_S,
    PG_MAX_SIZE,
    PG_MIN_SIZE,
)
from ..errors import LedgerCorruptError, LedgerError, LedgerUnavailableError
from ..observability.tracing import active as tracing_active
from ..observability.tracing import batch_span, recording_span
from ..store.batching import check_group_commit, copy_error, settle
from ..store.chain import LEDGER_AUDIT_LOCK, pg_audit_lock_sql
from ..store.joint import JointRow, StoreKey, pg_insert_rows, postgres_key
from ..store.postgres import CLOCK_SQL, PgPool, retryable
from .base import (
    HoldOperation,
    JointOperation,
    Operation,
    PruneMode,
    PruneProgress,
    RunBound,
    wall_clock_ms,
)
from .machine import ClaimRecord, Creation, tombstone_of
from .rows import (
    AUDIT_INSERTED,
    AUDIT_TABLE,
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

__all__ = ["SCHEMA_VERSION", "PostgresLedger", "describe_dsn"]

T = TypeVar("T")
R = TypeVar("R")

SCHEMA_VERSION = LEDGER.newest("postgres")

_TABLE = TABLE
_PRUNE_BATCH = 1000
#: A row's values (:func:`encode_row`), and one to write: values, the text it must
#: replace (None: a new row) and, for a new row, its creation.
Values = tuple[str, str, int | None, str, str | None]
Row = tuple[Values, str | None, Creation | None]
_MAX_RETRIES = 20
#: Optimistic attempts per operation before it falls back to a locking transaction.
_CAS_ATTEMPTS = 4

_CLOCK = CLOCK_SQL

# Lock the row, then read the clock: the clock subquery depends on the locked
# CTE, so it is evaluated only after the row lock is granted.
_LOAD_SQL = f"""
WITH locked AS (
    SELECT record, traceparent FROM {_TABLE} WHERE decision_id = $1 FOR UPDATE
)
SELECT (SELECT record FROM locked) AS record,
       (SELECT {_CLOCK} FROM (SELECT count(*) FROM locked) AS after_lock) AS now_ms,
       (SELECT traceparent FROM locked) AS traceparent
"""
_INSERT_SQL = (
    f"INSERT INTO {_TABLE} (decision_id, status, completed_at_ms, record, traceparent, "
    "created_at_ms, run_id, causation_event_id) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (decision_id) DO NOTHING"
)
# Side data (traceparent) is never erased by a later write.
_UPDATE_SQL = (
    f"UPDATE {_TABLE} SET status = $2, completed_at_ms = $3, record = $4, "
    "traceparent = COALESCE($5, traceparent) WHERE decision_id = $1"
)
# The optimistic path: read record and clock in one statement; write conditionally.
_READ_ONE_SQL = (
    f"SELECT c.record, {_CLOCK} AS now_ms, c.traceparent FROM (VALUES (1)) AS one(x) "
    f"LEFT JOIN {_TABLE} AS c ON c.decision_id = $1"
)
_READ_MANY_SQL = f"""
SELECT d.decision_id, c.record, {_CLOCK} AS now_ms, c.traceparent
FROM unnest($1::text[]) AS d(decision_id)
LEFT JOIN {_TABLE} AS c ON c.decision_id = d.decision_id
"""
_CAS_UPDATE_SQL = (
    f"UPDATE {_TABLE} SET status = $2, completed_at_ms = $3, record = $4, "
    "traceparent = COALESCE($5, traceparent) WHERE decision_id = $1 AND record = $6"
)
# One statement (so one transaction) for a whole batch: new ids are inserted
# unless someone else did first, old ones are replaced only if still exactly as
# read. Returns the ids that were written.
_WRITE_MANY_SQL = f"""
WITH input AS (
    SELECT * FROM unnest(
        $1::text[], $2::text[], $3::numeric[], $4::text[], $5::text[], $6::text[],
        $7::bigint[], $8::text[], $9::text[]
    ) AS t(
        decision_id, status, completed_at_ms, record, traceparent, old_record,
        created_at_ms, run_id, causation_event_id
    )
), inserted AS (
    INSERT INTO {_TABLE} (
        decision_id, status, completed_at_ms, record, traceparent,
        created_at_ms, run_id, causation_event_id
    )
    SELECT decision_id, status, completed_at_ms, record, traceparent,
        created_at_ms, run_id, causation_event_id
    FROM input WHERE old_record IS NULL
    ON CONFLICT (decision_id) DO NOTHING
    RETURNING decision_id
), updated AS (
    UPDATE {_TABLE} AS c
    SET status = i.status, completed_at_ms = i.completed_at_ms, record = i.record,
        traceparent = COALESCE(i.traceparent, c.traceparent)
    FROM input AS i
    WHERE i.old_record IS NOT NULL AND c.decision_id = i.decision_id AND c.record = i.old_record
    RETURNING c.decision_id
)
SELECT decision_id FROM inserted UNION ALL SELECT decision_id FROM updated
"""
# The joint path locks the batch's existing rows (in id order, so two
# batches never deadlock on each other) for the whole transaction.
_LOCK_MANY_SQL = (
    f"SELECT decision_id, record, traceparent FROM {_TABLE} "
    "WHERE decision_id = ANY($1::text[]) ORDER BY decision_id FOR UPDATE"
)
_EXISTS_SQL = f"SELECT EXISTS (SELECT 1 FROM {_TABLE} WHERE decision_id = $1)"
_PRUNE_SQL = f"""
WITH doomed AS (
    SELECT decision_id FROM {_TABLE}
    WHERE status = $3 AND completed_at_ms < $1
    ORDER BY completed_at_ms
    LIMIT $2
    FOR UPDATE
)
DELETE FROM {_TABLE} AS c USING doomed WHERE c.decision_id = doomed.decision_id
"""
_BURY_SELECT_SQL = f"""
SELECT decision_id, record FROM {_TABLE}
WHERE status = 'completed' AND completed_at_ms < $1
ORDER BY completed_at_ms
LIMIT $2
FOR UPDATE
"""
_BURY_SQL = f"""
UPDATE {_TABLE} AS c SET status = t.status, completed_at_ms = t.completed_at_ms, record = t.record
FROM unnest($1::text[], $2::text[], $3::numeric[], $4::text[])
    AS t(decision_id, status, completed_at_ms, record)
WHERE c.decision_id = t.decision_id
"""
# The run invariants: a transaction-scoped advisory lock per run (in key order, so
# two transactions never deadlock on them), taken after the decision rows' locks
# and before the clock is read; it serializes the claims and completions of one
# run across hosts even while the run has no row. Two-key locks: a key space of
# their own (the outbox's lock is a one-key lock).
_RUN_LOCK_NAMESPACE = 0x666C6F77  # "flow"
_RUN_LOCK_SQL = (
    f"SELECT count(pg_advisory_xact_lock({_RUN_LOCK_NAMESPACE}, k)) FROM "
    "(SELECT DISTINCT hashtext(r) AS k FROM unnest($1::text[]) AS r ORDER BY k) AS keys"
)
# The runs' records and the clock in one statement (after the locks: a statement of
# its own, so that its snapshot sees what the locks' previous holders committed).
# One row at least: the clock, with the columns of each run found (NULL for none).
_RUN_READ_SQL = (
    f"SELECT {_CLOCK} AS now_ms, {', '.join(f'r.{c}' for c in RUNS_COLUMNS.split(', '))} "
    f"FROM (VALUES (1)) AS one(x) LEFT JOIN {RUNS_TABLE} AS r ON r.run_id = ANY($1::text[])"
)
_RUN_WRITE_SQL = f"""
INSERT INTO {RUNS_TABLE} ({RUNS_COLUMNS})
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[])
ON CONFLICT (run_id) DO UPDATE SET terminal_decision_id = excluded.terminal_decision_id,
    terminal_kind = excluded.terminal_kind,
    terminal_claimed_at_ms = excluded.terminal_claimed_at_ms,
    closed_at_ms = excluded.closed_at_ms
"""
_AUDIT_INSERT_SQL = (
    f"INSERT INTO {AUDIT_TABLE} ({AUDIT_INSERTED}) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING seq"
)


class PostgresLedger(SqlLedger):
    """Claim ledger in PostgreSQL, shared by any number of hosts.

    ``PostgresLedger(dsn)`` does no I/O: the pool is created, and the schema
    version checked, by the first operation or eagerly by :meth:`start` /
    ``await PostgresLedger.connect(dsn)``. :meth:`migrate` creates or upgrades
    the schema (it needs no prior :meth:`start`). ``run_invariants`` (default
    on): claims and completions that name their run keep the run rules
    (docs/PROTOCOL.md, "Runs") in a locking transaction with the run's lock.
    """

    _style = "$"

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = PG_MIN_SIZE,
        max_size: int = PG_MAX_SIZE,
        connect_timeout_s: float = PG_CONNECT_TIMEOUT_S,
        command_timeout_s: float | None = PG_COMMAND_TIMEOUT_S,
        group_commit: bool = True,
        max_batch: int = MAX_BATCH,
        max_wait_ms: float = MAX_WAIT_MS,
        batch_concurrency: int = BATCH_CONCURRENCY,
        keep_tombstones: bool = False,
        run_invariants: bool = True,
    ) -> None:
        max_batch, max_wait_ms = check_group_commit(
            "PostgreSQL ledger", max_batch, max_wait_ms, LedgerError
        )
        if batch_concurrency < 1:
            raise LedgerError(
                f"PostgreSQL ledger batch_concurrency must be >= 1, got {batch_concurrency!r}"
            )
        self._pg = PgPool(
            LEDGER,
            dsn,
            min_size=min_size,
            max_size=max_size,
            connect_timeout_s=connect_timeout_s,
            command_timeout_s=command_timeout_s,
        )
        self.dsn = dsn
        self.keep_tombstones = bool(keep_tombstones)
        self.run_invariants = bool(run_invariants)
        self.where = describe_dsn(dsn)
        self._store_key = postgres_key(dsn)
        self._closed = False
        self._clock_offset_ms = 0
        self.group_commit = bool(group_commit)
        self.max_batch = max_batch if self.group_commit else 1
        self.max_wait_ms = max_wait_ms if self.group_commit else 0.0
        self.batch_concurrency = batch_concurrency
        self._pending: collections.deque[_Item] = collections.deque()
        self._flushers: set[asyncio.Task[None]] = set()
        self._decoded = DecodedRecords(f"PostgreSQL ledger {self.where}")
        #: Write statements committed by this ledger's mutations and the operations in them.
        self.commits = 0
        self.committed_ops = 0

    @classmethod
    async def connect(cls, dsn: str, **options: Any) -> PostgresLedger:
        """Connect and verify the schema is current (see :meth:`migrate` otherwise)."""
        return await started(cls(dsn, **options))

    async def start(self) -> PostgresLedger:
        """Create the pool and check the schema version now instead of at first use."""
        await self._pg.ready()
        return self

    def now_ms(self) -> int:
        """This host's clock corrected by the database clock offset last observed.

        Mutations with a time of ``None`` never use this: they read
        ``clock_timestamp()`` inside their transaction. Use :meth:`db_now_ms`
        for the database clock itself.
        """
        return wall_clock_ms() + self._clock_offset_ms

    async def db_now_ms(self) -> int:
        """The database clock, in Unix-epoch milliseconds."""
        try:
            value = int(await self._pg.fetchval(f"SELECT {_CLOCK}"))
        except Exception as error:
            raise self._pg.translate(error) from error
        self._clock_offset_ms = value - wall_clock_ms()
        return value

    async def schema_version(self) -> int:
        """The schema version recorded in the database (0 if never migrated)."""
        return await self._pg.schema_version()

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; returns ``(version_before, version_after)``.

        Safe to run from several hosts at once (an advisory lock serializes
        them). Refuses a database whose schema is newer than this code.
        """
        return await self._pg.migrate()

    async def close(self) -> None:
        self._closed = True
        self._pg.closed = True
        flushers = list(self._flushers)
        if flushers:  # let batches already taken finish (their callers are waiting)
            await asyncio.gather(*flushers, return_exceptions=True)
        await self._pg.close()

    # -- primitives -----------------------------------------------------------

    def store_key(self) -> StoreKey:
        """The database: an outbox in it joins this ledger's transactions."""
        return self._store_key

    async def _apply_joint(self, decision_id: str, joint: JointOperation) -> JointOutcome:
        # Queued with every other mutation; _run_batch gives joint ones a transaction.
        return await self._apply(decision_id, joint)  # type: ignore[arg-type]

    async def _read_run(self, run_id: str) -> RunState | None:
        try:
            row = await self._pg.fetchrow(
                f"SELECT {RUNS_COLUMNS} FROM {RUNS_TABLE} WHERE run_id = $1", run_id
            )
        except Exception as error:
            raise self._pg.translate(error) from error
        return None if row is None else run_of(tuple(row))

    async def _apply(self, decision_id: str, op: Operation[T] | RunBound[T]) -> T:
        traced = tracing_active()
        if not self.group_commit:
            item = _Item(decision_id, op, None)
            if traced:
                item.trace = recording_span()
            await self._run_traced([item])
            if item.error is not None:
                raise item.error
            return item.result  # type: ignore[no-any-return]
        if self._closed:
            raise LedgerError(f"PostgreSQL ledger {self.where} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        item = _Item(decision_id, op, future)
        if traced:
            item.trace = recording_span()
        self._pending.append(item)
        if len(self._flushers) < self.batch_concurrency:
            task = loop.create_task(self._flush())
            self._flushers.add(task)
        if item.trace is None:
            return await future
        try:
            return await future
        finally:
            if item.batch is not None:  # this decision's span -> the batch that committed it
                item.trace.add_link(item.batch)

    async def _run_traced(self, items: list[_Item]) -> None:
        """:meth:`_run_batch`, as one ``flowdecision.ledger.commit`` span when traced."""
        traced = [item for item in items if item.trace is not None]
        if not traced:
            await self._run_batch(items)
            return
        with batch_span("ledger", "postgresql", len(items), traced):
            await self._run_batch(items)

    async def _flush(self) -> None:
        """Take batches off the queue until it is empty (one of ``batch_concurrency``)."""
        pending = self._pending
        batch: list[_Item] = []
        try:
            while True:
                if not pending:
                    # Leave the flusher set in the same step that sees the queue empty: a
                    # done-callback would run later, after the callers settle() just woke,
                    # and a caller enqueuing in between would find no live flusher.
                    self._flushers.discard(asyncio.current_task())  # type: ignore[arg-type, unused-ignore]
                    return
                if self.max_wait_ms > 0 and len(pending) < self.max_batch:
                    await asyncio.sleep(self.max_wait_ms / 1000)
                size = min(self.max_batch, len(pending))
                taken = [pending.popleft() for _ in range(size)]
                # Callers that gave up while queued are not applied (a claim nobody
                # awaits would only leave a lease nobody holds).
                batch = [item for item in taken if item.future is None or not item.future.done()]
                if not batch:
                    continue  # drained by another flusher meanwhile, or all cancelled
                await self._run_traced(batch)
                settle(batch)
                batch = []
        except BaseException as error:  # cancelled (loop closing): answer everyone left
            failure = LedgerUnavailableError(
                f"PostgreSQL ledger {self.where}: operation abandoned ({type(error).__name__})"
            )
            self._flushers.discard(asyncio.current_task())  # type: ignore[arg-type, unused-ignore]
            abandoned = list(batch)
            if not self._flushers:  # nobody else will drain the queue
                abandoned += [pending.popleft() for _ in range(len(pending))]
            for item in abandoned:
                if item.error is None and not item.done:
                    item.error = copy_error(failure)
            settle(abandoned)
            raise

    async def _run_batch(self, items: list[_Item]) -> None:
        """Apply ``items``; sets each item's result or error, never raises an Exception."""
        # Joint and run-bound operations take locking transactions (_run_joint).
        joint = [item for item in items if isinstance(item.op, JointOperation | RunBound)]
        if joint:
            await self._run_joint(joint)
            items = [item for item in items if not isinstance(item.op, JointOperation | RunBound)]
            if not items:
                return
        todo = items
        try:
            attempts = 0
            async with self._pg.connection() as conn:
                while todo and attempts < _CAS_ATTEMPTS:
                    attempts += 1
                    try:
                        todo = await self._attempt(conn, todo)
                    except Exception as error:
                        if not retryable(error):
                            raise
        except Exception as error:
            failure = self._pg.chained(error)
            for index, item in enumerate(todo):
                item.error = failure if index == 0 else copy_error(failure)
                item.done = True
            return
        # Ids that kept losing the race: one locking transaction per operation.
        for item in todo:
            try:
                item.result = await self._apply_locked(item.decision_id, _plain(item))
            except Exception as error:
                item.error = error
            item.done = True

    async def _attempt(self, conn: Any, todo: list[_Item]) -> list[_Item]:
        """One optimistic round: read, transform, write conditionally; return the losers."""
        groups: dict[str, list[_Item]] = {}
        for item in todo:
            group = groups.get(item.decision_id)
            if group is None:
                groups[item.decision_id] = [item]
            else:
                group.append(item)
        if len(groups) == 1:
            (only,) = groups
            row = await conn.fetchrow(_READ_ONE_SQL, only)
            rows: list[tuple[str, Any, Any, Any]] = [(only, row[0], row[1], row[2])]
        else:
            rows = [
                (r[0], r[1], r[2], r[3]) for r in await conn.fetch(_READ_MANY_SQL, list(groups))
            ]
        writes: list[tuple[Values, str | None, ClaimRecord, Creation | None]] = []
        outcomes: dict[str, list[tuple[Any, BaseException | None]]] = {}
        for decision_id, text, clock_value, trace in rows:
            group = groups[decision_id]
            clock = int(clock_value)
            self._clock_offset_ms = clock - wall_clock_ms()
            try:
                record = None if text is None else self._decoded.decode(decision_id, text, trace)
            except LedgerCorruptError as error:
                for item in group:
                    item.error = copy_error(error)
                    item.done = True
                continue
            results: list[tuple[Any, BaseException | None]] = []
            changed = False
            created: Creation | None = None
            for item in group:
                try:
                    transition = _plain(item)(record, clock)
                except Exception as error:  # a rule failure: this caller only, nothing stored
                    results.append((None, error))
                    continue
                if transition.changed and transition.record is not None:
                    record = transition.record
                    changed = True
                    created = transition.created or created
                results.append((transition.result, None))
            if changed and record is not None:
                values = encode_row(decision_id, record, index_max=None)
                writes.append((values, text, record, created))
                outcomes[decision_id] = results
            else:
                _finish(group, results)
        if not writes:
            return []
        if len(writes) == 1:
            values, old, _, created = writes[0]
            if old is None:
                origin = creation_values(created, self._clock_offset_ms + wall_clock_ms())
                status = await conn.execute(_INSERT_SQL, *values, *origin)
            else:
                status = await conn.execute(_CAS_UPDATE_SQL, *values, old)
            written = {values[0]} if status.endswith(" 1") else set()
        else:
            written = await self._write_many(
                conn, [(values, old, created) for values, old, _, created in writes]
            )
        if written:
            self.commits += 1
        losers: list[_Item] = []
        for values, _, record, _created in writes:
            decision_id = values[0]
            if decision_id in written:
                self.committed_ops += len(groups[decision_id])
                self._decoded.remember(decision_id, values[3], record)
                _finish(groups[decision_id], outcomes[decision_id])
            else:
                losers.extend(groups[decision_id])
        return losers

    async def _write_many(
        self,
        conn: Any,
        writes: list[Row],
    ) -> set[str]:
        """Insert new rows and conditionally update old ones in one statement; ids written."""
        now = self.now_ms()
        columns: list[list[Any]] = [[], [], [], [], [], [], [], [], []]
        for values, old, created in writes:
            row = (*values, old, *creation_values(created, now))
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        return {r[0] for r in await conn.fetch(_WRITE_MANY_SQL, *columns)}

    # -- the joint path (claim, a joint row, complete: one commit) --------------------

    async def _run_joint(self, items: list[_Item]) -> None:
        """Apply joint and run-bound operations, a batch per transaction; never raises
        an Exception.

        A transaction takes at most one operation per decision id, and nothing of
        a run after an operation that may change the run's record (a terminal
        decision's: its joint row may still be refused); what comes after goes
        into the next transaction and sees the first's outcome (typically
        ``AlreadyCompleted``, or the run closed).
        """
        todo = items
        while todo:
            now: list[_Item] = []
            later: list[_Item] = []
            seen: set[str] = set()
            closing: set[str] = set()  # runs a terminal operation of this round may change
            for item in todo:
                run_id = _run_of(item)
                if item.decision_id in seen or run_id in closing:
                    later.append(item)
                else:
                    now.append(item)
                    op = item.op
                    if isinstance(op, RunBound | JointOperation) and op.closes and run_id:
                        closing.add(run_id)
                seen.add(item.decision_id)
            await self._joint_round(now)
            todo = later

    async def _joint_round(self, items: list[_Item]) -> None:
        try:
            for _ in range(_MAX_RETRIES):
                for item in items:
                    item.result, item.error = None, None
                try:
                    async with self._pg.connection() as conn, conn.transaction():
                        committed = await self._joint_transaction(conn, items)
                except _LostInsert:
                    continue  # another host created one of these ids meanwhile: start over
                except Exception as error:
                    if retryable(error):
                        continue
                    raise
                committed()
                break
            else:
                raise LedgerUnavailableError(
                    f"PostgreSQL ledger {self.where}: a joint batch kept "
                    f"losing races ({_MAX_RETRIES} attempts)"
                )
        except Exception as error:
            failure = self._pg.chained(error)
            for index, item in enumerate(items):
                item.error = failure if index == 0 else copy_error(failure)
                item.result = None
        for item in items:
            item.done = True

    async def _joint_transaction(self, conn: Any, items: list[_Item]) -> Any:
        """One transaction's work (distinct ids); returns what to do once it committed.

        Order: per decision the claim rules on the locked record and, if claimed,
        the completion rules on the claimed record (pure); then the claimed
        decisions' joint rows, for the whole batch at once (``pg_insert_rows``:
        under the outbox's advisory lock, held until this transaction commits, so
        ``seq`` order is commit order); finally the ledger rows, in one statement.
        A refused row or a rule failure answers only its own caller and writes
        nothing for it; a database error fails the batch.
        """
        locked = await conn.fetch(_LOCK_MANY_SQL, [item.decision_id for item in items])
        stored = {row[0]: row[1] for row in locked}
        traces = {row[0]: row[2] for row in locked}
        run_ids = sorted({r for item in items if (r := _run_of(item)) is not None})
        runs: dict[str, RunState | None] = {}
        if run_ids:
            await conn.fetchval(_RUN_LOCK_SQL, run_ids)
            runs = dict.fromkeys(run_ids)
            found = await conn.fetch(_RUN_READ_SQL, run_ids)
            clock = int(found[0][0])
            for row in found:
                if row[1] is not None:
                    runs[row[1]] = run_of(tuple(row)[1:])
        else:
            clock = int(await conn.fetchval(f"SELECT {_CLOCK}"))
        self._clock_offset_ms = clock - wall_clock_ms()
        rows: list[tuple[_Item, ClaimRecord, Creation | None]] = []  # ledger rows to write
        # (a terminal operation is the last of its run here: see _run_joint)
        changed_runs: dict[str, RunState] = {}
        # waiting for their joint row
        joined: list[tuple[_Item, Claimed, ClaimRecord, Creation | None, RunState | None]] = []
        for item in items:
            op = item.op
            run_id = _run_of(item)
            run = None if run_id is None else runs[run_id]
            try:
                text = stored.get(item.decision_id)
                record = (
                    None
                    if text is None
                    else self._decoded.decode(item.decision_id, text, traces[item.decision_id])
                )
                if isinstance(op, RunBound):
                    applied = op.op(record, run, clock)
                    item.result = applied.result
                    if applied.changed and applied.record is not None:
                        rows.append((item, applied.record, applied.created))
                    if applied.run is not None and run_id is not None:
                        runs[run_id] = changed_runs[run_id] = applied.run
                    continue
                joint: JointOperation = op  # type: ignore[assignment]
                claimed = joint.claim(record, run, clock)
                outcome = claimed.result
                if not isinstance(outcome, Claimed):
                    item.result = JointOutcome(outcome)
                    if claimed.changed and claimed.record is not None:
                        # (a new held decision is stored, with its creation)
                        rows.append((item, claimed.record, claimed.created))
                    continue
                completed = joint.complete(claimed.record, claimed.run or run, clock)
            except Exception as error:  # a rule failure: this caller only
                item.error = error
                item.result = None
                continue
            assert completed.record is not None
            closed = completed.run or claimed.run
            joined.append((item, outcome, completed.record, claimed.created, closed))
        done = await pg_insert_rows(
            conn, [(_row_of(item), taken.attempt) for item, taken, *_ in joined]
        )
        for (item, taken, record, created, closed), did in zip(joined, done, strict=True):
            if (
                isinstance(did, BaseException)
                and item.decision_id not in stored
                and await conn.fetchval(_EXISTS_SQL, item.decision_id)
            ):
                # Another transaction created this id (its claim and its row) after
                # our read and has committed: start over, the claim rules then
                # answer (Conflict, AlreadyCompleted) instead of the row's refusal.
                raise _LostInsert
            if isinstance(did, BaseException):
                item.error = did
            else:
                item.result = JointOutcome(taken, did)
                rows.append((item, record, created))
                if closed is not None:
                    changed_runs[closed.run_id] = closed
        if changed_runs:
            columns: list[list[Any]] = [[], [], [], [], []]
            for changed in changed_runs.values():
                for column, value in zip(columns, run_values(changed), strict=True):
                    column.append(value)
            await conn.execute(_RUN_WRITE_SQL, *columns)
        return await self._write_joint_rows(conn, rows, stored)

    async def _write_joint_rows(
        self,
        conn: Any,
        rows: list[tuple[_Item, ClaimRecord, Creation | None]],
        stored: dict[str, str],
    ) -> Any:
        encoded = [
            (encode_row(item.decision_id, record, index_max=None), record, created)
            for item, record, created in rows
        ]
        if encoded:
            written = await self._write_many(
                conn,
                [(values, stored.get(values[0]), created) for values, _, created in encoded],
            )
            if len(written) < len(encoded):
                raise _LostInsert  # an id we saw as new was inserted by another host

        def committed() -> None:
            if encoded:
                self.commits += 1
            self.committed_ops += len(encoded)
            for values, record, _ in encoded:
                self._decoded.remember(values[0], values[3], record)

        return committed

    async def _apply_locked(self, decision_id: str, op: Operation[T]) -> T:
        """The pessimistic path: one transaction holding the row lock."""

        async def attempt(conn: Any) -> T:
            while True:
                record, clock = await self._load_locked(conn, decision_id)
                self._clock_offset_ms = clock - wall_clock_ms()
                transition = op(record, clock)
                if not transition.changed or transition.record is None:
                    return transition.result
                values = encode_row(decision_id, transition.record, index_max=None)
                if record is not None:
                    await conn.execute(_UPDATE_SQL, *values)
                    self._decoded.remember(decision_id, values[3], transition.record)
                    return transition.result
                origin = creation_values(transition.created, clock)
                status = await conn.execute(_INSERT_SQL, *values, *origin)
                if status.endswith(" 1"):
                    self._decoded.remember(decision_id, values[3], transition.record)
                    return transition.result
                # Another host inserted this id after our read and has
                # committed (ON CONFLICT waited for it): re-read under
                # lock and apply the transition to its row instead.

        return await self._locked(decision_id, attempt)

    async def _load_locked(self, conn: Any, decision_id: str) -> tuple[ClaimRecord | None, int]:
        """Lock ``decision_id``'s row (if any), then read it and the database clock."""
        row = await conn.fetchrow(_LOAD_SQL, decision_id)
        text, clock = row["record"], int(row["now_ms"])
        if text is None:
            return None, clock
        return self._decoded.decode(decision_id, text, row["traceparent"]), clock

    async def _locked(self, decision_id: str, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``attempt(conn)`` in a transaction, again after a serialization failure."""
        for _ in range(_MAX_RETRIES):
            try:
                async with self._pg.connection() as conn, conn.transaction():
                    return await attempt(conn)
            except LedgerError:
                raise
            except Exception as error:
                if retryable(error):
                    continue
                raise self._pg.translate(error) from error
        raise LedgerUnavailableError(
            f"PostgreSQL ledger {self.where}: decision `{decision_id}` kept hitting "
            f"serialization failures ({_MAX_RETRIES} attempts)"
        )

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        try:
            row = await self._pg.fetchrow(
                f"SELECT record, traceparent FROM {_TABLE} WHERE decision_id = $1", decision_id
            )
        except Exception as error:
            raise self._pg.translate(error) from error
        return None if row is None else self._decoded.decode(decision_id, row[0], row[1])

    async def _prune(self, before_ms: int, progress: PruneProgress | None, mode: PruneMode) -> int:
        status = "tombstone" if mode is PruneMode.TOMBSTONES else "completed"
        total = 0
        try:
            while True:
                if mode is PruneMode.TOMBSTONE:
                    async with self._pg.connection() as conn, conn.transaction():
                        rows = await conn.fetch(_BURY_SELECT_SQL, before_ms, _PRUNE_BATCH)
                        columns: list[list[Any]] = [[], [], [], []]
                        for key, text in rows:
                            buried = tombstone_of(self._decoded.decode(key, text))
                            for column, value in zip(
                                columns, encode_row(key, buried, index_max=None)[:4], strict=True
                            ):
                                column.append(value)
                        await conn.execute(_BURY_SQL, *columns)
                    done = len(rows)
                else:
                    result = await self._pg.execute(_PRUNE_SQL, before_ms, _PRUNE_BATCH, status)
                    done = int(result.rsplit(" ", 1)[-1])
                total += done
                if progress is not None:
                    progress(total)
                if done < _PRUNE_BATCH:
                    return total
        except LedgerError:
            raise
        except Exception as error:
            raise self._pg.translate(error) from error

    # -- operator actions and queries -------------------------------------------------

    async def _act(self, decision_id: str, op: Operation[AuditEntry]) -> AuditEntry:
        async def attempt(conn: Any) -> AuditEntry:
            record, clock = await self._load_locked(conn, decision_id)
            transition = op(record, clock)
            if transition.record is None:
                await conn.execute(f"DELETE FROM {_TABLE} WHERE decision_id = $1", decision_id)
            else:
                values = encode_row(decision_id, transition.record, index_max=None)
                await conn.execute(_UPDATE_SQL, *values)
            return await _append_audit(conn, transition.result)

        return await self._locked(decision_id, attempt)

    async def _act_on_hold(self, decision_id: str, op: HoldOperation) -> Acted:
        async def attempt(conn: Any) -> Acted:
            record, clock = await self._load_locked(conn, decision_id)
            run = None
            if op.run_id is not None:
                # The run's lock after the row's, then the clock (as the joint path).
                await conn.fetchval(_RUN_LOCK_SQL, [op.run_id])
                found = await conn.fetch(_RUN_READ_SQL, [op.run_id])
                clock = int(found[0][0])
                if found[0][1] is not None:
                    run = run_of(tuple(found[0])[1:])
            self._clock_offset_ms = clock - wall_clock_ms()
            applied = op.apply(record, run, clock)
            acted = applied.acted
            if op.row is not None and applied.row_attempt is not None:
                # The joint path: the approval's claim, the row and the completion commit
                # together (a refused row raises: the transaction rolls back).
                (done,) = await pg_insert_rows(conn, [(op.row, applied.row_attempt)])
                if isinstance(done, BaseException):
                    raise _RowRefused(done)
                acted = dataclasses.replace(acted, inserted=done)
            if applied.record is not None:
                values = encode_row(decision_id, applied.record, index_max=None)
                await conn.execute(_UPDATE_SQL, *values)
            if applied.run is not None:
                await conn.execute(_RUN_WRITE_SQL, *[[value] for value in run_values(applied.run)])
            if acted.entry is not None:
                acted = dataclasses.replace(acted, entry=await _append_audit(conn, acted.entry))
            return acted

        try:
            return await self._locked(decision_id, attempt)
        except _RowRefused as refused:
            raise refused.error from None  # rolled back: the sink's refusal, as it is

    async def _query_clock(self) -> int:
        return await self.db_now_ms()

    async def _select(self, sql: str, params: list[Any], convert: Callable[[Any], R]) -> list[R]:
        try:
            found = await self._pg.fetch(sql, *params)
        except Exception as error:
            raise self._pg.translate(error) from error
        return [convert(row) for row in found]


async def _append_audit(conn: Any, entry: AuditEntry) -> AuditEntry:
    """Chain ``entry`` to the audit trail and append it, in the caller's transaction.

    Appends chain one after the other: the trail's lock is held to the commit.
    """
    await conn.execute(pg_audit_lock_sql(LEDGER_AUDIT_LOCK))
    chained = entry.chained(await conn.fetchval(LAST_AUDIT_HASH_SQL))
    seq = await conn.fetchval(_AUDIT_INSERT_SQL, *audit_values(chained))
    return dataclasses.replace(chained, seq=int(seq))


class _RowRefused(LedgerError):
    """The joint row was refused (other content under the id): the transaction rolls
    back, and the caller gets ``error`` itself (a LedgerError passes :meth:`_locked`)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _LostInsert(Exception):
    """A joint transaction found an id it saw as new already inserted: roll back, retry."""


def _plain(item: _Item) -> Operation[Any]:
    """A queued operation of the optimistic path (joint and run-bound ones go elsewhere)."""
    return cast(Operation[Any], item.op)


def _run_of(item: _Item) -> str | None:
    """The run whose invariants a queued operation keeps (its record to lock), or None."""
    op = item.op
    return op.run_id if isinstance(op, RunBound | JointOperation) else None


def _row_of(item: _Item) -> JointRow:
    joint: JointOperation = item.op  # type: ignore[assignment]
    return joint.row


class _Item:
    """One queued mutation and, once applied, its outcome."""

    __slots__ = ("batch", "decision_id", "done", "error", "future", "op", "result", "trace")

    def __init__(
        self,
        decision_id: str,
        op: Operation[Any] | RunBound[Any] | JointOperation,
        future: asyncio.Future[Any] | None,
    ) -> None:
        self.decision_id = decision_id
        self.op = op
        self.future = future
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.trace: Any = None  # tracing on: the caller's span, and the batch's context
        self.batch: Any = None


def _finish(group: list[_Item], results: list[tuple[Any, BaseException | None]]) -> None:
    for item, (result, error) in zip(group, results, strict=True):
        item.result = result
        item.error = error
        item.done = True
