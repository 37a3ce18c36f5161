"""The multi-host ledger: PostgreSQL through an asyncpg connection pool.

Design:

* A mutation is one transaction: lock the row with ``SELECT ... FOR UPDATE``,
  apply the pure transition in Python, write the row back when it changed. A
  brand-new decision id is inserted with ``INSERT ... ON CONFLICT DO NOTHING``;
  if another host inserted it first, the transaction re-reads the now-committed
  row under lock and applies the transition to it, so two hosts racing on a new
  id serialize exactly like two hosts racing on an old one.
* With ``now_ms=None`` the transition's clock is the **database's**
  ``clock_timestamp()``, read after the row lock is held, so a host whose clock
  runs ahead cannot steal a live lease and a host whose clock runs behind
  cannot complete after expiry.
* The schema version lives in ``flowdecision_schema_version``. Migrations in
  ``sql/postgres/NNNN_*.sql`` run only through :meth:`PostgresLedger.migrate`
  (``flowdecision migrate``), under an advisory lock; opening a database whose
  schema is older or newer than this code fails with :class:`LedgerSchemaError`.
* Prune deletes in batches, each its own short transaction.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from ..errors import LedgerCorruptError, LedgerError, LedgerSchemaError, LedgerUnavailableError
from ..jsonwire import encode_json_text
from .base import Ledger, Operation, wall_clock_ms
from .machine import ClaimRecord, ClaimStatus
from .sqlite import load_migrations, split_statements

try:  # asyncpg is the optional `postgres` extra
    import asyncpg
except ImportError:  # pragma: no cover - exercised only without the extra
    asyncpg = None  # type: ignore[assignment]

__all__ = ["SCHEMA_VERSION", "PostgresLedger", "describe_dsn"]

T = TypeVar("T")

SCHEMA_VERSION = len(load_migrations("postgres"))

_TABLE = "flowdecision_claims"
_VERSION_TABLE = "flowdecision_schema_version"
#: pg_advisory_xact_lock key serializing concurrent migrators ("flowdeci" in ASCII).
_MIGRATION_LOCK = 0x666C6F7764656369
_PRUNE_BATCH = 1000
_MAX_RETRIES = 20

_CLOCK = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

# Lock the row, then read the clock: the clock subquery depends on the locked
# CTE, so it is evaluated only after the row lock is granted.
_LOAD_SQL = f"""
WITH locked AS (
    SELECT record FROM {_TABLE} WHERE decision_id = $1 FOR UPDATE
)
SELECT (SELECT record FROM locked) AS record,
       (SELECT {_CLOCK} FROM (SELECT count(*) FROM locked) AS after_lock) AS now_ms
