"""The outbox sink: each accepted decision becomes one row of ``flow_decision_outbox``.

``OutboxSink("sqlite:///path")`` or ``OutboxSink("postgresql://...")``.

Delivery is **insert-if-absent** keyed by ``decision_id``:

* the first delivery inserts the row (``first_attempt = highest_attempt =
  attempt``) and gets the next ``seq``, the consumers' cursor;
* a replay with the same request hash (a crash between the sink and the ledger's
  completion, or a late delivery by a stale owner) has no second effect: it only
  raises ``highest_attempt``;
* a replay whose content differs raises :class:`OutboxConflictError` and changes
  nothing.

``seq`` order is commit order (SQLite serializes writers; on PostgreSQL new rows
are inserted under a transaction-scoped advisory lock), so a consumer reading
``fetch(after=last_seq)`` never skips a row.

The schema is created on :meth:`OutboxSink.open` and versioned in
``flow_decision_outbox_schema`` with migrations in ``sinks/sql/<dialect>/``; a
store written by a newer version is refused with :class:`OutboxSchemaError`.
SQLite work runs on one worker thread owning one connection (WAL,
``synchronous=FULL``); PostgreSQL goes through an asyncpg pool and stamps
``accepted_at_ms`` with the database clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from ..errors import FlowDecisionError, LedgerError, StoreMissingError
from ..migrations import load_migrations, split_statements
from ..model import DecisionRequest
from ..sqlite_wal import connect_wal

__all__ = [
    "OUTBOX_SCHEMA_VERSION",
    "OUTBOX_TABLE",
    "OutboxConflictError",
    "OutboxEntry",
    "OutboxError",
    "OutboxMissingError",
    "OutboxSchemaError",
    "OutboxSink",
    "load_outbox_migrations",
]

T = TypeVar("T")

OUTBOX_TABLE = "flow_decision_outbox"
_VERSION_TABLE = "flow_decision_outbox_schema"
#: pg_advisory_xact_lock key for migrations ("fdoutbxm").
_MIGRATION_LOCK = 0x66646F757462786D
#: pg_advisory_xact_lock key serializing new rows so seq order is commit order ("fdoutbox").
_INSERT_LOCK = 0x66646F7574626F78
_MAX_FETCH = 10_000
_COLUMNS = (
    "seq, decision_id, request_json, request_hash, first_attempt, highest_attempt, accepted_at_ms"
)


class OutboxError(FlowDecisionError):
    """The outbox store failed (cannot open, read or write); the message names the store."""


class OutboxSchemaError(OutboxError):
    """The outbox store has a schema this version cannot use."""


class OutboxMissingError(OutboxError, StoreMissingError):
    """Opened with ``create=False``, the store does not exist or holds no outbox."""


class OutboxConflictError(OutboxError):
    """A delivery reused a decision id whose stored row has different content."""

    def __init__(self, decision_id: str, stored_hash: str, offered_hash: str) -> None:
        super().__init__(
            f"outbox already holds decision `{decision_id}` with request hash {stored_hash}; "
            f"refusing different content with hash {offered_hash}"
        )
        self.decision_id = decision_id
        self.stored_hash = stored_hash
        self.offered_hash = offered_hash


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One outbox row."""

    seq: int
    decision_id: str
    request_json: bytes
    request_hash: str
    first_attempt: int
    highest_attempt: int
    accepted_at_ms: int

    @property
    def request(self) -> DecisionRequest:
        """The stored request, parsed."""
        return DecisionRequest.parse(self.request_json)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``request`` is the parsed request JSON text)."""
        return {
            "seq": self.seq,
            "decision_id": self.decision_id,
            "request_hash": self.request_hash,
            "first_attempt": self.first_attempt,
            "highest_attempt": self.highest_attempt,
            "accepted_at_ms": self.accepted_at_ms,
            "request_json": self.request_json.decode("utf-8"),
        }


def _entry(row: Any) -> OutboxEntry:
    text = row[2]
    return OutboxEntry(
        seq=int(row[0]),
        decision_id=str(row[1]),
        request_json=text.encode("utf-8") if isinstance(text, str) else bytes(text),
        request_hash=str(row[3]),
        first_attempt=int(row[4]),
        highest_attempt=int(row[5]),
        accepted_at_ms=int(row[6]),
    )


def load_outbox_migrations(dialect: str) -> list[tuple[int, str, str]]:
    """The ``(version, name, sql)`` outbox migrations shipped for ``dialect``, in order."""
    return load_migrations("flowdecision.sinks", dialect)


OUTBOX_SCHEMA_VERSION = len(load_outbox_migrations("sqlite"))


def _parse_url(url: str) -> tuple[str, str]:
    from ..ledger.url import parse_ledger_url

    try:
        kind, target = parse_ledger_url(url)
    except LedgerError as error:
        raise OutboxError(str(error).replace("ledger URL", "outbox URL")) from error
    if kind not in ("sqlite", "postgresql"):
        raise OutboxError(
            f"outbox URL `{url}` must be sqlite:///path or postgresql://..., got a {kind} URL"
        )
    return kind, target


class OutboxSink:
    """A :class:`~flowdecision.sinks.Sink` that records each decision once in a table.

    Open it with ``await sink.open()`` or ``async with OutboxSink(url) as sink``;
    :meth:`submit` opens it on first use too. Not thread-safe; one event loop.
    A new SQLite outbox file is created ``0600`` (it holds full payloads).

    ``create=False`` opens an existing outbox only (to read it): no file,
    directory or table is created and no migration runs; a missing store, or
    one without the outbox tables, raises :class:`OutboxMissingError`.
    """

    def __init__(self, url: str, *, busy_timeout_ms: int = 30_000, create: bool = True) -> None:
        self.url = url
        self.create = bool(create)
        self.kind, self._target = _parse_url(url)
        self.busy_timeout_ms = busy_timeout_ms
        self._backend: _SqliteOutbox | _PostgresOutbox | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def where(self) -> str:
        """The store, for messages (a file path, or host/database without credentials)."""
        if self.kind == "sqlite":
            return f"`{self._target}`"
        from ..ledger.postgres import describe_dsn

        return describe_dsn(self._target)

    async def open(self) -> OutboxSink:
        """Connect, and create or upgrade the outbox table."""
        await self._ready()
        return self

    async def __aenter__(self) -> OutboxSink:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the connection or pool; the sink is unusable afterwards."""
        self._closed = True
        backend, self._backend = self._backend, None
        if backend is not None:
            await backend.close()

    async def _ready(self) -> _SqliteOutbox | _PostgresOutbox:
        if self._closed:
            raise OutboxError(f"outbox {self.where} is closed")
        if self._backend is not None:
            return self._backend
        async with self._lock:
            if self._backend is None:
                backend: _SqliteOutbox | _PostgresOutbox
                if self.kind == "sqlite":
                    backend = _SqliteOutbox(Path(self._target), self.busy_timeout_ms, self.create)
                else:
                    backend = _PostgresOutbox(self._target, self.where, self.create)
                try:
                    await backend.start()
                except BaseException:
                    await backend.close()
                    raise
                self._backend = backend
            return self._backend

    # -- the sink ---------------------------------------------------------------

    async def submit(self, request: DecisionRequest, attempt: int) -> None:
        """Insert-if-absent (see the module docs); raises :class:`OutboxConflictError`."""
        await self.deliver(request, attempt)

    async def deliver(self, request: DecisionRequest, attempt: int) -> bool:
        """Like :meth:`submit`; True when this call inserted the row, False for a replay."""
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"attempt must be a non-negative integer, got {attempt!r}")
        text = request.to_json()
        hash_ = hashlib.sha256(text).hexdigest()
        backend = await self._ready()
        return await backend.deliver(request.decision_id, text.decode("utf-8"), hash_, attempt)

    # -- reading ------------------------------------------------------------------

    async def fetch(self, after: int = 0, limit: int = 100) -> list[OutboxEntry]:
        """Rows with ``seq > after``, ordered by ``seq``, at most ``limit`` (<= 10000)."""
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"after must be a non-negative integer, got {after!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _MAX_FETCH:
            raise ValueError(f"limit must be an integer in 1..={_MAX_FETCH}, got {limit!r}")
        return await (await self._ready()).fetch(after, limit)

    async def get(self, decision_id: str) -> OutboxEntry | None:
        """The row for ``decision_id``, or None."""
        return await (await self._ready()).get(decision_id)

    async def count(self) -> int:
        """How many rows the outbox holds."""
        return await (await self._ready()).count()


