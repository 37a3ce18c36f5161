"""A pooled PostgreSQL connection that may be broken is terminated, never reused.

``PgPool.connection()`` is the one way src/ uses a pooled connection. Pooled
connections skip asyncpg's reset round trip on release (``_LeanConnection``),
the round trip that used to find a connection left mid-operation; the guard
terminates one whose block raised a client, network, cancellation or
connection-class (SQLSTATE 08/57) error instead. An ordinary server error keeps
the connection. Real PostgreSQL, no mocks: pools of exactly one connection make
"the same connection" a matter of comparing backend pids.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from flowdecision.errors import LedgerUnavailableError
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.ledger.rows import LEDGER
from flowdecision.store.postgres import PgPool, breaks_connection

from .helpers import identity

pytestmark = pytest.mark.timeout(60)


async def _pid(pg: PgPool) -> int:
    return int(await pg.fetchval("SELECT pg_backend_pid()"))


async def _eventually(check: Callable[[], Awaitable[Any]], what: str) -> None:
    deadline = time.monotonic() + 10
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.fixture
async def pg(pg_url: str) -> AsyncIterator[PgPool]:
    pool = PgPool(LEDGER, pg_url, min_size=1, max_size=1)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def observer(pg_url: str) -> AsyncIterator[Any]:
    """A connection of its own, outside the pool under test."""
    conn = await asyncpg.connect(pg_url)
    try:
        yield conn
    finally:
        await conn.close()


async def test_a_backend_killed_mid_transaction_fails_the_operation_and_is_not_reused(
    pg_url: str, observer: Any
) -> None:
    ledger = await PostgresLedger.connect(pg_url, min_size=1, max_size=1)
    try:
        key = f"pool-kill-{uuid.uuid4().hex}"
        await ledger.claim(key, "h", "owner", lease_ms=60_000, identity=identity("kill"))
        before = await _pid(ledger._pg)
        async with observer.transaction():
            # Hold the row lock: the ledger's locking transaction (operator_release)
            # blocks inside its SELECT ... FOR UPDATE, mid-transaction, on `before`.
            await observer.execute(
                "SELECT 1 FROM flowdecision_claims WHERE decision_id = $1 FOR UPDATE", key
            )
            task = asyncio.create_task(ledger.operator_release(key, actor="t", reason="kill"))

            async def blocked() -> bool:
                return bool(
                    await observer.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE pid = $1 AND wait_event_type = 'Lock'",
                        before,
                    )
                )

            await _eventually(blocked, "the ledger's transaction to wait for the row lock")
            assert await observer.fetchval("SELECT pg_terminate_backend($1)", before)
            with pytest.raises(LedgerUnavailableError):
                await task
        # The next operation through the same one-connection pool succeeds, on a new backend.
        entry = await ledger.operator_release(key, actor="t", reason="after the kill")
        assert entry.action == "release"
        after = await _pid(ledger._pg)
        assert after != before
        print(f"killed backend {before}; the next operation ran on backend {after}")
    finally:
        await ledger.close()


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.InternalClientError(
            "cannot switch to state 15; another operation (2) is in progress"
        ),
        asyncpg.InterfaceError("connection is closed"),
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.ConnectionFailureError("connection failure"),
        ConnectionResetError("connection reset by peer"),
        TimeoutError(),
    ],
    ids=lambda error: type(error).__name__,
)
async def test_an_error_that_may_break_the_connection_terminates_it(
    pg: PgPool, error: BaseException
) -> None:
    before = await _pid(pg)
    with pytest.raises(type(error)):
        async with pg.connection() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == before
            raise error
    after = await _pid(pg)
    assert after != before
    print(f"{type(error).__name__}: backend {before} terminated, next acquire got {after}")


async def test_the_policy_sees_an_explicit_cause() -> None:
    # A wrapper raised `from` a breaking error (e.g. a writer's failure) still breaks.
    try:
        try:
            raise asyncpg.InternalClientError("mid-operation")
        except asyncpg.InternalClientError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert breaks_connection(outer)
    assert not breaks_connection(RuntimeError("plain"))
    assert not breaks_connection(asyncpg.UniqueViolationError("duplicate"))


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1/0",
        "DO $$ BEGIN RAISE unique_violation; END $$",
        "DO $$ BEGIN RAISE serialization_failure; END $$",
    ],
)
async def test_an_ordinary_server_error_keeps_the_connection(pg: PgPool, sql: str) -> None:
    before = await _pid(pg)
    with pytest.raises(asyncpg.PostgresError):
        async with pg.connection() as conn, conn.transaction():
            await conn.execute(sql)
    with pytest.raises(asyncpg.PostgresError):
        await pg.execute(sql)
    assert await _pid(pg) == before


async def test_a_statement_cancelled_by_statement_timeout_keeps_the_connection(
    pg: PgPool,
) -> None:
    # SQLSTATE 57014 (class 57, like an admin shutdown) ends the statement, not the
    # session: a DBA's statement_timeout must not cost a reconnect.
    before = await _pid(pg)
    with pytest.raises(asyncpg.QueryCanceledError):
        async with pg.connection() as conn, conn.transaction():
            await conn.execute("SET LOCAL statement_timeout = '50ms'")
            await conn.execute("SELECT pg_sleep(2)")
    assert not breaks_connection(asyncpg.QueryCanceledError("canceling statement"))
    assert await _pid(pg) == before


async def test_an_error_of_the_callers_own_keeps_the_connection(pg: PgPool) -> None:
    before = await _pid(pg)
    with pytest.raises(ValueError, match="refused"):
        async with pg.connection() as conn, conn.transaction():
            await conn.execute("SELECT 1")
            raise ValueError("refused")
    assert await _pid(pg) == before


async def test_a_cancelled_operation_leaves_no_broken_connection(pg: PgPool, observer: Any) -> None:
    before = await _pid(pg)
    task = asyncio.create_task(pg.fetchval("SELECT pg_sleep(5)"))

    async def sleeping() -> bool:
        return bool(
            await observer.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE pid = $1 AND state = 'active' AND query LIKE '%pg_sleep%'",
                before,
            )
        )

    await _eventually(sleeping, "the pool's connection to run pg_sleep")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    started = time.monotonic()
    assert await pg.fetchval("SELECT 41 + 1") == 42
    assert time.monotonic() - started < 4, "the next operation waited for the cancelled sleep"
    after = await _pid(pg)
    assert after != before
    print(f"cancelled during pg_sleep on backend {before}; next operation on {after}")
