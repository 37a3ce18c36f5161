"""PostgreSQL through asyncpg: pool setup, error translation, the database clock.

Shared by the PostgreSQL ledger and the PostgreSQL outbox. asyncpg is the
optional ``postgres`` extra; without it, opening a PostgreSQL store says how to
install it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..defaults import PG_COMMAND_TIMEOUT_S, PG_CONNECT_TIMEOUT_S, PG_MAX_SIZE, PG_MIN_SIZE
from ..errors import FlowDecisionError
from .component import Component
from .migrations import pg_check, pg_migrate, pg_schema_version
from .url import describe_dsn

try:  # asyncpg is the optional `postgres` extra
    import asyncpg
except ImportError:  # pragma: no cover - exercised only without the extra
    asyncpg = None  # type: ignore[assignment]

__all__ = ["CLOCK_SQL", "PgPool", "asyncpg", "retryable"]


class _QuietReconnects(logging.Filter):
    """asyncpg logs a warning with a full traceback for each failed attempt to
    restore a pool's connections while the server is down; the dispatcher's
    outage log (:mod:`flowdecision.outage`) says that once, then summarizes.
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
        """

        def get_reset_query(self) -> str:
            return "ROLLBACK" if self.is_in_transaction() else ""


def driver_error(error: BaseException) -> bool:
    """An error of the database or the connection (not of the caller's own code)."""
    if isinstance(error, OSError | TimeoutError):
        return True
    return asyncpg is not None and isinstance(error, asyncpg.PostgresError | asyncpg.InterfaceError)


def retryable(error: BaseException) -> bool:
    """A serialization failure or deadlock: the transaction may simply be retried."""
    return asyncpg is not None and isinstance(
        error, asyncpg.SerializationError | asyncpg.DeadlockDetectedError
    )


class PgPool:
    """One store's asyncpg pool, created on first use, with its schema checked.

    ``where`` (``host:port/database``, no credentials) names the store in
    every message; :meth:`translate` turns driver and network errors into the
    component's own.
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
                    async with pool.acquire() as conn:
                        await pg_check(conn, self.component, self.where, create=self.create)
                except Exception as error:
                    raise self.translate(error) from error
                self._checked = True
        return pool

    async def schema_version(self) -> int:
        """The schema version recorded in the database (0 if never migrated)."""
        pool = await self.pool()
        try:
            async with pool.acquire() as conn:
                return await pg_schema_version(conn, self.component)
        except Exception as error:
            raise self.translate(error) from error

    async def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; ``(version_before, version_after)``."""
        pool = await self.pool()
        try:
            async with pool.acquire() as conn:
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
