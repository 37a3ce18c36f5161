"""The one migration runner and its policy: stores laid out by earlier releases open
without manual steps; SQLite migrates on open, PostgreSQL only when asked.

Real SQLite files and a real PostgreSQL server throughout.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flowdecision import open_ledger, request_hash
from flowdecision.errors import LedgerSchemaError
from flowdecision.ledger import AlreadyCompleted, Claimed, PostgresLedger, SqliteLedger
from flowdecision.ledger.query import DecisionQuery
from flowdecision.ledger.rows import LEDGER
from flowdecision.ledger.states import DecisionState
from flowdecision.sinks import OutboxSchemaError, OutboxSink
from flowdecision.sinks.outbox import OUTBOX_SCHEMA_VERSION
from flowdecision.store import Component
from flowdecision.store.component import load_migrations
from flowdecision.store.migrations import (
    split_statements,
    sqlite_migrate,
    sqlite_schema_version,
)
from tests.helpers import request

LEDGER_VERSION = LEDGER.newest("sqlite")
OUTBOX_VERSION = OUTBOX_SCHEMA_VERSION


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}


def _user_version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _legacy_sqlite_ledger(path: Path) -> None:
    """A ledger exactly as releases before the store package left it: the schema of
    migration 1, its version only in ``PRAGMA user_version``, no version table."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        for version, _, script in load_migrations("flowdecision.ledger", "sqlite"):
            if version > 1:
                break
            for statement in split_statements(script):
                conn.execute(statement)
        conn.execute("PRAGMA user_version = 1")
    finally:
        conn.close()


