"""The SQL ledgers answer operator queries from indexes, and schemas 4 and 5 reach old stores.

Schema 4 adds the completion-time indexes (``by=completed``), schema 5 the
index of pending claims by lease expiry. A store left at schema 3 with
decisions in it upgrades in place (SQLite on open, PostgreSQL with
``migrate``) and then answers by completion time. Every query shape
(each filter, each order, a cursor, a count) has a plan that reads an index in
the page's order: no full table scan and no sort, so a page costs the same at
a million decisions as at ten (bench/ops_query_bench.py measures it).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import asyncpg
import pytest

from flowdecision.errors import LedgerCorruptError
from flowdecision.ledger.postgres import PostgresLedger
from flowdecision.ledger.query import DecisionQuery, TimeField, encode_cursor
from flowdecision.ledger.rows import LEDGER
from flowdecision.ledger.sqlgen import decision_sql
from flowdecision.ledger.sqlite import SqliteLedger
from flowdecision.ledger.states import DecisionState
from flowdecision.store.component import load_migrations
from flowdecision.store.migrations import split_statements

S = DecisionState
T = TimeField

#: Every query shape the docs name. The exceptions that may sort: a run's decisions by
#: completion (a run's few, read from the run index) and live claims (the few whose
#: lease has not run out, read from the lease index of schema 5).
SHAPES = [
    DecisionQuery(),
    DecisionQuery(run_id="run-1"),
    DecisionQuery(state=S.PENDING_LIVE),
    DecisionQuery(state=S.PENDING_EXPIRED),
    DecisionQuery(state=S.COMPLETED),
    DecisionQuery(state=S.TOMBSTONED),
    DecisionQuery(after_ms=1_000, before_ms=2_000),
    DecisionQuery(state=S.COMPLETED, after_ms=1_000, cursor=encode_cursor([1_500, "d-5"])),
    DecisionQuery(by=T.COMPLETED),
    DecisionQuery(by=T.COMPLETED, after_ms=1_000),
    DecisionQuery(by=T.COMPLETED, state=S.COMPLETED, before_ms=5_000),
    DecisionQuery(by=T.COMPLETED, state=S.TOMBSTONED),
    DecisionQuery(by=T.COMPLETED, cursor=encode_cursor([1_500, "d-5", "completed"])),
]
SORTS_A_RUN = DecisionQuery(by=T.COMPLETED, run_id="run-1")
SORTED = (SORTS_A_RUN, DecisionQuery(state=S.PENDING_LIVE))

#: Completed rows as schema 3 holds them: (id, completed_at_ms, created_at_ms, run_id).
#: Claimed in id order, completed in the reverse.
SCHEMA_3_ROWS = [("old-0", 900, 100, "run-1"), ("old-1", 800, 200, "run-1"),
                 ("old-2", 700, 300, None)]  # fmt: skip


def _record(completed_at_ms: int) -> str:
    done = {
        "request_hash": "h",
        "status": "completed",
        "owner_id": "o",
        "lease_expires_at_ms": 0,
        "attempts": 1,
        "completed_at_ms": completed_at_ms,
    }
    return json.dumps(done, separators=(",", ":"))


def _upto_3(dialect: str) -> list[tuple[int, str, str]]:
    return [m for m in load_migrations("flowdecision.ledger", dialect) if m[0] <= 3]


async def _assert_answers_by_completion(ledger: SqliteLedger | PostgresLedger) -> None:
    page = await ledger.list_decisions(DecisionQuery(by=T.COMPLETED), now_ms=10_000)
    assert [(r.decision_id, r.completed_at_ms, r.created_at_ms) for r in page.decisions] == [
        ("old-2", 700, 300), ("old-1", 800, 200), ("old-0", 900, 100),
    ]  # fmt: skip
    run = await ledger.list_decisions(DecisionQuery(by=T.COMPLETED, run_id="run-1"), now_ms=1)
    assert [row.decision_id for row in run.decisions] == ["old-1", "old-0"]


async def test_a_schema_3_sqlite_ledger_upgrades_on_open_and_answers_by_completion(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(
            f"CREATE TABLE {LEDGER.version_table} (version INTEGER PRIMARY KEY, "
            "name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)"
        )
        for version, name, script in _upto_3("sqlite"):
            for statement in split_statements(script):
                conn.execute(statement)
            conn.execute(f"INSERT INTO {LEDGER.version_table} VALUES (?, ?, 0)", (version, name))
        conn.execute("PRAGMA user_version = 3")
        for key, done_at, created, run in SCHEMA_3_ROWS:
            conn.execute(
                "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record, "
                "created_at_ms, run_id) VALUES (?, 'completed', ?, ?, ?, ?)",
                (key, done_at, _record(done_at), created, run),
            )
    finally:
        conn.close()
    ledger = await SqliteLedger.open(path)
    try:
        assert await ledger.migrate() == (3, LEDGER.newest("sqlite"))
        await _assert_answers_by_completion(ledger)
    finally:
        await ledger.close()
    with sqlite3.connect(path) as check:
        names = {name for (name,) in check.execute("SELECT name FROM sqlite_master")}
    assert {"flowdecision_claims_completed", "flowdecision_claims_prune"} <= names


async def test_a_schema_3_postgres_ledger_upgrades_with_migrate_and_answers_by_completion(
    pg_empty_url: str,
) -> None:
    conn = await asyncpg.connect(pg_empty_url)
    try:
        await conn.execute(
            f"CREATE TABLE {LEDGER.version_table} (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        for version, name, script in _upto_3("postgres"):
            for statement in split_statements(script):
                await conn.execute(statement)
            await conn.execute(
                f"INSERT INTO {LEDGER.version_table} (version, name) VALUES ($1, $2)", version, name
            )
        for key, done_at, created, run in SCHEMA_3_ROWS:
            await conn.execute(
                "INSERT INTO flowdecision_claims (decision_id, status, completed_at_ms, record, "
                "created_at_ms, run_id) VALUES ($1, 'completed', $2, $3, $4, $5)",
                key, done_at, _record(done_at), created, run,
            )  # fmt: skip
    finally:
        await conn.close()
    migrator = PostgresLedger(pg_empty_url)
    try:
        assert await migrator.migrate() == (3, LEDGER.newest("postgres"))
    finally:
        await migrator.close()
    ledger = await PostgresLedger.connect(pg_empty_url)
    try:
        await _assert_answers_by_completion(ledger)
    finally:
        await ledger.close()


def _plan_problems(plan: list[str], *, may_sort: bool) -> list[str]:
    """What in a plan is not "read an index in order" (SQLite's or PostgreSQL's words)."""
    # "SCAN t USING INDEX i" walks an index in order (no range): that is fine.
    problems = [
        line
        for line in plan
        if "Seq Scan" in line or (line.startswith("SCAN ") and "USING" not in line)
    ]
    if not may_sort:
        problems += [line for line in plan if "TEMP B-TREE" in line or "Sort" in line]
    if not any("INDEX" in line.upper() for line in plan):
        problems.append("no index in the plan")
    return problems


@pytest.mark.parametrize("count", [False, True])
async def test_every_sqlite_query_shape_reads_an_index_in_page_order(
    tmp_path: Path, count: bool
) -> None:
    path = tmp_path / "ledger.db"
    await (await SqliteLedger.open(path)).close()
    with sqlite3.connect(path) as conn:
        for query in [*SHAPES, SORTS_A_RUN]:
            sql, params = decision_sql(query, 10_000, "?", count=count)
            plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
            may_sort = count or query in SORTED
            assert not _plan_problems(plan, may_sort=may_sort), (query, plan)


@pytest.mark.parametrize("count", [False, True])
async def test_every_postgres_query_shape_can_read_an_index_in_page_order(
    pg_url: str, count: bool
) -> None:
    """With scans and sorts priced out, the planner still finds a plan: an index in order.

    (At a handful of rows the planner rightly prefers a scan; the benchmark shows
    it picks these indexes by itself at a million.)"""
    conn = await asyncpg.connect(pg_url)
    try:
        for setting in ("enable_seqscan", "enable_bitmapscan", "enable_sort"):
            await conn.execute(f"SET {setting} = off")
        for query in [*SHAPES, SORTS_A_RUN]:
            sql, params = decision_sql(query, 10_000, "$", count=count)
            plan = [row[0] for row in await conn.fetch(f"EXPLAIN {sql}", *params)]
            may_sort = count or query in SORTED
            assert not _plan_problems(plan, may_sort=may_sort), (query, plan)
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("text", "problem"),
    [("{not json", "decode decision `bad`"), ('{"request_hash": "h", "status": "pending", '
     '"owner_id": "o", "lease_expires_at_ms": 1, "attempts": "2"}', "`attempts`")],
)  # fmt: skip
async def test_a_listing_reports_a_corrupt_row_naming_it(
    tmp_path: Path, text: str, problem: str
) -> None:
    """Listings decode a summary of each record (no identity, no receipt), still checked."""
    path = tmp_path / "ledger.db"
    ledger = await SqliteLedger.open(path)
    await ledger.claim("good", "h", "o", lease_ms=60_000, now_ms=10)
    await ledger.close()
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO flowdecision_claims (decision_id, status, record, created_at_ms) "
            "VALUES ('bad', 'pending', ?, 20)",
            (text,),
        )
    ledger = await SqliteLedger.open(path)
    try:
        page = await ledger.list_decisions(DecisionQuery(before_ms=20), now_ms=15)
        assert [row.decision_id for row in page.decisions] == ["good"]
        with pytest.raises(LedgerCorruptError) as corrupt:
            await ledger.list_decisions(DecisionQuery(), now_ms=15)
        assert "decision `bad`" in str(corrupt.value) and problem in str(corrupt.value)
    finally:
        await ledger.close()
