"""PostgreSQL through asyncpg: pool setup, error translation, the database clock.

Shared by the PostgreSQL ledger and the PostgreSQL outbox. asyncpg is the
optional ``postgres`` extra; without it, opening a PostgreSQL store says how to
install it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import Any

from ..connections.urls import describe_dsn
from ..core.defaults import PG_COMMAND_TIMEOUT_S, PG_CONNECT_TIMEOUT_S, PG_MAX_SIZE, PG_MIN_SIZE
from ..errors import FlowDecisionError
from .component import Component
from .migrations import pg_check, pg_migrate, pg_schema_version

try:  # asyncpg is the optional `postgres` extra
    import asyncpg
except ImportError:  # pragma: no cover - exercised only without the extra
    asyncpg = None  # type: ignore[assignment]

__all__ = ["CLOCK_SQL", "PgPool", "asyncpg", "breaks_connection", "retryable"]


class _QuietReconnects(logging.Filter):
    """asyncpg logs a warning with a full traceback for each failed attempt to
    restore a pool's connections while the server is down; the dispatcher's
    outage log (:mod:`flowdecision.observability.outage`) says that once, then summarizes.
    Those records are kept at debug level only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and str(record.msg).startswith(
            "Failed to restore the pool connection"
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger("asyncpg.pool").addFilter(_QuietReconnects())

#: The database clock in Unix-epoch milliseconds, as a SQL expression. It reads
#: ``clock_timestamp()`` (the time now, not the transaction's start).
CLOCK_SQL = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

if asyncpg is not None:

    class _LeanConnection(asyncpg.Connection):
        """A pooled connection released without asyncpg's reset round trip.

        flowdecision leaves no session state behind (no LISTEN, session advisory
        locks, cursors or SET), so the default ``RESET ALL; UNLISTEN *; ...``
        on every release -- one more round trip per operation -- buys nothing.
        A connection released inside a transaction (it never is) still rolls back.

        That round trip was also what found a connection left broken (its
        protocol mid-operation after an interrupted or failed operation, as in
        ``InternalClientError: cannot switch to state 15``) and made asyncpg
        terminate it. Skipping it is safe
        because every pooled connection is used through :meth:`PgPool.connection`,
        which terminates such a connection before releasing it
        (:func:`breaks_connection`): a broken one never goes back to the pool.
        """

        def get_reset_query(self) -> str:
            return "ROLLBACK" if self.is_in_transaction() else ""


#: Errors after which a connection may be mid-operation or gone: it is terminated,
#: never reused (see :func:`breaks_connection`). ``InternalClientError`` is not an
#: ``InterfaceError`` in asyncpg, so both are named.
_BREAKING: tuple[type[BaseException], ...] = (OSError, TimeoutError, asyncio.CancelledError)
if asyncpg is not None:
    _BREAKING += (asyncpg.InterfaceError, asyncpg.InternalClientError)

#: SQLSTATE classes of server errors that end or doom the session:
#: 08 connection exception, 57 operator intervention (e.g. 57P01 admin shutdown).
_BREAKING_SQLSTATE_CLASSES = frozenset({"08", "57"})
#: ... except 57014 (query canceled: a ``statement_timeout`` or ``pg_cancel_backend``
#: ends the statement, not the session, and the error was read to its end).
_KEEPING_SQLSTATES = frozenset({"57014"})


def breaks_connection(error: BaseException) -> bool:
    """Whether a connection that raised ``error`` must be terminated, not reused.

    True for a client-side or network failure (``InterfaceError``,
    ``InternalClientError``, ``OSError``, ``TimeoutError``), a cancellation,
    and a server error of SQLSTATE class 08 or 57 (but 57014, a cancelled
    statement, which leaves the session usable); also when such an error is
    the explicit cause (``raise ... from``) of ``error``. An ordinary server
    error (a unique violation, a serialization failure, ...) was read to its
    end by asyncpg and leaves the connection usable: False.
    """
    cause: BaseException | None = error
    for _ in range(8):  # a chain of causes is short (and could, in theory, loop)
        if cause is None:
            break
        if isinstance(cause, _BREAKING):
            return True
        if asyncpg is not None and isinstance(cause, asyncpg.PostgresError):
            sqlstate = getattr(cause, "sqlstate", None) or ""
            if sqlstate[:2] in _BREAKING_SQLSTATE_CLASSES and sqlstate not in _KEEPING_SQLSTATES:
                return True
        cause = cause.__cause__
    return False


def driver_error(error: BaseException) -> bool:
    """An error of the database or the connection (not of the caller's own code)."""
    if isinstance(error, OSError | TimeoutError):
        return True
    return asyncpg is not None and isinstance(
        error, asyncpg.PostgresError | asyncpg.InterfaceError | asyncpg.InternalClientError
    )


def retryable(error: BaseException) -> bool:
    """A serialization failure or deadlock: the transaction may simply be retried."""
    return asyncpg is not None and isinstance(
        error, asyncpg.SerializationError | asyncpg.DeadlockDetectedError
    )


class PgPool:
    """One store's asyncpg pool, created on first use, with its schema checked.

    ``where`` (``host:port/database``, no credentials) names the store in
    every message; :meth:`translate` turns driver and network errors into the
    component's own. Every use of a pooled connection goes through
    :meth:`connection` (or :meth:`fetch` and its siblings, which use it).
    """

    def __init__(
        self,
        component: Component,
        dsn: str,
        *,
        min_size: int = PG_MIN_SIZE,
        max_size: int = PG_MAX_SIZE,
        connect_timeout_s: float = PG_CONNECT_TIMEOUT_S,
        command_timeout_s: float | None = PG_COMMAND_TIMEOUT_S,
        create: bool = True,
    ) -> None:
        if asyncpg is None:
            raise component.errors.base(
                f"the PostgreSQL {component.name} needs asyncpg: "
                "pip install 'flowdecision[postgres]'"
            )
        self.component = component
        self.dsn = dsn
        self.where = f"PostgreSQL {component.name} {describe_dsn(dsn)}"
        #: asyncpg.create_pool's sizing and timeouts
        self.pool_options: dict[str, Any] = {
            "min_size": min_size,
            "max_size": max_size,
            "timeout": connect_timeout_s,
            "command_timeout": command_timeout_s,
        }
        self.create = create
        self.closed = False
        self._pool: Any = None
        self._checked = False
        self._lock = asyncio.Lock()

    async def pool(self) -> Any:
        """The pool (created now if needed), without any schema check."""
        if self.closed:
            raise self.component.errors.base(f"{self.where} is closed")
        if self._pool is not None:
            return self._pool
        async with self._lock:
            if self._pool is None:
                try:
                    self._pool = await asyncpg.create_pool(
                        self.dsn, connection_class=_LeanConnection, **self.pool_options
                    )
                except Exception as error:
                    raise self.translate(error, connecting=True) from error
            return self._pool

    async def ready(self) -> Any:
        """The pool, once the schema was found current (checked once)."""
        pool = await self.pool()
        if self._checked:
            return pool
        async with self._lock:
            if not self._checked:
                try:
                    async with self.connection(checked=False) as conn:
                        await pg_check(conn, self.component, self.where, create=self.create)
                except Exception as error:
                    raise self.translate(error) from error
                self._checked = True
        return pool

    def connection(self, *, checked: bool = True) -> PooledConnection:
        """``async with pg.connection() as conn``: a pooled connection, guarded.

        Creates the pool (and, unless ``checked=False``, checks the schema) first
        if needed. A connection whose block raised an error that may leave it
        broken (:func:`breaks_connection`) is terminated before it is released,
        so the pool opens a fresh one next time; after any other error it is
        released as usual. Errors are not translated here.
        """
        return PooledConnection(self, checked)

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        """``conn.fetch`` on a guarded pooled connection (errors not translated)."""
        async with self.connection() as conn:
            rows: list[Any] = await conn.fetch(sql, *args)
            return rows

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        """``conn.fetchrow`` on a guarded pooled connection (errors not translated)."""
        async with self.connection() as conn:
            return await conn.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        """``conn.fetchval`` on a guarded pooled connection (errors not translated)."""
        async with self.connection() as conn:
            return await conn.fetchval(sql, *args)

    async def execute(self, sql: str, *args: Any) -> str:
        """``conn.execute`` on a guarded pooled connection (errors not translated)."""
        async with self.connection() as conn:
            status: str = await conn.execute(sql, *args)
            return status

    async def schema_version(self) -> int:
        """The schema version recorded in the database (0 if never migrated)."""
        try:
            async with self.connection(checked=False) as conn:
                return await pg_schema_version(conn, self.component)
        except Exception as error:
            raise self.translate(error) from error

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; ``(version_before, version_after)``."""
        try:
            async with self.connection(checked=False) as conn:
                result = await pg_migrate(conn, self.component, self.where)
        except Exception as error:
            raise self.translate(error) from error
        self._checked = True
        return result

    async def close(self) -> None:
        """Close the pool (terminating it if closing takes over 10 s)."""
        self.closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=10)
            except (TimeoutError, Exception):
                pool.terminate()

    def chained(self, error: BaseException) -> FlowDecisionError:
        """:meth:`translate`, with ``error`` chained as the cause of a new error."""
        failure = self.translate(error)
        if failure is not error:
            failure.__cause__ = error
        return failure

    def translate(self, error: BaseException, *, connecting: bool = False) -> FlowDecisionError:
        """The component's error for ``error`` (itself if it already is one)."""
        errors = self.component.errors
        if isinstance(error, errors.base):
            return error
        what = "connect to" if connecting else "use"
        detail = f"{type(error).__name__}: {error}"
        if asyncpg is not None:
            if isinstance(error, asyncpg.DiskFullError):  # SQLSTATE 53100
                return errors.out_of_space()(
                    f"{self.where}: the database server's disk is full ({error}); "
                    "nothing was written, free space and retry"
                )
            if isinstance(error, asyncpg.UndefinedTableError):
                return errors.schema(
                    f"{self.where} has no flowdecision tables ({error}): "
                    f"{self.component.migrate_hint}"
                )
            if isinstance(error, asyncpg.InsufficientPrivilegeError):
                return errors.unavailable(
                    f"{self.where}: permission denied ({error}); "
                    f"grant the {self.component.name} role access to the flowdecision tables"
                )
            if isinstance(
                error,
                asyncpg.InvalidAuthorizationSpecificationError | asyncpg.InvalidPasswordError,
            ):
                return errors.unavailable(
                    f"cannot {what} {self.where}: authentication failed ({error})"
                )
            if isinstance(error, asyncpg.InvalidCatalogNameError):
                return errors.unavailable(
                    f"cannot {what} {self.where}: database does not exist ({error})"
                )
        if isinstance(error, OSError | TimeoutError):
            return errors.unavailable(f"cannot {what} {self.where}: server unreachable ({detail})")
        return errors.unavailable(f"cannot {what} {self.where}: {detail}")


class PooledConnection:
    """:meth:`PgPool.connection`'s context manager: acquire, and on the way out
    terminate a connection the block may have broken, then release.

    The hot path costs a check that the pool is ready and one test on the way
    out: no round trip. Terminating closes the socket at once and hands the
    holder back to the pool (asyncpg's ``_release_on_close``); the release that
    follows then finds the proxy detached and does nothing.
    """

    __slots__ = ("_checked", "_conn", "_pg", "_pool")

    def __init__(self, pg: PgPool, checked: bool) -> None:
        self._pg = pg
        self._checked = checked
        self._pool: Any = None
        self._conn: Any = None

    async def __aenter__(self) -> Any:
        pg = self._pg
        pool = pg._pool
        if pool is None or pg.closed or (self._checked and not pg._checked):
            # the slow path: create the pool, check the schema, or say it is closed
            pool = await (pg.ready() if self._checked else pg.pool())
        self._pool = pool
        self._conn = await pool.acquire()
        return self._conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        conn, self._conn = self._conn, None
        if error is not None and breaks_connection(error):
            # InterfaceError: asyncpg already closed it and released its holder
            # (the socket was lost), so the proxy is detached.
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
        await self._pool.release(conn)