"""
_LOAD_SQL_NO_CLOCK = f"SELECT record FROM {_TABLE} WHERE decision_id = $1 FOR UPDATE"
_INSERT_SQL = (
    f"INSERT INTO {_TABLE} (decision_id, status, completed_at_ms, record) "
    "VALUES ($1, $2, $3, $4) ON CONFLICT (decision_id) DO NOTHING"
)
_UPDATE_SQL = (
    f"UPDATE {_TABLE} SET status = $2, completed_at_ms = $3, record = $4 WHERE decision_id = $1"
)
_PRUNE_SQL = f"""
WITH doomed AS (
    SELECT decision_id FROM {_TABLE}
    WHERE completed_at_ms < $1
    ORDER BY completed_at_ms
    LIMIT $2
    FOR UPDATE
)
DELETE FROM {_TABLE} AS c USING doomed WHERE c.decision_id = doomed.decision_id
"""


def describe_dsn(dsn: str) -> str:
    """``host:port/database`` (or the socket directory) without credentials, for messages."""
    try:
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = parts.hostname or (query.get("host") or [""])[0] or os.environ.get("PGHOST", "")
        port = parts.port or (query.get("port") or [""])[0] or os.environ.get("PGPORT", "5432")
        database = parts.path.lstrip("/") or (query.get("dbname") or [""])[0]
        host = host or "localhost"
        where = f"{host}:{port}" if not host.startswith("/") else f"{host} (unix socket)"
        return f"{where}/{database}" if database else where
    except ValueError:
        return "<unparseable PostgreSQL URL>"


def encode_row(decision_id: str, record: ClaimRecord) -> tuple[str, str, int | None, str]:
    """``(decision_id, status, completed_at_ms, record)`` for one claim record."""
    completed_at: int | None = None
    if record.status is ClaimStatus.COMPLETED and record.completed_at_ms is not None:
        completed_at = record.completed_at_ms
    return decision_id, record.status.value, completed_at, encode_json_text(record.to_dict())


class PostgresLedger(Ledger):
    """Claim ledger in PostgreSQL, shared by any number of hosts.

    ``PostgresLedger(dsn)`` does no I/O: the pool is created, and the schema
    version checked, by the first operation or eagerly by :meth:`start` /
    ``await PostgresLedger.connect(dsn)``. :meth:`migrate` creates or upgrades
    the schema (it needs no prior :meth:`start`).
    """

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout_s: float = 10.0,
        command_timeout_s: float | None = 60.0,
    ) -> None:
        if asyncpg is None:
            raise LedgerError(
                "the PostgreSQL ledger needs asyncpg: pip install 'flowdecision[postgres]'"
            )
        self.dsn = dsn
        self.where = describe_dsn(dsn)
        self.min_size = min_size
        self.max_size = max_size
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self._pool: Any = None
        self._checked = False
        self._lock = asyncio.Lock()
        self._closed = False
        self._clock_offset_ms = 0

    @classmethod
    async def connect(cls, dsn: str, **options: Any) -> PostgresLedger:
        """Connect and verify the schema is current (see :meth:`migrate` otherwise)."""
        ledger = cls(dsn, **options)
        try:
            await ledger.start()
        except BaseException:
            await ledger.close()
            raise
        return ledger

    async def start(self) -> PostgresLedger:
        """Create the pool and check the schema version now instead of at first use."""
        await self._ready()
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
        pool = await self._ready()
        try:
            value = int(await pool.fetchval(f"SELECT {_CLOCK}"))
        except Exception as error:
            raise self._translate(error) from error
        self._clock_offset_ms = value - wall_clock_ms()
        return value

    async def schema_version(self) -> int:
        """The schema version recorded in the database (0 if never migrated)."""
        pool = await self._pool_only()
        try:
            async with pool.acquire() as conn:
                return await self._version(conn)
        except Exception as error:
            raise self._translate(error) from error

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; returns ``(version_before, version_after)``.

        Safe to run from several hosts at once (an advisory lock serializes
        them). Refuses a database whose schema is newer than this code.
        """
        migrations = load_migrations("postgres")
        newest = len(migrations)
        pool = await self._pool_only()
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {_VERSION_TABLE} ("
                    "version integer PRIMARY KEY, "
                    "name text NOT NULL, "
                    "applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
                )
                before = await self._version(conn)
                if before > newest:
                    raise self._newer(before, newest)
                for version, name, script in migrations:
                    if version <= before:
                        continue
                    for statement in split_statements(script):
                        await conn.execute(statement)
                    await conn.execute(
                        f"INSERT INTO {_VERSION_TABLE} (version, name) VALUES ($1, $2)",
                        version,
                        name,
                    )
        except LedgerError:
            raise
        except Exception as error:
            raise self._translate(error) from error
        self._checked = True
        return before, newest

    async def close(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=10)
            except (TimeoutError, Exception):
                pool.terminate()

    # -- primitives -----------------------------------------------------------

    async def _apply(self, decision_id: str, op: Operation[T]) -> T:
        pool = await self._ready()
        for _ in range(_MAX_RETRIES):
            try:
                async with pool.acquire() as conn, conn.transaction():
                    while True:
                        row = await conn.fetchrow(_LOAD_SQL, decision_id)
                        text, clock = row["record"], int(row["now_ms"])
                        self._clock_offset_ms = clock - wall_clock_ms()
                        record = None if text is None else self._decode(decision_id, text)
                        transition = op(record, clock)
                        if not transition.changed or transition.record is None:
                            return transition.result
                        values = encode_row(decision_id, transition.record)
                        if record is not None:
                            await conn.execute(_UPDATE_SQL, *values)
                            return transition.result
                        status = await conn.execute(_INSERT_SQL, *values)
                        if status.endswith(" 1"):
                            return transition.result
                        # Another host inserted this id after our read and has
                        # committed (ON CONFLICT waited for it): re-read under
                        # lock and apply the transition to its row instead.
            except LedgerError:
                raise
            except Exception as error:
                if _retryable(error):
                    continue
                raise self._translate(error) from error
        raise LedgerUnavailableError(
            f"PostgreSQL ledger {self.where}: decision `{decision_id}` kept hitting "
            f"serialization failures ({_MAX_RETRIES} attempts)"
        )

    async def _read(self, decision_id: str) -> ClaimRecord | None:
        pool = await self._ready()
        try:
            text = await pool.fetchval(
                f"SELECT record FROM {_TABLE} WHERE decision_id = $1", decision_id
            )
        except Exception as error:
            raise self._translate(error) from error
        return None if text is None else self._decode(decision_id, text)

    async def _prune(self, before_ms: int) -> int:
        pool = await self._ready()
        total = 0
        try:
            while True:
                status = await pool.execute(_PRUNE_SQL, before_ms, _PRUNE_BATCH)
                deleted = int(status.rsplit(" ", 1)[-1])
                total += deleted
                if deleted < _PRUNE_BATCH:
                    return total
        except Exception as error:
            raise self._translate(error) from error

    # -- connection management --------------------------------------------------

    async def _pool_only(self) -> Any:
        if self._closed:
            raise LedgerError(f"PostgreSQL ledger {self.where} is closed")
        if self._pool is not None:
            return self._pool
        async with self._lock:
            if self._pool is None:
                try:
                    self._pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=self.min_size,
                        max_size=self.max_size,
                        timeout=self.connect_timeout_s,
                        command_timeout=self.command_timeout_s,
                    )
                except Exception as error:
                    raise self._translate(error, connecting=True) from error
            return self._pool

    async def _ready(self) -> Any:
        pool = await self._pool_only()
        if self._checked:
            return pool
        async with self._lock:
            if not self._checked:
                try:
                    async with pool.acquire() as conn:
                        found = await self._version(conn)
                except Exception as error:
                    raise self._translate(error) from error
                newest = SCHEMA_VERSION
                if found > newest:
                    raise self._newer(found, newest)
                if found < newest:
                    state = (
                        "has no flowdecision schema"
                        if found == 0
                        else (
                            f"has schema version {found}, older than version {newest} this "
                            "flowdecision needs"
                        )
                    )
                    raise LedgerSchemaError(
                        f"PostgreSQL ledger {self.where} {state}: run `flowdecision migrate` "
                        "(or PostgresLedger.migrate()) against it first"
                    )
                self._checked = True
        return pool

    async def _version(self, conn: Any) -> int:
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", _VERSION_TABLE)
        if not exists:
            return 0
        value = await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}")
        return int(value)

    def _newer(self, found: int, newest: int) -> LedgerSchemaError:
        return LedgerSchemaError(
            f"PostgreSQL ledger {self.where} has schema version {found}, newer than version "
            f"{newest} that this flowdecision supports; upgrade flowdecision to use it"
        )

    def _decode(self, decision_id: str, text: Any) -> ClaimRecord:
        try:
            obj = json.loads(text)
        except (TypeError, ValueError) as error:
            raise LedgerCorruptError(
                f"decode decision `{decision_id}` in PostgreSQL ledger {self.where}: {error}"
            ) from error
        try:
            return ClaimRecord.from_dict(decision_id, obj)
        except LedgerCorruptError as error:
            raise LedgerCorruptError(f"{error} (PostgreSQL ledger {self.where})") from error

    def _translate(self, error: BaseException, *, connecting: bool = False) -> LedgerError:
        if isinstance(error, LedgerError):
            return error
        what = "connect to" if connecting else "use"
        detail = f"{type(error).__name__}: {error}"
        if asyncpg is not None:
            if isinstance(error, asyncpg.UndefinedTableError):
                return LedgerSchemaError(
                    f"PostgreSQL ledger {self.where} has no flowdecision tables ({error}): "
                    "run `flowdecision migrate` against it first"
                )
            if isinstance(error, asyncpg.InsufficientPrivilegeError):
                return LedgerUnavailableError(
                    f"PostgreSQL ledger {self.where}: permission denied ({error}); "
                    "grant the ledger role access to the flowdecision tables"
                )
            if isinstance(
                error,
                asyncpg.InvalidAuthorizationSpecificationError | (asyncpg.InvalidPasswordError),
            ):
                return LedgerUnavailableError(
                    f"cannot {what} PostgreSQL ledger {self.where}: authentication failed ({error})"
                )
            if isinstance(error, asyncpg.InvalidCatalogNameError):
                return LedgerUnavailableError(
                    f"cannot {what} PostgreSQL ledger {self.where}: database does not exist "
                    f"({error})"
                )
        if isinstance(error, OSError | TimeoutError):
            return LedgerUnavailableError(
                f"cannot {what} PostgreSQL ledger {self.where}: server unreachable ({detail})"
            )
        return LedgerUnavailableError(f"cannot {what} PostgreSQL ledger {self.where}: {detail}")


def _retryable(error: BaseException) -> bool:
    return asyncpg is not None and isinstance(
        error, asyncpg.SerializationError | asyncpg.DeadlockDetectedError
    )
