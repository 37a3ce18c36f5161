"""One suite, every backend: memory, JSON file, SQLite and PostgreSQL.

``backend`` (tests/conftest.py) is an async factory: each ``await backend()``
opens a new ledger instance on the same store, so "reopen" and "two
independent ledgers" mean the same thing for every durable backend.
The ``test_seed_*`` tests are ports of every ledger test in the Rust seeds.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from flowdecision.errors import LedgerError, LedgerSchemaError, LedgerUnavailableError
from flowdecision.ledger import (
    AlreadyCompleted,
    Busy,
    Claimed,
    Completed,
    Missing,
    Pending,
    open_ledger,
)
from flowdecision.ledger.machine import U64_MAX
from flowdecision.ledger.postgres import SCHEMA_VERSION as PG_VERSION
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.ledger.sqlite import SCHEMA_VERSION as SQLITE_VERSION
from flowdecision.ledger.sqlite import SqliteLedger

from .helpers import identity, receipt
from .ledger_stores import LedgerStore

# -- ports of the seed tests ------------------------------------------------------


async def test_seed_identity_fences_claim_renew_release_and_completion(
    backend: LedgerStore,
) -> None:
    ledger = await backend()
    first = identity("first")
    other = identity("other")
    assert await ledger.inspect("decision", "hash", identity=first) == Missing()
    assert await ledger.claim(
        "decision", "hash", "owner", lease_ms=50, now_ms=100, identity=first
    ) == Claimed(1)
    assert await ledger.inspect("decision", "hash", identity=first) == Pending(150, 1)
    with pytest.raises(LedgerError):
        await ledger.inspect("decision", "hash", identity=other)
    assert not await ledger.renew(
        "decision", "hash", "owner", lease_ms=50, now_ms=110, identity=other
    )
    await ledger.release("decision", "hash", "owner", identity=other)
    assert await ledger.renew("decision", "hash", "owner", lease_ms=50, now_ms=110, identity=first)
    with pytest.raises(LedgerError):
        await ledger.complete(
            "decision",
            "hash",
            "owner",
            completed_at_ms=120,
            identity=first,
            receipt=receipt(other),
        )
    result_receipt = receipt(first)
    await ledger.complete(
        "decision", "hash", "owner", completed_at_ms=121, identity=first, receipt=result_receipt
    )
    assert await ledger.completed_receipt("decision") == result_receipt
    assert await ledger.inspect("decision", "hash", identity=first) == Completed(121)
    assert not await ledger.renew(
        "decision", "hash", "owner", lease_ms=50, now_ms=130, identity=first
    )


async def test_seed_file_ledger_persists_identity_and_result_receipt(backend: LedgerStore) -> None:
    ledger = await backend()
    execution_identity = identity("persisted")
    result_receipt = receipt(execution_identity)
    await ledger.claim(
        "decision", "hash", "owner", lease_ms=50, now_ms=100, identity=execution_identity
    )
    await ledger.complete(
        "decision",
        "hash",
        "owner",
        completed_at_ms=120,
        identity=execution_identity,
        receipt=result_receipt,
    )
    if backend.durable:
        await ledger.close()
    reopened = await backend()
    assert await reopened.completed_receipt("decision") == result_receipt
    assert (
        await reopened.claim(
            "decision", "hash", "other", lease_ms=50, now_ms=130, identity=execution_identity
        )
        == AlreadyCompleted()
    )
    assert await reopened.inspect("decision", "hash", identity=execution_identity) == Completed(120)
    entry = await reopened.lookup("decision")
    assert entry is not None
    assert entry.execution_identity == execution_identity
    assert entry.result_receipt == result_receipt


async def test_seed_expired_worker_cannot_complete_after_takeover(backend: LedgerStore) -> None:
    ledger = await backend()
    first = identity("expired-first")
    second = first  # a retry keeps the identity and changes only the owner
    await ledger.claim("decision", "hash", "first-owner", lease_ms=20, now_ms=100, identity=first)
    first_receipt = receipt(first)
    with pytest.raises(LedgerError, match="claim lease expired before completion"):
        await ledger.complete(
            "decision",
            "hash",
            "first-owner",
            completed_at_ms=121,
            identity=first,
            receipt=first_receipt,
        )
    with pytest.raises(LedgerError, match="is owned by another dispatcher"):
        await ledger.complete("decision", "hash", "other", completed_at_ms=120, identity=first)
    assert await ledger.claim(
        "decision", "hash", "second-owner", lease_ms=20, now_ms=121, identity=second
    ) == Claimed(2)
    with pytest.raises(LedgerError):
        await ledger.complete(
            "decision",
            "hash",
            "first-owner",
            completed_at_ms=122,
            identity=first,
            receipt=first_receipt,
        )
    second_receipt = receipt(second)
    await ledger.complete("decision", "hash", "second-owner", completed_at_ms=123, identity=second)
    await ledger.complete(
        "decision",
        "hash",
        "second-owner",
        completed_at_ms=123,
        identity=second,
        receipt=second_receipt,
    )
    assert await ledger.completed_receipt("decision") == second_receipt


async def test_seed_legacy_file_record_without_identity_remains_claimable(
    backend: LedgerStore,
) -> None:
    await backend.insert_raw(
        "decision",
        {
            "request_hash": "hash",
            "status": "pending",
            "owner_id": "old-owner",
            "lease_expires_at_ms": 0,
            "attempts": 1,
        },
    )
    ledger = await backend()
    execution_identity = identity("legacy-upgrade")
    assert await ledger.claim(
        "decision", "hash", "new-owner", lease_ms=50, now_ms=100, identity=execution_identity
    ) == Claimed(2)
    result_receipt = receipt(execution_identity)
    await ledger.complete(
        "decision",
        "hash",
        "new-owner",
        completed_at_ms=120,
        identity=execution_identity,
        receipt=result_receipt,
    )
    assert await ledger.completed_receipt("decision") == result_receipt


async def test_seed_independent_file_ledgers_serialize_claim_and_allow_expired_takeover(
    backend: LedgerStore,
) -> None:
    left = await backend()
    right = await backend()
    claims = await asyncio.gather(
        left.claim("decision", "hash", "left", lease_ms=50, now_ms=100),
        right.claim("decision", "hash", "right", lease_ms=50, now_ms=100),
    )
    assert sum(isinstance(claim, Claimed) for claim in claims) == 1
    assert sum(isinstance(claim, Busy) for claim in claims) == 1
    assert await right.claim("decision", "hash", "takeover", lease_ms=50, now_ms=151) == Claimed(2)
    await right.complete("decision", "hash", "takeover", completed_at_ms=160)
    assert await right.prune_completed(161) == 1
    assert await left.claim("decision", "hash", "new", lease_ms=50, now_ms=162) == Claimed(1)


async def test_seed_lease_renewal_requires_current_owner_and_preserves_attempt(
    backend: LedgerStore,
) -> None:
    ledger = await backend()
    assert await ledger.claim("decision", "hash", "owner", lease_ms=30, now_ms=100) == Claimed(1)
    assert not await ledger.renew("decision", "hash", "other", lease_ms=30, now_ms=120)
    assert await ledger.renew("decision", "hash", "owner", lease_ms=30, now_ms=120)
    assert await ledger.claim("decision", "hash", "other", lease_ms=30, now_ms=145) == Busy(150)
    assert await ledger.claim("decision", "hash", "other", lease_ms=30, now_ms=151) == Claimed(2)
    assert not await ledger.renew("decision", "hash", "owner", lease_ms=30, now_ms=152)


async def test_seed_file_ledger_persists_renewed_lease_across_instances(
    backend: LedgerStore,
) -> None:
    owner = await backend()
    competitor = await backend()
    assert await owner.claim("decision", "hash", "owner", lease_ms=20, now_ms=100) == Claimed(1)
    assert await owner.renew("decision", "hash", "owner", lease_ms=30, now_ms=115)
    assert await competitor.claim(
        "decision", "hash", "competitor", lease_ms=20, now_ms=125
    ) == Busy(145)


# -- beyond the seeds: every backend, same behaviour ------------------------------


async def test_u64_extremes_round_trip(backend: LedgerStore) -> None:
    ledger = await backend()
    ident = identity("extreme")
    assert await ledger.claim(
        "max", "h", "o", lease_ms=U64_MAX, now_ms=U64_MAX - 5, identity=ident
    ) == Claimed(1)
    assert await ledger.inspect("max", "h") == Pending(U64_MAX, 1)
    await ledger.claim("done", "h", "o", lease_ms=U64_MAX, now_ms=U64_MAX - 9)
    await ledger.complete("done", "h", "o", completed_at_ms=U64_MAX - 1)
    await ledger.claim("early", "h", "o", lease_ms=U64_MAX, now_ms=5)
    await ledger.complete("early", "h", "o", completed_at_ms=(1 << 63) - 1)
    reopened = await backend()
    assert await reopened.inspect("done", "h") == Completed(U64_MAX - 1)
    assert await reopened.prune_completed(U64_MAX - 1) == 1  # only "early"
    assert await reopened.inspect("done", "h") == Completed(U64_MAX - 1)
    assert await reopened.prune_completed(U64_MAX) == 1
    assert await reopened.inspect("done", "h") == Missing()
    assert await reopened.inspect("max", "h") == Pending(U64_MAX, 1)


async def test_prune_keeps_pending_and_legacy_completed_records(backend: LedgerStore) -> None:
    await backend.insert_raw(
        "legacy-done",
        {
            "request_hash": "h",
            "status": "completed",
            "owner_id": "o",
            "lease_expires_at_ms": 0,
            "attempts": 1,
        },
    )
    ledger = await backend()
    for index in range(2500):  # more than one prune batch
        await ledger.claim(f"d{index}", "h", "o", lease_ms=10, now_ms=index)
        await ledger.complete(f"d{index}", "h", "o", completed_at_ms=index + 1)
        if backend.kind == "file" and index >= 30:
            break
    await ledger.claim("pending", "h", "o", lease_ms=10, now_ms=0)
    expected = 2500 if backend.kind != "file" else 31
    assert await ledger.prune_completed(10**9) == expected
    assert await ledger.inspect("pending", "h") == Pending(10, 1)
    assert await ledger.inspect("legacy-done", "h") == Completed(None)
    assert await ledger.prune_completed(10**9) == 0


async def test_failed_transition_stores_nothing(backend: LedgerStore) -> None:
    ledger = await backend()
    await ledger.claim("d", "h", "o", lease_ms=10, now_ms=100, identity=identity("a"))
    before = await ledger.read_record("d")
    with pytest.raises(LedgerError):
        await ledger.complete("d", "h", "intruder", completed_at_ms=101)
    with pytest.raises(LedgerError):
        await ledger.complete("d", "other-hash", "o", completed_at_ms=101)
    assert await ledger.read_record("d") == before


async def test_wall_clock_default_works(backend: LedgerStore) -> None:
    ledger = await backend()
    assert isinstance(await ledger.claim("d", "h", "o", lease_ms=60_000), Claimed)
    state = await ledger.inspect("d", "h")
    assert isinstance(state, Pending)
    assert abs(state.lease_expires_at_ms - (time.time_ns() // 1_000_000 + 60_000)) < 5_000
    await ledger.complete("d", "h", "o")
    assert isinstance(await ledger.inspect("d", "h"), Completed)


async def test_many_concurrent_claims_on_one_instance(backend: LedgerStore) -> None:
    ledger = await backend()
    outcomes = await asyncio.gather(
        *(ledger.claim("hot", "h", f"o{i}", lease_ms=1000, now_ms=100) for i in range(20))
    )
    assert sum(isinstance(outcome, Claimed) for outcome in outcomes) == 1
    assert sum(isinstance(outcome, Busy) for outcome in outcomes) == 19


# -- SQLite specifics ---------------------------------------------------------------


async def test_sqlite_constructor_opens_lazily_and_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "ledger.db"
    ledger = SqliteLedger(path)
    assert not path.exists()
    try:
        assert await ledger.claim("d", "h", "o", lease_ms=10, now_ms=1) == Claimed(1)
        assert await ledger.schema_version() == SQLITE_VERSION
    finally:
        await ledger.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SQLITE_VERSION
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert {"flowdecision_claims", "flowdecision_claims_prune"} <= names
    finally:
        conn.close()
    with pytest.raises(LedgerError, match="closed"):
        await ledger.claim("d", "h", "o", lease_ms=10, now_ms=1)


async def test_sqlite_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await (await SqliteLedger.open(path)).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(
        LedgerSchemaError, match=rf"schema version 99, newer than version {SQLITE_VERSION}"
    ):
        await SqliteLedger.open(path)
    with pytest.raises(LedgerSchemaError, match=str(path)):
        await open_ledger(f"sqlite:///{path}")


async def test_sqlite_foreign_or_corrupt_database_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE customers (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerSchemaError, match="database of something else"):
        await SqliteLedger.open(foreign)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(LedgerError, match=r"garbage\.db"):
        await SqliteLedger.open(garbage)


async def test_sqlite_unwritable_location_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LedgerUnavailableError, match=r"file/sub"):
        await SqliteLedger.open(blocker / "sub" / "ledger.db")


async def test_sqlite_busy_timeout_reports_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    await (await SqliteLedger.open(path)).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    ledger = await SqliteLedger.open(path, busy_timeout_ms=100)
    try:
        with pytest.raises(LedgerUnavailableError, match="locked"):
            await ledger.claim("d", "h", "o", lease_ms=10, now_ms=1)
        holder.execute("ROLLBACK")
        assert await ledger.claim("d", "h", "o", lease_ms=10, now_ms=1) == Claimed(1)
    finally:
        holder.close()
        await ledger.close()


async def test_sqlite_synchronous_setting_is_validated(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="synchronous"):
        SqliteLedger(tmp_path / "x.db", synchronous="SOMETIMES")  # type: ignore[arg-type]
    ledger = await SqliteLedger.open(tmp_path / "x.db", synchronous="NORMAL")
    await ledger.close()


async def test_sqlite_concurrent_openers_migrate_once(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledgers = await asyncio.gather(*(SqliteLedger.open(path) for _ in range(8)))
    try:
        assert {await ledger.schema_version() for ledger in ledgers} == {SQLITE_VERSION}
    finally:
        for ledger in ledgers:
            await ledger.close()


# -- PostgreSQL specifics -------------------------------------------------------------


async def test_postgres_unmigrated_database_says_run_migrate(pg_empty_url: str) -> None:
    with pytest.raises(LedgerSchemaError, match="run `flowdecision migrate`"):
        await PostgresLedger.connect(pg_empty_url)
    with pytest.raises(LedgerSchemaError, match="run `flowdecision migrate`"):
        await open_ledger(pg_empty_url)
    ledger = PostgresLedger(pg_empty_url)
    try:
        assert await ledger.migrate() == (0, PG_VERSION)
        assert await ledger.migrate() == (PG_VERSION, PG_VERSION)  # idempotent
        assert await ledger.schema_version() == PG_VERSION
        assert await ledger.claim("d", "h", "o", lease_ms=10, now_ms=1) == Claimed(1)
    finally:
        await ledger.close()


async def test_postgres_concurrent_migrations_apply_once(pg_empty_url: str) -> None:
    ledgers = [PostgresLedger(pg_empty_url) for _ in range(4)]
    try:
        results = await asyncio.gather(*(ledger.migrate() for ledger in ledgers))
        done = (PG_VERSION, PG_VERSION)
        assert sorted(results) == [(0, PG_VERSION), done, done, done]
    finally:
        for ledger in ledgers:
            await ledger.close()


async def test_postgres_newer_schema_is_refused(pg_empty_url: str) -> None:
    import asyncpg

    ledger = PostgresLedger(pg_empty_url)
    await ledger.migrate()
    await ledger.close()
    conn = await asyncpg.connect(pg_empty_url)
    newer = PG_VERSION + 1
    await conn.execute(
        f"INSERT INTO flowdecision_schema_version (version, name) VALUES ({newer}, 'x')"
    )
    await conn.close()
    with pytest.raises(
        LedgerSchemaError, match=f"schema version {newer}, newer than version {PG_VERSION}"
    ):
        await PostgresLedger.connect(pg_empty_url)
    migrator = PostgresLedger(pg_empty_url)
    try:
        with pytest.raises(LedgerSchemaError, match="newer"):
            await migrator.migrate()
    finally:
        await migrator.close()


async def test_postgres_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    url = f"postgresql://nobody@/db?host={tmp_path}"  # no socket there
    with pytest.raises(
        LedgerUnavailableError,
        match=rf"cannot connect to PostgreSQL ledger nobody@{tmp_path}:5432/db: server unreachable",
    ):
        await PostgresLedger.connect(url, connect_timeout_s=2)
    with pytest.raises(LedgerUnavailableError, match=r"127\.0\.0\.1:1/db"):
        await open_ledger("postgresql://user:secret@127.0.0.1:1/db")
    try:
        await open_ledger("postgresql://user:secret@127.0.0.1:1/db")
    except LedgerUnavailableError as error:
        assert "secret" not in str(error)


async def test_postgres_missing_database_and_permissions_are_clear(
    pg_server_url: str, pg_url: str
) -> None:
    import asyncpg

    missing = pg_url.replace("/flowdecision_test", "/no_such_database")
    with pytest.raises(LedgerUnavailableError, match="database does not exist"):
        await PostgresLedger.connect(missing)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DROP ROLE IF EXISTS flowdecision_reader")
        await conn.execute("CREATE ROLE flowdecision_reader LOGIN")
        await conn.execute("GRANT SELECT ON flowdecision_schema_version TO flowdecision_reader")
    finally:
        await conn.close()
    reader_url = pg_url.replace("://flowdecision@", "://flowdecision_reader@")
    ledger = await PostgresLedger.connect(reader_url)
    try:
        with pytest.raises(LedgerUnavailableError, match="permission denied"):
            await ledger.claim("d", "h", "o", lease_ms=10, now_ms=1)
    finally:
        await ledger.close()


async def test_postgres_uses_database_clock_against_a_skewed_host(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LedgerStore("postgres", Path("."), pg_url=pg_url)
    honest = await store()
    try:
        assert await honest.claim("d", "h", "honest", lease_ms=60_000) == Claimed(1)
        db_now = await honest.db_now_ms()  # type: ignore[attr-defined]
        state = await honest.inspect("d", "h")
        assert isinstance(state, Pending)
        assert db_now < state.lease_expires_at_ms <= db_now + 60_000
        # This host's clock now runs an hour ahead of the database.
        real_time_ns = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + 3_600_000 * 1_000_000)
        ahead = await store()
        assert await ahead.claim("d", "h", "ahead", lease_ms=60_000) == Busy(
            state.lease_expires_at_ms
        )
        with pytest.raises(LedgerError, match="owned by another dispatcher"):
            await ahead.complete("d", "h", "ahead")
        # The honest owner's renew and complete also run on the database clock.
        assert await honest.renew("d", "h", "honest", lease_ms=60_000)
        await honest.complete("d", "h", "honest")
        done = await honest.inspect("d", "h")
        assert isinstance(done, Completed) and done.completed_at_ms is not None
        assert abs(done.completed_at_ms - db_now) < 60_000
        # An explicit time is still honoured (as on every backend).
        assert await ahead.claim("e", "h", "ahead", lease_ms=10, now_ms=5) == Claimed(1)
    finally:
        await store.aclose()


async def test_postgres_racing_inserts_of_a_new_id(pg_url: str) -> None:
    store = LedgerStore("postgres", Path("."), pg_url=pg_url, max_size=20)
    try:
        ledgers = [await store() for _ in range(4)]
        for round_ in range(10):
            outcomes = await asyncio.gather(
                *(
                    ledger.claim(f"race-{round_}", "h", f"o{i}-{j}", lease_ms=10_000, now_ms=1)
                    for i, ledger in enumerate(ledgers)
                    for j in range(5)
                )
            )
            assert sum(isinstance(outcome, Claimed) for outcome in outcomes) == 1
            assert sum(isinstance(outcome, Busy) for outcome in outcomes) == 19
    finally:
        await store.aclose()