# ------------------------------------------------------------------------------- SQLite


def _check_existing(where: str, newest: int, current: int | None, has_table: bool) -> None:
    """``create=False``: refuse a store that is not a current outbox instead of migrating.

    ``current`` is None when the version table is missing.
    """
    if current is None or not has_table:
        raise OutboxMissingError(
            f"{where} is not an outbox (no {OUTBOX_TABLE} tables; nothing was created)"
        )
    if current > newest:
        raise OutboxSchemaError(
            f"{where} has schema version {current}, newer than version {newest} that this "
            "flowdecision supports; upgrade flowdecision"
        )
    if current < newest:
        raise OutboxSchemaError(
            f"{where} has schema version {current}, older than version {newest} this "
            "flowdecision needs: open it once with a writer (e.g. the service) to upgrade it"
        )


class _SqliteOutbox:
    def __init__(self, path: Path, busy_timeout_ms: int, create: bool = True) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        self.create = create
        self._conn: sqlite3.Connection | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flowdecision-outbox"
        )
        self._shut = False

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, work)

    def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        try:
            if self._conn is None:
                self._conn = self._connect()
            return work(self._conn)
        except sqlite3.Error as error:
            raise OutboxError(f"sqlite outbox `{self.path}`: {error}") from error

    def _connect(self) -> sqlite3.Connection:
        if self.create:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise OutboxError(
                    f"create directory for sqlite outbox `{self.path}`: {error.strerror or error}"
                ) from error
        try:
            conn = connect_wal(self.path, busy_timeout_ms=self.busy_timeout_ms, create=self.create)
        except sqlite3.OperationalError as error:
            if not self.create and not self.path.exists():
                raise OutboxMissingError(
                    f"sqlite outbox `{self.path}` does not exist (nothing was created)"
                ) from error
            raise
        try:
            if self.create:
                self._migrate(conn)
            else:
                self._check(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _check(self, conn: sqlite3.Connection) -> None:
        def has(table: str) -> bool:
            row = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).fetchone()
            return row is not None

        current: int | None = None
        if has(_VERSION_TABLE):
            row = conn.execute(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}").fetchone()
            current = int(row[0]) if row else 0
        _check_existing(
            f"sqlite outbox `{self.path}`", OUTBOX_SCHEMA_VERSION, current, has(OUTBOX_TABLE)
        )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        migrations = load_outbox_migrations("sqlite")
        newest = len(migrations)
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_VERSION_TABLE} ("
                "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)"
            )
            row = conn.execute(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}").fetchone()
            current = int(row[0]) if row else 0
            if current > newest:
                raise OutboxSchemaError(
                    f"sqlite outbox `{self.path}` has schema version {current}, newer than "
                    f"version {newest} that this flowdecision supports; upgrade flowdecision"
                )
            for version, name, script in migrations:
                if version <= current:
                    continue
                for statement in split_statements(script):
                    conn.execute(statement)
                conn.execute(
                    f"INSERT INTO {_VERSION_TABLE} (version, name, applied_at_ms) VALUES (?, ?, ?)",
                    (version, name, time.time_ns() // 1_000_000),
                )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    async def start(self) -> None:
        await self._run(lambda conn: None)

    async def close(self) -> None:
        if self._shut:
            return
        self._shut = True

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        finally:
            self._executor.shutdown(wait=False)

    async def deliver(self, decision_id: str, text: str, hash_: str, attempt: int) -> bool:
        def work(conn: sqlite3.Connection) -> bool:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute(
                    f"SELECT request_hash, highest_attempt FROM {OUTBOX_TABLE} "
                    "WHERE decision_id = ?",
                    (decision_id,),
                ).fetchone()
                if row is None:
                    conn.execute(
                        f"INSERT INTO {OUTBOX_TABLE} (decision_id, request_json, request_hash, "
                        "first_attempt, highest_attempt, accepted_at_ms) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (decision_id, text, hash_, attempt, attempt, time.time_ns() // 1_000_000),
                    )
                    inserted = True
                elif row[0] != hash_:
                    raise OutboxConflictError(decision_id, str(row[0]), hash_)
                else:
                    if attempt > int(row[1]):
                        conn.execute(
                            f"UPDATE {OUTBOX_TABLE} SET highest_attempt = ? WHERE decision_id = ?",
                            (attempt, decision_id),
                        )
                    inserted = False
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return inserted

        return await self._run(work)

    async def fetch(self, after: int, limit: int) -> list[OutboxEntry]:
        def work(conn: sqlite3.Connection) -> list[OutboxEntry]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            ).fetchall()
            return [_entry(row) for row in rows]

        return await self._run(work)

    async def get(self, decision_id: str) -> OutboxEntry | None:
        def work(conn: sqlite3.Connection) -> OutboxEntry | None:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE decision_id = ?", (decision_id,)
            ).fetchone()
            return None if row is None else _entry(row)

        return await self._run(work)

    async def count(self) -> int:
        def work(conn: sqlite3.Connection) -> int:
            row = conn.execute(f"SELECT count(*) FROM {OUTBOX_TABLE}").fetchone()
            return int(row[0]) if row else 0

        return await self._run(work)


