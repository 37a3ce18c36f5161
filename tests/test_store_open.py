"""Opening stores for reading only (``create=False``), store file permissions and
what a migration reports: real SQLite files, real directories, real PostgreSQL."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowdecision import StoreMissingError, open_ledger, request_hash
from flowdecision.errors import LedgerError
from flowdecision.ledger import JsonFileLedger, SqliteLedger
from flowdecision.ledger.sqlite import SCHEMA_VERSION
from flowdecision.sinks import OutboxError, OutboxMissingError, OutboxSink
from tests.helpers import request


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The common 022 umask, so a 0644 default would show."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a digest of its bytes."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


async def _seed_sqlite_ledger(path: Path) -> None:
    ledger = await SqliteLedger.open(path)
    try:
        seeded = request(decision_id="dec-1")
        await ledger.claim("dec-1", request_hash(seeded), "owner", lease_ms=60_000)
    finally:
        await ledger.close()


# -- ledgers ---------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["sqlite", "file"])
async def test_a_missing_ledger_opened_without_create_is_reported_and_not_created(
    tmp_path: Path, scheme: str
) -> None:
    target = tmp_path / "typo" / ("ledger.db" if scheme == "sqlite" else "dir")
    url = f"sqlite:///{target}" if scheme == "sqlite" else f"file://{target}"
    with pytest.raises(StoreMissingError, match="typo") as caught:
        ledger = await open_ledger(url, create=False)
        try:
            await ledger.lookup("dec-1")
        finally:
            await ledger.close()
    assert caught.value.code == "store_missing"
    assert isinstance(caught.value, LedgerError)
    assert list(tmp_path.iterdir()) == []


async def test_pruning_a_missing_json_ledger_without_create_creates_nothing(
    tmp_path: Path,
) -> None:
    ledger = JsonFileLedger(tmp_path / "x", create=False)
    with pytest.raises(StoreMissingError, match="does not exist"):
        await ledger.prune_completed(0)
    assert list(tmp_path.iterdir()) == []
    empty = JsonFileLedger(tmp_path, create=False)  # a directory, but no ledger in it
    with pytest.raises(StoreMissingError, match=r"holds no flow-decisions\.json"):
        await empty.lookup("dec-1")
    assert list(tmp_path.iterdir()) == []


async def test_a_sqlite_file_that_is_no_ledger_is_not_migrated_without_create(
    tmp_path: Path,
) -> None:
    path = tmp_path / "outbox.db"
    async with OutboxSink(f"sqlite:///{path}") as sink:
        await sink.deliver(request(decision_id="dec-1"), 1)
    before = _tree(tmp_path)
    with pytest.raises(StoreMissingError, match="holds no flowdecision ledger"):
        await open_ledger(f"sqlite:///{path}", create=False)
    assert _tree(tmp_path) == before
    with sqlite3.connect(path) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert "flowdecision_claims" not in tables


async def test_an_existing_ledger_opened_without_create_reads_and_prunes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await _seed_sqlite_ledger(path)
    ledger = await open_ledger(f"sqlite:///{path}", create=False)
    try:
        entry = await ledger.lookup("dec-1")
        assert entry is not None and entry.state.kind == "pending"
        assert await ledger.prune_completed(2**62) == 0
    finally:
        await ledger.close()


async def test_sqlite_ledger_files_are_created_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path)
    try:
        seeded = request(decision_id="dec-1")
        await ledger.claim("dec-1", request_hash(seeded), "owner", lease_ms=60_000)
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    finally:
        await ledger.close()


async def test_migrate_reports_what_it_applied(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    fresh = SqliteLedger(path)
    try:
        assert await fresh.migrate() == (0, SCHEMA_VERSION)
    finally:
        await fresh.close()
    again = SqliteLedger(path)
    try:
        assert await again.migrate() == (SCHEMA_VERSION, SCHEMA_VERSION)
    finally:
        await again.close()


# -- outbox --------------------------------------------------------------------------


async def test_a_missing_sqlite_outbox_opened_without_create_is_not_created(
    tmp_path: Path,
) -> None:
    sink = OutboxSink(f"sqlite:///{tmp_path / 'nope' / 'outbox.db'}", create=False)
    with pytest.raises(OutboxMissingError, match="does not exist") as caught:
        await sink.open()
    await sink.close()
    assert isinstance(caught.value, OutboxError)
    assert isinstance(caught.value, StoreMissingError)
    assert list(tmp_path.iterdir()) == []


async def test_a_ledger_database_read_as_an_outbox_gets_no_outbox_tables(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await _seed_sqlite_ledger(path)
    before = _tree(tmp_path)
    sink = OutboxSink(f"sqlite:///{path}", create=False)
    with pytest.raises(OutboxMissingError, match="is not an outbox"):
        await sink.fetch()
    await sink.close()
    assert _tree(tmp_path) == before
    with sqlite3.connect(path) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert not any(name.startswith("flow_decision_outbox") for name in tables)


async def test_an_existing_outbox_opened_without_create_is_readable(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    async with OutboxSink(url) as sink:
        await sink.deliver(request(decision_id="dec-1"), 1)
    for name in ("outbox.db", "outbox.db-wal", "outbox.db-shm"):
        if (tmp_path / name).exists():
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    async with OutboxSink(url, create=False) as reader:
        assert [entry.decision_id for entry in await reader.fetch()] == ["dec-1"]


async def test_an_empty_postgres_database_read_as_an_outbox_gets_no_tables(
    pg_empty_url: str,
) -> None:
    import asyncpg

    sink = OutboxSink(pg_empty_url, create=False)
    with pytest.raises(OutboxMissingError, match="is not an outbox"):
        await sink.open()
    await sink.close()
    conn = await asyncpg.connect(pg_empty_url)
    try:
        count = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
    finally:
        await conn.close()
    assert count == 0
