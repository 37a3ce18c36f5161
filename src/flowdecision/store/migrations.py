"""Versioned schemas: the migrations shipped as ``.sql`` files, and the one runner.

Each component (the ledger, the outbox) ships ``NNNN_name.sql`` files in
``<package>/sql/<dialect>/``, numbered 1..n without gaps, and records each
applied migration as a row of its version table (``version``, ``name``, when
applied) -- the same scheme for both components in both dialects. A store's
version is the highest recorded (for the SQLite ledger also ``PRAGMA
user_version``, where releases before this scheme kept it).

The policy (``docs/OPERATIONS.md``, "Schema migrations"):

* **SQLite migrates on open**, inside one ``BEGIN IMMEDIATE`` transaction, so
  concurrent openers migrate once. An embedded file belongs to the one
  application on one host that opens it.
* **PostgreSQL migrates only when asked** (:func:`pg_migrate`, behind
  ``flowdecision migrate``), under an advisory lock; opening checks the version
  and refuses a schema that is missing, older or newer. Many hosts share the
  database, so a schema change is an operator's decision, needs DDL rights the
  application role should not have, and must not happen under hosts still
  running the previous release.
* Either way a store whose schema is newer than this code is refused, and
  ``create=False`` (read-only use) never writes: it only checks.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from ..errors import MigrationError
from .component import Component
from .transactions import sqlite_transaction

__all__ = [
    "MigrationError",
    "check_current",
    "pg_check",
    "pg_migrate",
    "pg_schema_version",
    "split_statements",
    "sqlite_check",
    "sqlite_migrate",
    "sqlite_schema_version",
]


def split_statements(script: str) -> list[str]:
    """Split a migration script into complete SQL statements (comments dropped at the end)."""
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
        raise MigrationError(f"incomplete SQL statement in migration: {pending.strip()!r}")
    return statements


# ------------------------------------------------------------------------ verdicts


def _refuse_newer(component: Component, where: str, found: int, newest: int) -> None:
    if found > newest:
        raise component.errors.schema(
            f"{where} has schema version {found}, newer than version {newest} that this "
            "flowdecision supports; upgrade flowdecision to use it"
        )


def check_current(
    component: Component, where: str, found: int, newest: int, *, has_table: bool, create: bool
) -> None:
    """Refuse a store whose schema is not exactly ``newest``, saying what to do.

    ``has_table``: the component's main table exists. With ``create=False`` a
    store without the component at all is *missing*, not merely unmigrated.
    """
    _refuse_newer(component, where, found, newest)
    if found == newest:
        return
    if found == 0 and not has_table:
        if not create:
            article = "an" if component.name[0] in "aeiou" else "a"
            raise component.errors.missing(
                f"{where} is not {article} {component.name} (it holds no flowdecision "
                f"{component.name} tables; nothing was created)"
            )
        raise component.errors.schema(
            f"{where} has no flowdecision schema: {component.migrate_hint}"
        )
    raise component.errors.schema(
        f"{where} has schema version {found}, older than version {newest} this flowdecision "
        f"needs: {component.migrate_hint}"
    )


# ---------------------------------------------------------------------------- SQLite


def _sqlite_tables(conn: sqlite3.Connection) -> list[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    ).fetchall()
    return [str(name) for (name,) in rows]


def sqlite_schema_version(conn: sqlite3.Connection, component: Component) -> int:
    """The component's schema version in this database (0: none)."""
    version = 0
    if component.version_table in _sqlite_tables(conn):
        row = conn.execute(f"SELECT coalesce(max(version), 0) FROM {component.version_table}")
        version = int(row.fetchone()[0])
    if component.legacy_user_version:
        row = conn.execute("PRAGMA user_version").fetchone()
        version = max(version, int(row[0]) if row else 0)
    return version


def sqlite_check(conn: sqlite3.Connection, component: Component, where: str) -> int:
    """``create=False``: the current version, or raise; writes nothing."""
    found = sqlite_schema_version(conn, component)
    newest = component.newest("sqlite")
    has_table = component.main_table in _sqlite_tables(conn)
    check_current(component, where, found, newest, has_table=has_table, create=False)
    return found


def sqlite_migrate(conn: sqlite3.Connection, component: Component, where: str) -> tuple[int, int]:
    """Bring the component's schema to the newest version; ``(before, after)``.

    An up-to-date store is only read. Otherwise one ``BEGIN IMMEDIATE``
    transaction re-reads the version (another process may have migrated
    meanwhile), records versions an earlier release applied without recording
    them, applies the missing migrations and records each.
    """
    migrations = component.migrations("sqlite")
    newest = len(migrations)
    before = sqlite_schema_version(conn, component)
    _refuse_newer(component, where, before, newest)
    if before == newest:
        return before, newest
    with sqlite_transaction(conn):
        before = sqlite_schema_version(conn, component)
        _refuse_newer(component, where, before, newest)
        tables = _sqlite_tables(conn)
        foreign = [name for name in tables if name not in component.shares_with]
        if before == 0 and component.refuse_foreign and foreign:
            if component.main_table not in tables:
                raise component.errors.schema(
                    f"{where} is a database of something else (tables: {', '.join(foreign)}); "
                    f"point the {component.name} at a new file"
                )
        table = component.version_table
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {table} ("
            "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)"
        )
        recorded = int(conn.execute(f"SELECT coalesce(max(version), 0) FROM {table}").fetchone()[0])
        now_ms = time.time_ns() // 1_000_000
        for version, name, script in migrations:
            if version > before:
                for statement in split_statements(script):
                    conn.execute(statement)
            if version > recorded:
                conn.execute(
                    f"INSERT INTO {table} (version, name, applied_at_ms) VALUES (?, ?, ?)",
                    (version, name, now_ms),
                )
        if component.legacy_user_version:
            # Releases that read only user_version then refuse this newer schema.
            conn.execute(f"PRAGMA user_version = {newest}")
    return before, newest


# ------------------------------------------------------------------------ PostgreSQL


async def pg_has_table(conn: Any, table: str) -> bool:
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table))


async def pg_schema_version(conn: Any, component: Component) -> int:
    """The component's schema version in this database (0: none)."""
    if not await pg_has_table(conn, component.version_table):
        return 0
    value = await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {component.version_table}")
    return int(value)


async def pg_check(conn: Any, component: Component, where: str, *, create: bool = True) -> int:
    """Opening: the current version, or raise (see :func:`check_current`); writes nothing."""
    found = await pg_schema_version(conn, component)
    has_table = await pg_has_table(conn, component.main_table)
    check_current(
        component, where, found, component.newest("postgres"), has_table=has_table, create=create
    )
    return found


async def pg_migrate(conn: Any, component: Component, where: str) -> tuple[int, int]:
    """Create or upgrade the schema in one transaction; ``(before, after)``.

    Safe to run from several hosts at once: an advisory lock serializes them.
    """
    migrations = component.migrations("postgres")
    newest = len(migrations)
    table = component.version_table
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", component.pg_lock)
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {table} (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        before = await pg_schema_version(conn, component)
        _refuse_newer(component, where, before, newest)
        for version, name, script in migrations:
            if version <= before:
                continue
            for statement in split_statements(script):
                await conn.execute(statement)
            await conn.execute(
                f"INSERT INTO {table} (version, name) VALUES ($1, $2)", version, name
            )
    return before, newest