# ---------------------------------------------------------------------------- PostgreSQL

_PG_CLOCK = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


class _PostgresOutbox:
    def __init__(self, dsn: str, where: str, create: bool = True) -> None:
        self.dsn = dsn
        self.where = where
        self.create = create
        self._pool: Any = None

    def _error(self, error: BaseException) -> OutboxError:
        if isinstance(error, OutboxError):
            return error
        return OutboxError(f"PostgreSQL outbox {self.where}: {type(error).__name__}: {error}")

    async def start(self) -> None:
        try:
            import asyncpg
        except ImportError as error:  # pragma: no cover - needs the extra missing
            raise OutboxError(
                "the PostgreSQL outbox needs asyncpg: pip install 'flowdecision[postgres]'"
            ) from error
        try:
            self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=10)
            if self.create:
                await self._migrate()
            else:
                await self._check()
        except Exception as error:
            raise self._error(error) from error

    async def _check(self) -> None:
        async with self._pool.acquire() as conn:
            current: int | None = None
            if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", _VERSION_TABLE):
                current = int(
                    await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}")
                )
            has_table = bool(
                await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", OUTBOX_TABLE)
            )
        newest = len(load_outbox_migrations("postgres"))
        _check_existing(f"PostgreSQL outbox {self.where}", newest, current, has_table)

    async def _migrate(self) -> None:
        migrations = load_outbox_migrations("postgres")
        newest = len(migrations)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_VERSION_TABLE} (version integer PRIMARY KEY, "
                "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
            current = int(
                await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}")
            )
            if current > newest:
                raise OutboxSchemaError(
                    f"PostgreSQL outbox {self.where} has schema version {current}, newer than "
                    f"version {newest} that this flowdecision supports; upgrade flowdecision"
                )
            for version, name, script in migrations:
                if version <= current:
                    continue
                for statement in split_statements(script):
                    await conn.execute(statement)
                await conn.execute(
                    f"INSERT INTO {_VERSION_TABLE} (version, name) VALUES ($1, $2)", version, name
                )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=10)
            except (TimeoutError, Exception):
                pool.terminate()

    async def deliver(self, decision_id: str, text: str, hash_: str, attempt: int) -> bool:
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    f"SELECT request_hash FROM {OUTBOX_TABLE} WHERE decision_id = $1 FOR UPDATE",
                    decision_id,
                )
                if row is None:
                    # Serialize new rows so that seq order is commit order.
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", _INSERT_LOCK)
                    seq = await conn.fetchval(
                        f"INSERT INTO {OUTBOX_TABLE} (decision_id, request_json, request_hash, "
                        "first_attempt, highest_attempt, accepted_at_ms) "
                        f"VALUES ($1, $2, $3, $4, $4, {_PG_CLOCK}) "
                        "ON CONFLICT (decision_id) DO NOTHING RETURNING seq",
                        decision_id,
                        text,
                        hash_,
                        attempt,
                    )
                    if seq is not None:
                        return True
                    # Inserted by someone else after our read; fall through to the replay path.
                    row = await conn.fetchrow(
                        f"SELECT request_hash FROM {OUTBOX_TABLE} "
                        "WHERE decision_id = $1 FOR UPDATE",
                        decision_id,
                    )
                    assert row is not None
                if row["request_hash"] != hash_:
                    raise OutboxConflictError(decision_id, str(row["request_hash"]), hash_)
                await conn.execute(
                    f"UPDATE {OUTBOX_TABLE} SET highest_attempt = $2 "
                    "WHERE decision_id = $1 AND highest_attempt < $2",
                    decision_id,
                    attempt,
                )
                return False
        except Exception as error:
            raise self._error(error) from error

    async def fetch(self, after: int, limit: int) -> list[OutboxEntry]:
        try:
            rows = await self._pool.fetch(
                f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE seq > $1 ORDER BY seq LIMIT $2",
                after,
                limit,
            )
        except Exception as error:
            raise self._error(error) from error
        return [_entry(tuple(row)) for row in rows]

    async def get(self, decision_id: str) -> OutboxEntry | None:
        try:
            row = await self._pool.fetchrow(
                f"SELECT {_COLUMNS} FROM {OUTBOX_TABLE} WHERE decision_id = $1", decision_id
            )
        except Exception as error:
            raise self._error(error) from error
        return None if row is None else _entry(tuple(row))

    async def count(self) -> int:
        try:
            return int(await self._pool.fetchval(f"SELECT count(*) FROM {OUTBOX_TABLE}"))
        except Exception as error:
            raise self._error(error) from error