async def test_a_sqlite_ledger_left_by_an_earlier_release_opens_without_manual_steps(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    _legacy_sqlite_ledger(path)
    assert LEDGER.version_table not in _tables(path)
    done = {"request_hash": "h1", "status": "completed", "owner_id": "o", "lease_expires_at_ms": 0,
            "attempts": 2, "completed_at_ms": 500}  # fmt: skip
    with sqlite3.connect(path) as conn:  # a record the earlier release completed
        conn.execute(
            "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record) "
            "VALUES ('old-1', 'completed', 500, ?)",
            (json.dumps(done, separators=(",", ":")),),
        )

    # Read-only opening never writes: an older schema is refused, saying what to do.
    with pytest.raises(LedgerSchemaError, match="older than version"):
        await open_ledger(f"sqlite:///{path}", create=False)
    assert LEDGER.version_table not in _tables(path)
    ledger = await SqliteLedger.open(path)
    try:
        assert await ledger.schema_version() == LEDGER_VERSION
        assert await ledger.migrate() == (1, LEDGER_VERSION)  # what opening found, and did
        hash_ = request_hash(request(decision_id="dec-1"))
        assert await ledger.claim("dec-1", hash_, "owner", lease_ms=60_000) == Claimed(1)
        # The earlier release's record survived, and queries see it (created = completed).
        assert await ledger.claim("old-1", "h1", "x", lease_ms=5) == AlreadyCompleted()
        page = await ledger.list_decisions(DecisionQuery(state=DecisionState.COMPLETED))
        assert [(row.decision_id, row.created_at_ms) for row in page.decisions] == [("old-1", 500)]
    finally:
        await ledger.close()
    # Opening applied the migrations after version 1 and recorded every version.
    with sqlite3.connect(path) as conn:
        applied = [v for (v,) in conn.execute(f"SELECT version FROM {LEDGER.version_table}")]
    assert applied == list(range(1, LEDGER_VERSION + 1))
    assert _user_version(path) == LEDGER_VERSION


async def test_a_new_sqlite_ledger_records_its_version_in_both_places(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await (await SqliteLedger.open(path)).close()
    with sqlite3.connect(path) as conn:
        rows = conn.execute(f"SELECT version, name FROM {LEDGER.version_table}").fetchall()
    shipped = load_migrations("flowdecision.ledger", "sqlite")
    assert rows == [(version, name) for version, name, _ in shipped]
    assert rows[0] == (1, "0001_init.sql")
    # Earlier releases read only user_version: they still see (and refuse) newer schemas.
    assert _user_version(path) == LEDGER_VERSION


def _two_step_component(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Component:
    """A component shipping migrations 1 and 2 (a real package on sys.path)."""
    package = tmp_path / "twostep"
    folder = package / "sql" / "sqlite"
    folder.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (folder / "0001_init.sql").write_text("CREATE TABLE things (id TEXT PRIMARY KEY);\n")
    (folder / "0002_more.sql").write_text(
        "-- a second step\nALTER TABLE things ADD COLUMN note TEXT;\n"
        "CREATE INDEX things_note ON things (note);\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return Component(
        name="ledger",
        package="twostep",
        version_table="twostep_schema_version",
        main_table="things",
        pg_lock=1,
        errors=LEDGER.errors,
        migrate_hint="migrate it",
        legacy_user_version=True,
        dialects=("sqlite",),
    )


def test_the_runner_adopts_a_user_version_store_and_applies_only_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    component = _two_step_component(tmp_path, monkeypatch)
    path = tmp_path / "store.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE things (id TEXT PRIMARY KEY)")  # migration 1, by hand
        conn.execute("INSERT INTO things VALUES ('kept')")
        conn.execute("PRAGMA user_version = 1")
        # Re-running migration 1 would fail ("table things already exists").
        assert sqlite_migrate(conn, component, "test store") == (1, 2)
        assert sqlite_schema_version(conn, component) == 2
        rows = conn.execute("SELECT version, name FROM twostep_schema_version").fetchall()
        assert rows == [(1, "0001_init.sql"), (2, "0002_more.sql")]
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        assert conn.execute("SELECT id, note FROM things").fetchall() == [("kept", None)]
        assert sqlite_migrate(conn, component, "test store") == (2, 2)  # idempotent
        conn.execute("PRAGMA user_version = 3")  # a newer release was here
        with pytest.raises(LedgerSchemaError, match="schema version 3, newer than version 2"):
            sqlite_migrate(conn, component, "test store")
    finally:
        conn.close()


async def test_a_ledger_and_an_outbox_keep_separate_versions_in_one_sqlite_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "both.db"
    ledger = await SqliteLedger.open(path)
    try:
        async with OutboxSink(f"sqlite:///{path}") as outbox:
            assert await outbox.migrate() == (0, OUTBOX_VERSION)  # what opening found, and did
            assert await outbox.deliver(request(decision_id="dec-1"), 1) is True
        assert await ledger.schema_version() == LEDGER_VERSION
    finally:
        await ledger.close()
    assert {"flowdecision_schema_version", "flow_decision_outbox_schema"} <= _tables(path)


# -- PostgreSQL: explicit, for the ledger and the outbox alike --------------------------


async def _public_tables(url: str) -> set[str]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        )
    finally:
        await conn.close()
    return {row[0] for row in rows}


async def test_a_postgres_outbox_is_not_migrated_on_open_and_says_how(pg_empty_url: str) -> None:
    sink = OutboxSink(pg_empty_url)
    with pytest.raises(OutboxSchemaError, match=r"flowdecision migrate --outbox"):
        await sink.open()
    await sink.close()
    assert await _public_tables(pg_empty_url) == set()
    assert await OutboxSink(pg_empty_url).migrate() == (0, OUTBOX_VERSION)
    assert await OutboxSink(pg_empty_url).migrate() == (OUTBOX_VERSION, OUTBOX_VERSION)
    async with OutboxSink(pg_empty_url) as opened:
        assert await opened.deliver(request(decision_id="dec-1"), 1) is True
    # The ledger's schema is its own: migrating the outbox did not create it.
    with pytest.raises(LedgerSchemaError, match="run `flowdecision migrate`"):
        await PostgresLedger.connect(pg_empty_url)


async def test_ledger_and_outbox_in_one_postgres_database_version_separately(
    pg_empty_url: str,
) -> None:
    ledger = PostgresLedger(pg_empty_url)
    try:
        assert await ledger.migrate() == (0, LEDGER_VERSION)
    finally:
        await ledger.close()
    assert await OutboxSink(pg_empty_url).migrate() == (0, OUTBOX_VERSION)
    assert {
        "flowdecision_claims",
        "flowdecision_schema_version",
        "flow_decision_outbox",
        "flow_decision_outbox_schema",
        "flow_decision_outbox_cursor",
    } <= await _public_tables(pg_empty_url)


def test_migrate_command_migrates_an_outbox_too(pg_empty_url: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "migrate", "--ledger", pg_empty_url,
         "--outbox", pg_empty_url, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["migrated"] is True
    assert report["outbox"] == {
        "url": pg_empty_url,
        "migrated": True,
        "version_before": 0,
        "version_after": OUTBOX_VERSION,
    }
    lite = subprocess.run(
        [sys.executable, "-m", "flowdecision.cli", "migrate", "--ledger",
         f"sqlite:///{tmp_path}/l.db", "--outbox", f"sqlite:///{tmp_path}/o.db"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert lite.returncode == 0, lite.stderr
    assert (
        f"outbox sqlite:///{tmp_path}/o.db: schema at version {OUTBOX_VERSION} (was 0)"
        in lite.stdout
    )
