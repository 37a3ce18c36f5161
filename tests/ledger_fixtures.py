"""Ledger backend and PostgreSQL fixtures (issue 3), re-exported by tests/conftest.py.

* ``pg_server_url`` (session): a throwaway PostgreSQL server, or the one
  ``FLOWDECISION_TEST_POSTGRES_URL`` names; never skipped.
* ``pg_url`` (session): a migrated database on it.
* ``pg_empty_url``: a brand-new unmigrated database.
* ``shared_store_url``: parametrized over sqlite/postgres: one store holding
  both the ledger and the outbox (the joint path's layout), empty.
* ``backend``: parametrized over memory/file/sqlite/postgres; ``await backend()``
  opens a new ledger on the same store.
* ``pytest_terminal_summary``: reports the stateful test's examples per backend.
"""

from __future__ import annotations

import asyncio as _asyncio
import atexit as _atexit
from collections.abc import AsyncIterator as _AsyncIterator
from collections.abc import Iterator as _Iterator
from pathlib import Path as _Path

import pytest as _pytest

from tests.ledger_stores import BACKENDS as _BACKENDS
from tests.ledger_stores import STATEFUL_EXAMPLES as _STATEFUL_EXAMPLES
from tests.ledger_stores import STATEFUL_STEPS as _STATEFUL_STEPS
from tests.ledger_stores import LedgerStore, postgres_url_from_env
from tests.postgres_server import migrate_postgres as _migrate


def _run_sync(coro):  # type: ignore[no-untyped-def]
    """Run a coroutine to completion on a fresh loop in a helper thread.

    Works even when called while an event loop is running (a sync session
    fixture requested lazily from an async fixture).
    """
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_asyncio.run, coro).result()


@_pytest.fixture(scope="session")
def pg_server_url() -> _Iterator[str]:
    """URL of a PostgreSQL server's maintenance database (for CREATE DATABASE).

    ``FLOWDECISION_TEST_POSTGRES_URL`` names an existing server; otherwise a
    throwaway server is started for the session and stopped afterwards, even on
    failure. Never skips: if no server can start, the test fails saying why.
    """
    existing = postgres_url_from_env()
    if existing:
        yield existing
        return
    from tests.postgres_server import PostgresServer

    try:
        server = PostgresServer(fast=True)
    except Exception as error:
        _pytest.fail(f"cannot run the PostgreSQL tests: {error}", pytrace=False)
    _atexit.register(server.stop)  # in case the session is killed mid-teardown
    try:
        server.start()
    except Exception as error:
        server.stop()
        _pytest.fail(f"cannot start a throwaway PostgreSQL server: {error}", pytrace=False)
    try:
        yield server.url("postgres")
    finally:
        server.stop()


@_pytest.fixture(scope="session")
def pg_url(pg_server_url: str) -> str:
    """A migrated database (ledger and outbox) for tests (ledger tests truncate its
    table as they start).

    With ``FLOWDECISION_TEST_POSTGRES_URL`` that database itself is migrated
    and truncated, so point it at a scratch database.
    """
    if postgres_url_from_env():
        _run_sync(_migrate(pg_server_url))
        return pg_server_url
    url = _run_sync(_create_database(pg_server_url, "flowdecision_test"))
    _run_sync(_migrate(url))
    return url


_database_counter = 0


async def _create_database(server_url: str, name: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(server_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@_pytest.fixture
async def pg_empty_url(pg_server_url: str) -> str:
    """A brand-new, unmigrated database (for migration tests)."""
    global _database_counter
    _database_counter += 1
    return await _create_database(pg_server_url, f"flowdecision_empty_{_database_counter}")


@_pytest.fixture(params=["sqlite", "postgres"])
async def shared_store_url(request: _pytest.FixtureRequest, tmp_path: _Path) -> _AsyncIterator[str]:
    """One store holding both the ledger and the outbox: a new SQLite file, or the
    migrated PostgreSQL database emptied of decisions, runs and outbox rows."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'flowdecision.db'}"
        return
    import asyncpg

    url: str = request.getfixturevalue("pg_url")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("TRUNCATE flowdecision_claims, flowdecision_runs, flow_decision_outbox")
    finally:
        await conn.close()
    yield url


@_pytest.fixture(params=_BACKENDS)
async def backend(request: _pytest.FixtureRequest, tmp_path: _Path) -> _AsyncIterator[LedgerStore]:
    """An async factory: ``await backend()`` opens a new ledger on the same store.

    Parametrized over memory, file, sqlite and postgres. ``backend.kind`` names
    it, ``backend.durable`` says whether records survive reopening, and
    ``await backend.insert_raw(id, dict)`` writes a raw (e.g. legacy) record.
    """
    kind: str = request.param
    pg = request.getfixturevalue("pg_url") if kind == "postgres" else None
    store = LedgerStore(kind, tmp_path, pg_url=pg)
    try:
        yield store
    finally:
        await store.aclose()


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    if _STATEFUL_EXAMPLES:
        terminalreporter.section("ledger stateful test: examples per backend")
        for kind in _BACKENDS:
            if kind in _STATEFUL_EXAMPLES:
                terminalreporter.write_line(
                    f"{kind:>8}: {_STATEFUL_EXAMPLES[kind]} examples, "
                    f"{_STATEFUL_STEPS.get(kind, 0)} steps"
                )
